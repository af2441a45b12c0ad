"""The cost model (pure): tokens per second from acceptance and step costs, and the budget choice.

A decoding step at budget ``B`` emits ``tau(B)`` tokens and costs ``draft(B) + verify(B)``,
so its speed is ``tau / (draft + verify)``. ``T(n)``, the verify latency of an ``n``-node
tree, is measured at a few sizes and interpolated between them. These functions hold no
state and read no clock; :mod:`jetflow.core.calibration` measures their inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: predictions within this relative distance of the best count as equal; the smaller budget wins.
#: Repeated calibrations of one setup on a loaded machine move the expected speeds of nearby
#: budgets by a few percent while the ranking of clearly different budgets holds.
CHOICE_TOLERANCE = 0.05
#: calibration stops growing the budget once two in a row fall below this share of the best
EARLY_STOP_FRACTION = 0.8


def expected_tokens_per_s(
    tau: Sequence[float], draft_s: Sequence[float], verify_s: Sequence[float]
) -> np.ndarray:
    """``tau / (draft + verify)`` per budget: tokens emitted per second of one decoding step."""
    cost = np.asarray(draft_s, dtype=float) + np.asarray(verify_s, dtype=float)
    return np.asarray(tau, dtype=float) / np.maximum(cost, 1e-12)


def choose_budget(budgets: Sequence[int], tokens_per_s: Sequence[float], tolerance: float = 0.0) -> int:
    """The smallest budget whose expected tokens/s is within ``tolerance`` (relative) of the best.

    With ``tolerance`` 0 that is the argmax, the smaller budget on a tie. A calibration passes
    :data:`CHOICE_TOLERANCE`: predictions that close are within the model's error on a loaded
    machine, and the smaller tree is then the safer bet (less memory, less drafter work, and
    at 0 no drafting at all).
    """
    if len(budgets) == 0 or len(budgets) != len(tokens_per_s):
        raise ValueError("choose_budget needs one expected speed per budget")
    order = np.argsort(np.asarray(budgets), kind="stable")
    speeds = np.asarray(tokens_per_s, dtype=float)[order]
    good_enough = speeds >= (1.0 - tolerance) * speeds.max()
    return int(np.asarray(budgets)[order][int(np.argmax(good_enough))])


def interpolate_latency(
    sizes: Sequence[int], latency_s: Sequence[float], at: Sequence[int] | np.ndarray
) -> np.ndarray:
    """``T`` at tree sizes ``at``, piecewise linear between measured sizes (clamped at the ends)."""
    return np.interp(np.asarray(at, dtype=float), np.asarray(sizes, dtype=float), np.asarray(latency_s))


def past_the_peak(speeds: Sequence[float], fraction: float = EARLY_STOP_FRACTION) -> bool:
    """Two budgets in a row (the last two of ``speeds``, smallest budget first) below ``fraction``
    of the best: growing the budget further will not pay.

    tau saturates with the budget while the verify cost keeps growing, so once the expected
    speed has clearly turned down, larger (and the most expensive to measure) budgets lose.
    """
    if len(speeds) < 3:
        return False
    best = max(speeds)
    return all(speed < fraction * best for speed in speeds[-2:])


def extrapolate_latency(
    sizes: Sequence[int], latency_s: Sequence[float], at: Sequence[float] | np.ndarray
) -> np.ndarray:
    """``T`` at ``at`` tokens: interpolated between measured sizes, and past the largest on the
    slope of the last two (a verify of many rows' trees is a forward of that many tokens)."""
    sizes_a, latency_a = np.asarray(sizes, dtype=float), np.asarray(latency_s, dtype=float)
    at_a = np.asarray(at, dtype=float)
    inside = np.interp(at_a, sizes_a, latency_a)
    if len(sizes_a) < 2:
        return inside
    slope = max((latency_a[-1] - latency_a[-2]) / (sizes_a[-1] - sizes_a[-2]), 0.0)
    return np.where(at_a > sizes_a[-1], latency_a[-1] + slope * (at_a - sizes_a[-1]), inside)


def batch_step_cost(
    sizes: Sequence[int],
    latency_s: Sequence[float],
    tree_size: Sequence[float],
    draft_s: Sequence[float],
    rows: int,
) -> np.ndarray:
    """Seconds of one step of ``rows`` sequences at each budget: one verify forward of every
    row's tree (``T`` at the sum of their sizes, the flattened forward's tokens) and each row's
    drafting (an upper bound: the head runs once for all rows, the trees are built per row)."""
    verify = extrapolate_latency(sizes, latency_s, rows * np.asarray(tree_size, dtype=float))
    return verify + rows * np.asarray(draft_s, dtype=float)
