"""One engine called from several threads at once serves every caller as if it were alone.

A learned drafter keeps per-sequence state (its context cache, the features committed since it
last drafted); two generations interleaved on one engine used to corrupt it ("context out of
step", tensor size mismatches). The engine now serves its callers in turn.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine

from tests.drafters.tiny_heads import jetflow_registered, save_head, tiny_head


@pytest.fixture(scope="module")
def head_folder(tiny_llama, tmp_path_factory):
    return save_head(tmp_path_factory.mktemp("thread-head"), tiny_llama, tiny_head(tiny_llama))


def test_two_threads_on_one_engine_get_their_own_answers(tiny_llama, head_folder) -> None:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=generator).tolist() for n in (3, 7, 4, 9, 5, 6)]
    with jetflow_registered():
        config = build_config(
            GenerateConfig,
            {
                "drafter": "jetflow",
                "drafter_params": {"checkpoint": str(head_folder)},
                "tree": {"budget": 4, "width": 2},
                "max_new_tokens": 12,
                "stop_at_eos": False,
            },
        )
        engine = Engine(config, tiny_llama)
        alone = [engine.generate(prompt).token_ids for prompt in prompts]
        start = threading.Barrier(2)

        def serve(share: list[list[int]]) -> list[list[int]]:
            start.wait()  # both callers enter generate at once
            return [engine.generate(prompt).token_ids for prompt in share]

        with ThreadPoolExecutor(max_workers=2) as pool:
            first, second = pool.map(serve, [prompts[0::2], prompts[1::2]])
    assert first == alone[0::2]
    assert second == alone[1::2]
