"""Give the in-process decode's GPU memory back before the learner runs (the synchronous
step: with sampling ahead the decode runs beside the learner and keeps its buffers).

The static decode loop (:mod:`.static_decode`) keeps, per model, a KV cache for each batch
bucket and the CUDA graphs captured on it, across calls: for a 512-row batch of SmolLM2 at
a few hundred columns that is several GiB, held in graph memory pools that the learner's
allocations cannot reuse. :func:`release_decode_buffers` frees them (each decoder's
:meth:`~.static_decode.StaticDecoder.release`) and returns the cached blocks to the driver
(``torch.cuda.empty_cache``), so the learner's activations have the whole GPU. The next
decode allocates its buckets again and captures its graphs again (the decode weights and
the compiled kernels are kept).

It does not touch the general decode loop (its cache lives for one call) nor the prompt
states (:class:`~.kv_cache.PromptStates`, scoped to one collection).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["release_decode_buffers"]


def release_decode_buffers(device_types: Sequence[str] = ("cuda",)) -> int:
    """Free the buffers and graphs of every kept static decoder whose model is on one of
    ``device_types`` (a host's memory is not short: a CPU decoder keeps its buffers by
    default); returns how many decoders were released."""
    static = sys.modules.get("composer_replication.inference.decoding.static_decode")
    if static is None:  # never imported in this process: nothing was allocated
        return 0
    released = static.release_decoders(device_types)
    if released and "cuda" in device_types:
        import torch

        torch.cuda.empty_cache()  # the freed graph pools go back to the driver
    return released
