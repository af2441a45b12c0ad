"""Data-parallel training: one process per core (gloo) or per GPU (nccl), started by ``torchrun``.

Every rank holds the whole (small) head and reads the same step's sequence ids; it trains
on its own slice of them. A step's loss is a weighted mean over every rank's predictions,
so the ranks first sum their weights, then each back-propagates its share of the global
loss and the gradients are summed: the update equals that of one process on the whole
batch, up to float rounding. Gradients are reduced by hand rather than through
``DistributedDataParallel`` because the trainer calls a head's ``training_predictions``,
not its ``forward``, which DDP's hooks would not see.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the training processes (``world == 1``: training alone)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def from_env(cls, device: torch.device | str = "cpu") -> DataParallel:
        """Join the process group ``torchrun`` describes (``WORLD_SIZE``, ``RANK``, ...), if any.

        The backend is nccl for CUDA devices and gloo otherwise.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            dist.init_process_group(backend=backend)
            log.info("rank %d of %d joined (%s)", dist.get_rank(), world, backend)
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def is_main(self) -> bool:
        """The rank that logs, evaluates and writes checkpoints."""
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of ``items``: every ``world``-th one from position ``rank``."""
        return list(items[self.rank :: self.world])

    def sum_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def sum_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Sum the gradients of ``parameters`` over the ranks (one collective for all of them)."""
        if self.world == 1:
            return
        grads: list[Tensor] = []
        for p in parameters:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = self.sum_(torch.cat([grad.flatten() for grad in grads]))
        for grad, part in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def broadcast_(self, tensors: Iterable[Tensor]) -> None:
        """Give every rank rank 0's values of ``tensors`` (a head's parameters and buffers), in place."""
        if self.world == 1:
            return
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group (at the end of a run)."""
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
