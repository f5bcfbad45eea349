"""Process-group set-up from ``torchrun``'s environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

The group has a timeout: when a rank dies mid-run, the others' next collective fails
within it (with gloo the failure is usually immediate: the dead peer's socket closes)
instead of hanging.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from composer_replication.distributed.ranks import RankGroup

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "backend_for",
    "init_from_env",
    "join_local_group",
    "launched_by_torchrun",
    "lost_peer_error",
]

#: how long a collective waits for a missing peer before the process group fails
DEFAULT_TIMEOUT_S = 600.0


def launched_by_torchrun() -> bool:
    """Whether this process is one of several ``torchrun`` ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def backend_for(device: torch.device) -> str:
    """NCCL for GPUs, gloo for CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGroup:
    """Initialise the default process group from ``torchrun``'s variables (once) and return
    this process's :class:`RankGroup`; rank 0 of 1 when not launched by ``torchrun``.

    On a GPU each rank uses ``cuda:LOCAL_RANK`` (``device`` must be that GPU).
    """
    import datetime

    import torch.distributed as dist

    if not launched_by_torchrun():
        return RankGroup()
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} is not set: "
            "start the ranks with torchrun (or composer-replication train --nproc N)"
        )
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    if device.type == "cuda":
        import torch

        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.index not in (None, local):
            raise ValueError(
                f"rank with LOCAL_RANK={local} was given device {device}; under torchrun "
                "use device = 'auto' or 'cuda' so that each rank takes its own GPU"
            )
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend_for(device), timeout=datetime.timedelta(seconds=timeout_s)
        )
    return RankGroup.current()


def join_local_group(
    rank: int, world_size: int, port: int, device: torch.device, *, timeout_s: float
) -> RankGroup:
    """Join a process group on this host as ``rank`` of ``world_size`` (rendezvous at
    127.0.0.1:``port``), as if ``torchrun`` had started this process: for programs that
    start their ranks themselves (benchmarks, test workers)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return init_from_env(device, timeout_s=timeout_s)


def lost_peer_error(what: str) -> RuntimeError:
    """The error a rank raises when a collective (``what``) with its peers fails."""
    import torch.distributed as dist

    return RuntimeError(
        f"rank {dist.get_rank()} of {dist.get_world_size()}: {what} with the other ranks "
        "failed; a rank died, hung or left the run (see its log). Nothing can continue "
        "without it: restart the run from its last checkpoint"
    )
