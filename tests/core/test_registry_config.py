"""Plugin discovery through entry points, and config validation before any model loads."""

from __future__ import annotations

import types

import pytest
from jetflow.core.config import GenerateConfig, build_config, load_toml, merge
from jetflow.core.contracts import Drafter, TreePolicy
from jetflow.core.errors import ConfigError, JetflowError, PluginNotFoundError
from jetflow.core.hookspecs import hookimpl
from jetflow.core.registry import Registry, default_registry


def test_builtins_and_the_ngram_plugin_come_from_their_distributions() -> None:
    listing = default_registry().describe()
    assert set(listing) == {"drafters", "tree_policies", "verifiers"}
    by_name = {entry["name"]: entry for kind in listing.values() for entry in kind}
    assert by_name["ngram"]["distribution"] == "jetflow-ngram"
    assert by_name["best-first"]["distribution"] == "jetflow"
    assert by_name["greedy"]["distribution"] == "jetflow"
    assert all(entry["description"] for entry in by_name.values())


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(PluginNotFoundError, match=r"unknown drafter 'nope'; known drafters: .*ngram.*none"):
        build_config(GenerateConfig, {"drafter": "nope"})
    with pytest.raises(PluginNotFoundError, match=r"known tree policies: .*best-first.*chain"):
        build_config(GenerateConfig, {"tree": {"policy": "zigzag"}})
    with pytest.raises(PluginNotFoundError, match=r"known verifiers: .*greedy"):
        build_config(GenerateConfig, {"verifier": "maybe"})


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"tree": {"budget": "zero"}}, "tree.budget"),
        ({"tree": {"budget": -4}}, "tree.budget"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"dtype": "float8"}, "dtype"),
        ({"drafter_params": {"max_ngram": 0}}, "max_ngram"),
        ({"drafter_params": {"unknown_knob": 1}}, "unknown_knob"),
        ({"temperature": 0.7}, "temperature"),
    ],
)
def test_invalid_values_name_the_field(fields: dict, field_name: str) -> None:
    with pytest.raises(ConfigError, match=field_name.replace(".", r"\.")):
        build_config(GenerateConfig, fields)


@pytest.mark.parametrize("stop", [[""], ["###", ""]])
def test_an_empty_stop_string_is_refused(stop: list[str]) -> None:
    """It occurs in every text, so it would cut every answer after its first token."""
    with pytest.raises(ConfigError, match="invalid config: stop: a stop string cannot be empty"):
        build_config(GenerateConfig, {"stop": stop})


def test_toml_file_with_cli_overrides(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('drafter = "ngram"\nmax_new_tokens = 64\n[tree]\npolicy = "chain"\nbudget = 4\n')
    config = build_config(GenerateConfig, merge(load_toml(path), {"tree": {"budget": 8}}))
    assert (config.tree.policy, config.tree.budget, config.max_new_tokens) == ("chain", 8, 64)
    bad = tmp_path / "bad.toml"
    bad.write_text("drafter = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_toml(tmp_path / "missing.toml")


def test_a_name_registered_twice_is_an_error() -> None:
    class Copy(TreePolicy):
        name = "chain"
        description = "an impostor"

        def build(self, session, root, shape):
            return root

    module = types.SimpleNamespace(jetflow_tree_policies=hookimpl(lambda: [Copy]))
    registry = Registry.from_entry_points()
    registry.register(module, name="impostor")
    with pytest.raises(JetflowError, match="two plugins register the tree policy 'chain'"):
        registry.names("tree_policy")


def test_a_hook_returning_a_non_plugin_is_an_error() -> None:
    module = types.SimpleNamespace(jetflow_drafters=hookimpl(lambda: [object]))
    registry = Registry.from_entry_points()
    registry.register(module, name="broken")
    with pytest.raises(JetflowError, match=f"does not subclass {Drafter.__name__}"):
        registry.plugins("drafter")
