"""Losses, depth weights, anchor sampling and the supervised (anchor, depth) pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from jetflow.drafters.training.examples import anchor_bounds, collate, sample_anchors
from jetflow.drafters.training.losses import (
    LossConfig,
    depth_weights,
    forward_kl,
    position_losses,
    reverse_kl,
)


def test_forward_kl_is_t_squared_kl_of_softened_distributions() -> None:
    torch.manual_seed(0)
    student, teacher = torch.randn(4, 10), torch.randn(4, 10)
    t = 2.0
    teacher_logprobs = F.log_softmax(teacher / t, dim=-1)
    expected = t**2 * F.kl_div(
        F.log_softmax(student / t, -1), teacher_logprobs, log_target=True, reduction="none"
    )
    torch.testing.assert_close(forward_kl(student, teacher_logprobs, t), expected.sum(-1))
    assert torch.allclose(forward_kl(teacher, F.log_softmax(teacher, -1), 1.0), torch.zeros(4), atol=1e-6)


def test_forward_kl_gradient_is_student_softmax_minus_teacher() -> None:
    torch.manual_seed(2)
    student = torch.randn(5, 12, requires_grad=True)
    teacher_logprobs = F.log_softmax(torch.randn(5, 12), dim=-1)
    (gradient,) = torch.autograd.grad(forward_kl(student, teacher_logprobs, 1.0).sum(), student)
    torch.testing.assert_close(gradient, F.softmax(student, -1) - teacher_logprobs.exp())


def test_reverse_kl_swaps_the_arguments() -> None:
    torch.manual_seed(1)
    student, teacher = torch.randn(3, 8), torch.randn(3, 8)
    p, q = F.log_softmax(teacher, -1), F.log_softmax(student, -1)
    torch.testing.assert_close(reverse_kl(student, p, 1.0), (q.exp() * (q - p)).sum(-1))
    assert not torch.allclose(reverse_kl(student, p, 1.0), forward_kl(student, p, 1.0))


def test_sft_uses_the_sequence_tokens_or_the_teacher_argmax() -> None:
    student, teacher = torch.randn(3, 8), F.log_softmax(torch.randn(3, 8), -1)
    labels = torch.tensor([1, 2, 3])
    tokens = position_losses(LossConfig(kind="sft"), student, None, labels)
    torch.testing.assert_close(tokens, F.cross_entropy(student, labels, reduction="none"))
    argmax = position_losses(LossConfig(kind="sft", sft_labels="argmax"), student, teacher, labels)
    torch.testing.assert_close(argmax, F.cross_entropy(student, teacher.argmax(-1), reduction="none"))
    assert not LossConfig(kind="sft").needs_teacher and LossConfig().needs_teacher


def test_depth_weights_uniform_or_exponential_decay() -> None:
    depths = torch.tensor([1, 2, 3])
    assert torch.equal(depth_weights(depths, None), torch.ones(3))
    torch.testing.assert_close(depth_weights(depths, 7.0), torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 7))


def test_anchors_lie_in_the_response_and_are_distinct() -> None:
    assert anchor_bounds(prompt_length=5, length=20, n_features=19) == (4, 18)
    generator = torch.Generator().manual_seed(0)
    anchors = sample_anchors(5, 20, 19, count=100, generator=generator)
    assert anchors.tolist() == list(range(4, 19))  # all of them when asking for more
    few = sample_anchors(5, 20, 19, count=4, generator=generator)
    assert len(set(few.tolist())) == 4 and torch.equal(few, few.sort().values)
    assert sample_anchors(20, 20, 19, count=4, generator=generator).numel() == 0


def test_depth_targets_stop_at_the_end_of_each_sequence() -> None:
    record = (torch.arange(10), 2, torch.zeros(9, 1, 4), torch.zeros(9, 4))
    short = (torch.arange(6), 2, torch.zeros(5, 1, 4), torch.zeros(5, 4))
    batch = collate([record, short], [torch.tensor([1, 7]), torch.tensor([3])], torch.float32)
    valid, positions = batch.depth_targets(max_depth=3)
    assert positions[0, 1].tolist() == [8, 9, 10]
    assert valid[0, 0].tolist() == [True, True, True]
    assert valid[0, 1].tolist() == [True, True, False]  # token 10 does not exist
    assert valid[1, 0].tolist() == [True, True, False]  # sequence of 6 tokens
    assert not valid[1, 1].any()  # padding anchor


@pytest.mark.parametrize("kind", ["forward-kl", "reverse-kl", "sft"])
def test_losses_have_gradients_for_the_student(kind: str) -> None:
    student = torch.randn(2, 6, requires_grad=True)
    teacher = F.log_softmax(torch.randn(2, 6), -1)
    position_losses(LossConfig(kind=kind), student, teacher, torch.tensor([0, 1])).sum().backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
