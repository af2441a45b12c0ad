"""vLLM itself serves exported heads (DFlash, Eagle3) on the embedded target, losslessly (``-m vllm``).

Slow (each engine takes minutes to load on a CPU), so it runs where ``make vllm`` has built
vLLM's environment; the format is checked without vLLM by the other tests of this folder.
"""

from __future__ import annotations

import pytest
from jetflow.bench.vllm_methods import VllmWorker, accepted_per_step
from jetflow.export.exporter import build_export, verifier_for
from jetflow.export.folder import write_export

from tests.export.test_speculators import PLAIN, make_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPTS = ("Write a Python function that reverses a list.", "Name three primary colours.")
#: one random head per vLLM method, each drafting 3 tokens a step: (drafter, head options)
HEADS = {
    "dflash": ("jetflow", PLAIN | {"num_layers": 1, "block_size": 8, "draft_vocab_size": 4096}),
    "eagle3": ("eagle", {"layout": "eagle3", "ttt_steps": 3, "draft_vocab_size": 4096}),
}


def test_vllm_serves_exported_heads_with_the_output_of_plain_decoding(real_target, tmp_path) -> None:
    settings = {
        "model": verifier_for("default"),
        "dtype": "float32",
        "max_model_len": 1024,
        "gpu_memory_utilization": 0.3,
        "enable_prefix_caching": False,
        "disable_log_stats": False,
    }
    runs: dict[str, dict] = {"plain": {}}
    for method, (drafter, options) in HEADS.items():
        make_checkpoint(real_target, tmp_path / method, drafter=drafter, base=options)
        export = build_export(drafter, real_target, params={"checkpoint": str(tmp_path / method)})
        assert export.config.speculators_model_type == method
        head = write_export(export, tmp_path / f"head-{method}")
        runs[method] = {
            "speculative_config": {"method": method, "model": str(head), "num_speculative_tokens": 3}
        }
    stop = sorted(real_target.eos_token_ids)
    prompts = [real_target.encode_prompt(prompt) for prompt in PROMPTS]
    replies = {}
    for name, extra in runs.items():
        worker = VllmWorker(settings | extra, tmp_path / f"{name}.log")
        try:
            replies[name] = [worker.generate(ids, 32, stop) for ids in prompts]
        finally:
            worker.close()
    for method in HEADS:
        for plain, drafted in zip(replies["plain"], replies[method], strict=True):
            assert drafted["token_ids"] == plain["token_ids"], method
            assert drafted["drafts"] > 0 and drafted["draft_tokens"] == 3 * drafted["drafts"]  # it drafted
            assert sum(accepted_per_step(drafted)) == drafted["accepted_tokens"]
