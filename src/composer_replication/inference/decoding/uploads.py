"""Host-built tensors onto the model's device without making the host wait.

A copy from pageable host memory to a GPU blocks the host until the copy is done, and the
copy itself waits behind every kernel already queued: a decode loop that uploads that way
stops feeding the GPU once per upload. Copied from pinned (page-locked) memory with
``non_blocking=True``, the copy is queued on the current stream, ordered before every
kernel that reads its result, and the host goes on.

:func:`~composer_replication.samples.wire.to_device` does the same for the trainer's batches, but
copies to any other device with ``non_blocking=False`` and reuses an already pinned tensor
as it is. :func:`to_device_async` always stages through a private pinned buffer (the
caller may write its tensor again at once) and passes ``non_blocking=True`` to every
device: on the ``meta`` device a test then sees, at the dispatcher, the very copy the CUDA
path queues (:class:`~composer_replication.testing.host_reads.HostReads` counts it).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_device_async"]


def to_device_async(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """``tensor`` on ``device``, queued without a host wait (``tensor`` itself when it is
    already there).

    Bound for CUDA, it is first copied into a fresh pinned buffer: the copy reads that
    buffer, not ``tensor``, so the caller may change ``tensor`` while the copy is in flight.
    The buffer needs no reference kept here: it comes from the CUDA caching host allocator,
    which records an event on it at the ``non_blocking`` copy and hands it out again only
    once that event has completed. Other devices are not pinned (pinning needs CUDA and
    buys nothing on a CPU).
    """
    device = torch.device(device)
    if tensor.device == device or (device.type == tensor.device.type and device.index is None):
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        staged.copy_(tensor)
        tensor = staged
    return tensor.to(device, non_blocking=True)
