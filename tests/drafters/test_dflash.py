"""The dflash drafter: the block head with a bidirectional mask, its recipe and lossless decoding."""

from __future__ import annotations

import pytest
import torch
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.errors import CheckpointMismatchError, ConfigError
from jetflow.core.registry import default_registry
from jetflow.drafters.dflash.plugin import DFlashDrafter
from jetflow.drafters.jetflow.plugin import BlockHeadParams, JetFlowDrafter
from jetflow.drafters.training import TrainConfig

from .tiny_heads import quick_trainer, save_head, tiny_head


def test_dflash_is_registered_with_chain_as_its_policy() -> None:
    drafter_cls = default_registry().get("drafter", "dflash")
    assert drafter_cls is DFlashDrafter and drafter_cls.default_tree_policy == "chain"
    assert not drafter_cls.causal and JetFlowDrafter.causal


def test_the_recipes_differ_only_in_the_in_block_mask() -> None:
    """The shipped jetflow recipe is DFlash's on the causal block (the ablation's winning arm);
    the dflash recipe extends it, so the two heads train on the same terms."""
    dflash = TrainConfig.from_toml(DFlashDrafter.default_train_config())
    jetflow = TrainConfig.from_toml(JetFlowDrafter.default_train_config())
    assert (dflash.loss.kind, dflash.loss.depth_decay) == ("sft", 4.0)
    different = {"drafter", "out"}
    assert dflash.model_dump(exclude=different) == jetflow.model_dump(exclude=different)
    assert "path_conditioning" not in jetflow.head and "causal" not in jetflow.head


def test_new_heads_are_bidirectional_and_a_causal_option_is_refused(tiny_llama) -> None:
    assert not DFlashDrafter.new_head(tiny_llama, {"num_layers": 1}).config.causal
    with pytest.raises(ConfigError, match="causal=False"):
        DFlashDrafter.new_head(tiny_llama, {"causal": True})


def test_a_causal_head_is_refused(tiny_llama, tmp_path) -> None:
    folder = save_head(tmp_path / "causal", tiny_llama, tiny_head(tiny_llama), drafter="dflash")
    with pytest.raises(CheckpointMismatchError, match="causal=False"):
        DFlashDrafter(BlockHeadParams(checkpoint=str(folder)), tiny_llama)


@pytest.fixture(scope="module")
def dflash_head(tiny_llama, tmp_path_factory):
    head = tiny_head(tiny_llama, causal=False)
    trainer = quick_trainer(
        tiny_llama, tmp_path_factory.mktemp("dflash"), head=head, drafter="dflash", steps=30
    )
    return trainer.fit().final_checkpoint


@pytest.mark.parametrize("policy", ["chain", "best-first"])
def test_engine_with_dflash_is_lossless(tiny_llama, dflash_head, policy: str) -> None:
    def engine(**fields) -> Engine:
        fields |= {"max_new_tokens": 20, "stop_at_eos": False}
        return Engine(build_config(GenerateConfig, fields), tiny_llama)

    prompts = [
        torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 8)
    ]
    baseline = engine(drafter="none")
    spec = engine(
        drafter="dflash",
        drafter_params={"checkpoint": str(dflash_head)},
        tree={"policy": policy, "budget": 8, "width": 3},
    )
    for prompt in prompts:
        assert spec.generate(prompt).token_ids == baseline.generate(prompt).token_ids
