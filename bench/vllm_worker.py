"""One vLLM engine answering greedy generations over a pipe, run with ``.venv-vllm/bin/python``.

vLLM pins a transformers release jetflow cannot import, so it lives in its own environment
and this file imports nothing of jetflow (only vLLM and the standard library). Protocol:
the engine settings are one JSON argument; the worker prints ``{"ready": ...}`` on its
protocol stream once loaded, then answers each request line
``{"prompt_ids": [...], "max_new_tokens": n, "stop_token_ids": [...]}`` with one line
``{"token_ids", "wall_s", "drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos"}``
(the spec-decode counters are vLLM's own metrics, taken as differences around the call).
It exits when its input closes. vLLM's logs go to stderr; the protocol has stdout to itself.
"""

import json
import os
import sys
import time

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm):
    """vLLM's speculative-decoding counters so far: totals and accepted tokens per draft position."""
    totals = dict.fromkeys(_COUNTERS.values(), 0)
    per_pos = []
    for metric in llm.get_metrics():
        if metric.name in _COUNTERS:
            totals[_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == _PER_POS:
            values = [int(v) for v in metric.values]
            per_pos = [a + b for a, b in zip(per_pos, values, strict=False)] + values[len(per_pos) :]
    return totals, per_pos


def serve(settings, requests, replies):
    from vllm import LLM, SamplingParams, TokensPrompt

    started = time.perf_counter()
    llm = LLM(**settings)
    replies.write(json.dumps({"ready": True, "load_s": time.perf_counter() - started}) + "\n")
    replies.flush()
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=request["max_new_tokens"],
            stop_token_ids=request.get("stop_token_ids") or None,
            detokenize=False,
        )
        before, before_pos = spec_counters(llm)
        t0 = time.perf_counter()
        output = llm.generate(TokensPrompt(prompt_token_ids=request["prompt_ids"]), params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after, after_pos = spec_counters(llm)
        before_pos += [0] * (len(after_pos) - len(before_pos))
        reply = {
            "token_ids": list(output[0].outputs[0].token_ids),
            "wall_s": wall,
            **{key: after[key] - before[key] for key in after},
            "accepted_per_pos": [a - b for a, b in zip(after_pos, before_pos, strict=True)],
        }
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard keeps them from rerunning this
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # everything else printed to stdout (vLLM's logs, its children's) goes to stderr
    serve(json.loads(sys.argv[1]), sys.stdin, protocol)
