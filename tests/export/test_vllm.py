"""vLLM itself loads an exported head on the embedded target and decodes losslessly (opt-in: ``-m vllm``).

Slow (each engine takes minutes to load on a CPU), so it runs where ``make vllm`` has built
vLLM's environment; the format is checked without vLLM by the other tests of this folder.
"""

from __future__ import annotations

import pytest
from jetflow.bench.vllm_methods import VllmWorker, accepted_per_step
from jetflow.export.exporter import build_export, verifier_for
from jetflow.export.folder import write_export

from tests.export.test_speculators import make_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPTS = ("Write a Python function that reverses a list.", "Name three primary colours.")


def test_vllm_serves_an_exported_head_with_the_output_of_plain_decoding(real_target, tmp_path) -> None:
    make_checkpoint(real_target, tmp_path / "ckpt", num_layers=1, block_size=8, draft_vocab_size=4096)
    export = build_export("jetflow", real_target, params={"checkpoint": str(tmp_path / "ckpt")})
    head = write_export(export, tmp_path / "head")
    settings = {
        "model": verifier_for("default"),
        "dtype": "float32",
        "max_model_len": 1024,
        "gpu_memory_utilization": 0.3,
        "enable_prefix_caching": False,
        "disable_log_stats": False,
    }
    speculative = {"method": "dflash", "model": str(head), "num_speculative_tokens": 3}
    stop = sorted(real_target.eos_token_ids)
    prompts = [real_target.encode_prompt(prompt) for prompt in PROMPTS]
    replies = {}
    for name, extra in (("plain", {}), ("dflash", {"speculative_config": speculative})):
        worker = VllmWorker(settings | extra, tmp_path / f"{name}.log")
        try:
            replies[name] = [worker.generate(ids, 32, stop) for ids in prompts]
        finally:
            worker.close()
    for plain, drafted in zip(replies["plain"], replies["dflash"], strict=True):
        assert drafted["token_ids"] == plain["token_ids"]
        assert drafted["drafts"] > 0 and drafted["draft_tokens"] == 3 * drafted["drafts"]  # the head drafted
        assert sum(accepted_per_step(drafted)) == drafted["accepted_tokens"]
