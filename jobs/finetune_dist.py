"""What the training loop asks of its data-parallel peers.

:class:`LocalComm` is the single process: every call is the identity, so
the one-device loop runs exactly as it did before there were ranks.
:class:`TorchComm` is one rank of ``torch.distributed``: NCCL between CUDA
devices, gloo between CPU processes (the simulated devices of a machine
without CUDA).

Why gradients are summed by hand instead of wrapping the model in
``DistributedDataParallel``: only the LoRA weights train (a few MB), so one
all-reduce of one flat buffer per optimizer step is cheap, and it leaves the
loop free of DDP's constraints: a rank whose share of a step is empty (the
end of an epoch) still joins the one reduce instead of hanging the others
in a backward it never runs, gradient accumulation needs no ``no_sync``,
and checkpointed layers are not "marked ready twice". Step statistics
(summed loss, tokens, samples) ride in the same buffer, and the stop
request is agreed on by all ranks before every step, so all stop at the
same step boundary.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# Long enough for rank 0 to write a checkpoint or evaluate while the others
# wait in the next collective; a dead peer is noticed by the job process,
# which kills the rest (jobs.finetune_ddp), long before this.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class Comm(Protocol):
    rank: int
    world: int

    @property
    def is_main(self) -> bool: ...

    def reduce_step(self, params: Sequence[torch.Tensor], stats: Sequence[float]) -> list[float]:
        """Sum the gradients of ``params`` over the ranks, in place, and
        ``stats``; returns the summed stats."""
        ...

    def sum(self, values: Sequence[float]) -> list[float]: ...

    def any(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag, true where some rank's is."""
        ...

    def sync_params(self, params: Sequence[torch.Tensor]) -> None:
        """Every rank takes rank 0's values."""
        ...

    def close(self) -> None: ...


class LocalComm:
    """One process, no peers."""

    rank = 0
    world = 1

    @property
    def is_main(self) -> bool:
        return True

    def reduce_step(self, params: Sequence[torch.Tensor], stats: Sequence[float]) -> list[float]:
        return list(stats)

    def sum(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def any(self, flags: Sequence[bool]) -> list[bool]:
        return list(flags)

    def sync_params(self, params: Sequence[torch.Tensor]) -> None:
        pass  # nothing to agree with

    def close(self) -> None:
        pass  # nothing was opened


class TorchComm:
    """One rank of a process group joined through the job's TCP store."""

    def __init__(self, rank: int, world: int, store_port: int, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in __all__

        self.rank, self.world, self.device = rank, world, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        store = TCPStore("127.0.0.1", store_port, world, is_master=False,
                              timeout=datetime.timedelta(minutes=5))
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT,
                                device_id=device if device.type == "cuda" else None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _reduce(self, flat: torch.Tensor, max_: bool = False) -> None:
        import torch.distributed as dist

        dist.all_reduce(flat, op=dist.ReduceOp.MAX if max_ else dist.ReduceOp.SUM)

    def reduce_step(self, params: Sequence[torch.Tensor], stats: Sequence[float]) -> list[float]:
        import torch

        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
        parts.append(torch.tensor(list(stats), dtype=torch.float32, device=self.device))
        flat = torch.cat(parts)
        self._reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            summed = flat[offset : offset + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = summed.clone()
            else:
                p.grad.copy_(summed)
            offset += n
        return [float(v) for v in flat[offset:].tolist()]

    def sum(self, values: Sequence[float]) -> list[float]:
        import torch

        flat = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self._reduce(flat)
        return [float(v) for v in flat.tolist()]

    def any(self, flags: Sequence[bool]) -> list[bool]:
        import torch

        flat = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.device)
        self._reduce(flat, max_=True)
        return [v > 0.5 for v in flat.tolist()]

    def sync_params(self, params: Sequence[torch.Tensor]) -> None:
        import torch.distributed as dist

        for p in params:
            dist.broadcast(p.data, src=0)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
