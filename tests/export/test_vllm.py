"""vLLM serves exported heads (causal and bidirectional DFlash, Eagle3) losslessly (``-m vllm``).

Slow (each engine takes minutes to load on a CPU), so it runs where ``make vllm`` has built
vLLM's environment; the format is checked without vLLM by the other tests of this folder.
"""

from __future__ import annotations

import pytest
from jetflow.bench.vllm_methods import VllmWorker, accepted_per_step, chain_lengths
from jetflow.export.exporter import build_export, verifier_for
from jetflow.export.folder import write_export

from tests.export.test_speculators import PLAIN, make_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPTS = ("Write a Python function that reverses a list.", "Name three primary colours.")
BLOCK = PLAIN | {"num_layers": 1, "block_size": 8, "draft_vocab_size": 4096}
#: one random head per exporting drafter: (drafter, head options, vLLM method); chains of 3 tokens,
#: except the bidirectional block, which drafts all of its 7 slots
HEADS = {
    "jetflow": ("jetflow", BLOCK, "dflash"),  # the causal in-block mask
    "dflash": ("dflash", BLOCK, "dflash"),  # bidirectional
    "eagle3": ("eagle", {"layout": "eagle3", "ttt_steps": 3, "draft_vocab_size": 4096}, "eagle3"),
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
    tokens: dict[str, int] = {}
    for name, (drafter, options, method) in HEADS.items():
        make_checkpoint(real_target, tmp_path / name, drafter=drafter, base=options)
        export = build_export(drafter, real_target, params={"checkpoint": str(tmp_path / name)})
        assert export.config.speculators_model_type == method
        head = write_export(export, tmp_path / f"head-{name}")
        tokens[name] = chain_lengths(export.config, [3])[0]
        speculative = {"method": method, "model": str(head), "num_speculative_tokens": tokens[name]}
        runs[name] = {"speculative_config": speculative}
    assert tokens == {"jetflow": 3, "dflash": 7, "eagle3": 3}
    stop = sorted(real_target.eos_token_ids)
    prompts = [real_target.encode_prompt(prompt) for prompt in PROMPTS]
    replies = {}
    for name, extra in runs.items():
        worker = VllmWorker(settings | extra, tmp_path / f"{name}.log")
        try:
            replies[name] = [worker.generate(ids, 32, stop) for ids in prompts]
        finally:
            worker.close()
    for name in HEADS:
        for plain, drafted in zip(replies["plain"], replies[name], strict=True):
            assert drafted["token_ids"] == plain["token_ids"], name
            assert drafted["drafts"] > 0  # it drafted, the whole chain each time
            assert drafted["draft_tokens"] == tokens[name] * drafted["drafts"], name
            assert sum(accepted_per_step(drafted)) == drafted["accepted_tokens"]
