"""The trainer step's reducers over the data-parallel ranks.

``count_reducer``: per-component token (pair) counts summed over the ranks, so that every
rank divides its component sums by the GLOBAL count and the summed gradients of N ranks
equal one process's gradient on the whole batch. ``metric_reducer``: the sums behind the
step's metrics summed over the ranks, so every rank reports the whole batch's metrics."""

from __future__ import annotations

from typing import Any

from composer_replication.distributed.setup import lost_peer_error

__all__ = ["sum_counts_over_ranks", "sum_values_over_ranks"]


def _summed(values: dict[str, Any], dtype: Any, what: str) -> list[Any]:
    """``values`` (sorted by name) summed element-wise over every rank, as a list; every
    rank must call it with the same keys."""
    import torch
    import torch.distributed as dist

    names = sorted(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flat = torch.tensor([values[n] for n in names], dtype=dtype, device=device)
    try:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    except (RuntimeError, dist.DistError) as err:
        raise lost_peer_error(what) from err
    return flat.tolist()


def _single_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1


def sum_counts_over_ranks(counts: dict[str, int]) -> dict[str, int]:
    """``counts`` summed element-wise over every rank of the default process group (the
    identity without one). Every rank must call it with the same keys."""
    import torch

    if _single_process():
        return dict(counts)
    ints = {n: int(v) for n, v in counts.items()}
    summed = _summed(ints, torch.int64, "summing the step's token counts")
    return dict(zip(sorted(ints), (int(v) for v in summed)))


def sum_values_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """``values`` summed element-wise in float64 over every rank of the default process
    group (the identity without one): the step's ``metric_reducer``."""
    import torch

    if _single_process():
        return dict(values)
    floats = {n: float(v) for n, v in values.items()}
    summed = _summed(floats, torch.float64, "summing the step's metrics")
    return dict(zip(sorted(floats), summed))
