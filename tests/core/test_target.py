"""Tree verification and cache commit on tiny Llama, Qwen3 and Qwen3-MoE targets.

Every tree node's logits must equal those of running its branch alone, and after a
commit the cache must behave exactly as if only the accepted path had been processed.
Wrong masks, wrong positions or a wrong commit all break these equalities.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jetflow.core.errors import TargetError
from jetflow.core.target import Target
from jetflow.core.tree import DraftTree
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .test_tree import random_trees

ATOL = 1e-4


def _full_logits(target: Target, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return target.model(input_ids=torch.tensor([ids])).logits[0].float()


@st.composite
def prefixed_trees(draw):
    prefix = draw(st.lists(st.integers(2, 255), min_size=1, max_size=20))
    tree = draw(random_trees(max_nodes=14))
    accepted = draw(st.integers(0, tree.size - 1))
    follow_up = draw(st.integers(2, 255))
    return prefix, tree, accepted, follow_up


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=prefixed_trees())
def test_tree_verify_equals_each_branch_alone(tiny_target: Target, case) -> None:
    prefix, tree, _, _ = case
    cache, _ = tiny_target.prefill(torch.tensor(prefix))
    out = tiny_target.verify(cache, tree)
    assert cache.get_seq_length() == len(prefix) + tree.size
    for node in range(tree.size):
        branch = prefix + tree.tokens[tree.path(node)].tolist()
        expected = _full_logits(tiny_target, branch)[-1]
        torch.testing.assert_close(out.logits[node], expected, atol=ATOL, rtol=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=prefixed_trees())
def test_commit_keeps_exactly_the_accepted_path(tiny_target: Target, case) -> None:
    prefix, tree, accepted, follow_up = case
    cache, _ = tiny_target.prefill(torch.tensor(prefix))
    tiny_target.verify(cache, tree)
    path = tree.path(accepted)
    tiny_target.commit(cache, len(prefix), path)
    assert cache.get_seq_length() == len(prefix) + len(path)
    # Whatever comes next must see the prefix and the accepted path, nothing else.
    out = tiny_target.verify(cache, DraftTree.root(follow_up))
    expected = _full_logits(tiny_target, prefix + tree.tokens[path].tolist() + [follow_up])[-1]
    torch.testing.assert_close(out.logits[0], expected, atol=ATOL, rtol=0)


def test_commit_into_a_layer_without_keys_is_a_clear_error() -> None:
    cache = DynamicCache()
    cache.layers = [DynamicLayer()]  # never written: no keys or values to keep
    with pytest.raises(TargetError, match="cannot commit a tree path into a DynamicLayer"):
        Target.commit(cache, 0, torch.tensor([0]))


def test_features_are_the_requested_hidden_states(tiny_llama: Target) -> None:
    ids = torch.tensor([5, 9, 13, 7, 3])
    cache, features = tiny_llama.prefill(ids[:-1], layers=(1, 3))
    out = tiny_llama.verify(cache, DraftTree.root(int(ids[-1])), layers=(1, 3))
    with torch.inference_mode():
        hidden = tiny_llama.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    expected = torch.stack([hidden[1][0], hidden[3][0]], dim=1)
    assert features.shape == (4, 2, 64)
    torch.testing.assert_close(torch.cat([features, out.features]), expected, atol=ATOL, rtol=0)
