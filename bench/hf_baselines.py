"""The peers a user gets for free: ``transformers.generate``, plain and with prompt lookup.

``generate`` reports neither its forwards nor its acceptance, so a probe hooks the target
model for the duration of one call: each forward's start position (from ``position_ids``)
gives the tokens that forward emitted, hence tau and the acceptance histogram, and the
hooks time the forwards. Prompt lookup's drafting time is taken by timing its candidate
generator's ``get_candidates`` for the call.

Both run as a user runs them: plain ``transformers`` on the model's own weights, without the
packed linear weights of jetflow's target (:mod:`jetflow.core.packed_weights`).

Batched (``generate_batch``, plain ``generate`` only: transformers' prompt lookup decodes one
sequence at a time), prompts go ``batch_size`` at a time in input order, left-padded as
``generate`` wants them; a batch ends when its last row does (transformers has no continuous
batching), so every row's latency is its batch's time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from jetflow.bench.generation import BatchGeneration, BatchMethod, Generation
from jetflow.core.packed_weights import unpacked
from jetflow.core.target import Target
from transformers import GenerationConfig

log = logging.getLogger(__name__)


@dataclass
class ForwardProbe:
    """Forwards of one ``generate`` call: the first position each one fed, and their time."""

    starts: list[int] = field(default_factory=list)
    forward_s: float = 0.0
    _entered: float = 0.0

    def before(self, _module: torch.nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = kwargs.get("cache_position")
        self.starts.append(-1 if positions is None else int(positions.reshape(-1)[0]))
        self._entered = time.perf_counter()

    def after(self, *_: object) -> None:
        self.forward_s += time.perf_counter() - self._entered

    def accepted(self, prompt_len: int, new_tokens: int) -> tuple[int, ...] | None:
        """Drafted tokens accepted per forward, from where each next forward starts.

        Forward ``i + 1`` starts at the last token forward ``i`` emitted, so its start
        position is ``prompt_len + emitted so far - 1``; unknown positions give None.
        """
        if not self.starts or min(self.starts) < 0:
            return None
        emitted_before = torch.tensor([*self.starts[1:]], dtype=torch.long) - prompt_len + 1
        ends = torch.cat([emitted_before, torch.tensor([new_tokens])])
        emitted = torch.diff(ends, prepend=torch.tensor([0]))
        if bool((emitted < 1).any()):
            log.debug("probe positions %s do not describe a greedy decode; no histogram", self.starts)
            return None
        return tuple((emitted - 1).tolist())


@contextmanager
def _probed(model: torch.nn.Module) -> Iterator[ForwardProbe]:
    probe = ForwardProbe()
    handles = [
        model.register_forward_pre_hook(probe.before, with_kwargs=True),
        model.register_forward_hook(probe.after),
    ]
    try:
        yield probe
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class _Stopwatch:
    seconds: float = 0.0


@contextmanager
def _timed_candidates(enabled: bool) -> Iterator[_Stopwatch]:
    """Time ``PromptLookupCandidateGenerator.get_candidates`` (prompt lookup's drafting)."""
    watch = _Stopwatch()
    if not enabled:
        yield watch
        return
    from transformers.generation import candidate_generator

    owner = getattr(candidate_generator, "PromptLookupCandidateGenerator", None)
    original = getattr(owner, "get_candidates", None)
    if owner is None or original is None:
        log.warning("transformers has no PromptLookupCandidateGenerator.get_candidates: draft time unknown")
        yield watch
        return

    def timed(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            watch.seconds += time.perf_counter() - start

    owner.get_candidates = timed
    try:
        yield watch
    finally:
        owner.get_candidates = original


class HFGenerateMethod(BatchMethod):
    """``target.model.generate``, greedy or (``temperature`` > 0) pure sampling at that temperature;
    with ``prompt_lookup_num_tokens`` it is HF's prompt lookup."""

    budget: int | None = None
    policy: str | None = None

    def __init__(
        self,
        name: str,
        target: Target,
        prompt_lookup_num_tokens: int | None = None,
        temperature: float = 0.0,
    ) -> None:
        self.name = name
        self.target = target
        eos = sorted(target.eos_token_ids)
        # A clean config: sampling knobs a checkpoint ships with (top-k 50, ...) must not leak in.
        sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
        self.options: dict[str, Any] = {
            "do_sample": temperature > 0,
            **sampling,
            "eos_token_id": eos or None,
            "pad_token_id": eos[0] if eos else 0,
            "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
        }

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        model = self.target.model
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.target.device)
        config = GenerationConfig(**self.options, max_new_tokens=max_new_tokens)
        lookup = self.options["prompt_lookup_num_tokens"] is not None
        with unpacked(model), _probed(model) as probe, _timed_candidates(lookup) as drafting:
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            wall = time.perf_counter() - start
        new = tuple(out[0, ids.shape[1] :].tolist())
        return Generation(
            token_ids=new,
            wall_s=wall,
            steps=len(probe.starts),
            draft_s=drafting.seconds,
            verify_s=probe.forward_s,
            accepted=probe.accepted(ids.shape[1], len(new)),
        )

    @property
    def batchable(self) -> bool:
        return self.options["prompt_lookup_num_tokens"] is None

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int
    ) -> BatchGeneration:
        """``generate`` on consecutive batches of ``batch_size`` left-padded prompts."""
        if not self.batchable:
            raise ValueError(f"{self.name} decodes one sequence at a time")
        rows: list[Generation] = []
        forwards, row_steps, forward_s = 0, 0, 0.0
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            generations, probe = self._padded_batch(prompts[first : first + batch_size], max_new_tokens)
            rows += generations
            forwards += len(probe.starts)
            row_steps += sum(generation.steps for generation in generations)
            forward_s += probe.forward_s
        wall = time.perf_counter() - start
        return BatchGeneration(tuple(rows), wall, forwards, row_steps, 0.0, forward_s)

    @torch.inference_mode()
    def _padded_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> tuple[list[Generation], ForwardProbe]:
        """One ``generate`` call over ``prompts``, left-padded; each row cut after its first EOS
        (a finished row is filled with the pad token, EOS itself, until the batch ends)."""
        model, device = self.target.model, self.target.device
        width = max(len(prompt) for prompt in prompts)
        pad = self.options["pad_token_id"]
        ids = torch.tensor(
            [[pad] * (width - len(prompt)) + list(prompt) for prompt in prompts],
            dtype=torch.long,
            device=device,
        )
        mask = torch.tensor(
            [[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts],
            dtype=torch.long,
            device=device,
        )
        config = GenerationConfig(**self.options, max_new_tokens=max_new_tokens)
        with unpacked(model), _probed(model) as probe:
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, generation_config=config)
            wall = time.perf_counter() - start
        eos = set(self.target.eos_token_ids) if self.options["eos_token_id"] else set()
        generations = []
        for row in out[:, width:].tolist():
            ends = [index for index, token in enumerate(row) if token in eos]
            new = tuple(row[: ends[0] + 1] if ends else row)
            # one token per forward while the row runs: plain decoding, tau 1
            generations.append(Generation(new, wall, len(new), 0.0, probe.forward_s, (0,) * len(new)))
        return generations, probe
