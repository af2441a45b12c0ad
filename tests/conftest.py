"""Shared fixtures: tiny random targets built from configs, and the real embedded target."""

from __future__ import annotations

import os

import pytest
import torch
from jetflow.core.cache_root import cache_root
from jetflow.core.precision import DEVICE_VARIABLE, default_device
from jetflow.core.target import Target
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models run fastest on one thread, and a second thread thrashes when the machine is
# shared; JETFLOW_TEST_THREADS lets a quiet machine use more for the real target.
torch.set_num_threads(int(os.environ.get("JETFLOW_TEST_THREADS", "1")))

TINY_VOCAB = 256
EOS_ID = 1


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w0 .. w253`` plus ``<pad>`` and ``<eos>``: fast, no files."""
    vocab = {"<pad>": 0, "<eos>": EOS_ID, **{f"w{i}": i + 2 for i in range(TINY_VOCAB - 2)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def _common(**extra) -> dict:
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        **extra,
    )


TINY_ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_common())),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_common(head_dim=16))),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**_common(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    ),
}


def make_tiny_target(architecture: str = "llama", seed: int = 0) -> Target:
    """A randomly initialised target of the given architecture, in fp32.

    Random weights give near-uniform next-token distributions, which would make greedy
    continuations hinge on ties; scaling the LM head sharpens them so greedy decoding is
    well defined and repetitive enough to exercise n-gram drafting.
    """
    torch.manual_seed(seed)
    model = TINY_ARCHITECTURES[architecture]().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = 0
    # the CPU, unless JETFLOW_DEVICE names another device (`make gpu-check` runs these on CUDA)
    device = default_device() if os.environ.get(DEVICE_VARIABLE) else torch.device("cpu")
    return Target(model.to(device), tiny_tokenizer(), f"tiny-{architecture}")


@pytest.fixture(scope="session", autouse=True)
def _private_jetflow_cache(tmp_path_factory):
    """The test session's own jetflow cache: no test reads the user's calibrations (which would
    choose budgets, or the compiled target, behind a test's back) or writes into them. Only the
    derived data keyed by its content is shared: the de-quantised targets and the feature caches."""
    user = cache_root()
    private = tmp_path_factory.mktemp("jetflow-cache")
    for shared in ("targets", "features"):
        (user / shared).mkdir(parents=True, exist_ok=True)
        (private / shared).symlink_to(user / shared, target_is_directory=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("JETFLOW_CACHE", str(private))
    yield private
    patch.undo()


@pytest.fixture(scope="session", params=sorted(TINY_ARCHITECTURES))
def tiny_target(request) -> Target:
    return make_tiny_target(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> Target:
    return make_tiny_target("llama")


@pytest.fixture(scope="session")
def real_target() -> Target:
    """The embedded SmolLM2-135M-Instruct in fp32 (de-quantised once into the cache)."""
    return Target.load("default", torch.float32)
