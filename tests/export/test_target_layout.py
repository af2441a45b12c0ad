"""The embedded target's cached folder is a standard Hugging Face folder (vLLM reads it as is)."""

from __future__ import annotations

import torch
from jetflow.core.model_files import _save_plain
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.conftest import tiny_tokenizer


def test_a_tied_embedding_is_stored_as_the_input_embedding(tmp_path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path / "target"
    _save_plain(model, tiny_tokenizer(), folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert torch.equal(embedding, model.get_input_embeddings().weight)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    ids = torch.tensor([[3, 5, 7, 11]])
    assert torch.equal(reloaded(ids).logits, model(ids).logits)
