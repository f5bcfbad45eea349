"""The trainer step's ``count_reducer``: per-component token (pair) counts summed over the
data-parallel ranks, so that every rank divides its component sums by the GLOBAL count and
the summed gradients of N ranks equal one process's gradient on the whole batch."""

from __future__ import annotations

from composer_replication.distributed.setup import lost_peer_error

__all__ = ["sum_counts_over_ranks"]


def sum_counts_over_ranks(counts: dict[str, int]) -> dict[str, int]:
    """``counts`` summed element-wise over every rank of the default process group (the
    identity without one). Every rank must call it with the same keys."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(counts)
    names = sorted(counts)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    values = torch.tensor([int(counts[n]) for n in names], dtype=torch.int64, device=device)
    try:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    except (RuntimeError, dist.DistError) as err:
        raise lost_peer_error("summing the step's token counts") from err
    return dict(zip(names, (int(v) for v in values.tolist())))
