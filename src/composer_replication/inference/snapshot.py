"""The weights the in-process engine samples ahead with (``[inference] async_level >= 1``).

In process, the policy cannot sample the next step while it trains on this one: the optimizer
changes its weights under the decode. :class:`PolicySnapshot` holds a copy of the policy that
samples instead, in the rollout queue's background thread (on a GPU on a CUDA stream of its
own, so its kernels run beside the training step's). After each optimizer step, once no batch
is sampling, the trainer copies the new weights into it in place (no reallocation: a static
decode loop's captured graphs keep pointing at the same buffers) and bumps its version, which
every rollout it samples carries. The cost is one more copy of the parameters (not of the
gradients or optimizer state). :class:`~.in_process.InProcessEngine` samples it, with the
run's decode options.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

__all__ = ["PolicySnapshot"]


class PolicySnapshot:
    """A frozen copy of ``policy`` at version ``version`` that samples while the policy
    trains. ``refresh`` brings it to the policy's current weights; only call it while
    nothing samples from it."""

    def __init__(self, policy: Any, *, version: int = 0) -> None:
        import torch

        from composer_replication.model.devices import module_device

        self.model = copy.deepcopy(policy)
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
            parameter.grad = None
        self.model.eval()
        self.version = int(version)
        device = module_device(policy)
        # its own stream on a GPU: sampling kernels interleave with the training step's
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def refresh(self, policy: Any, version: int) -> None:
        """Copy ``policy``'s parameters and buffers into the snapshot (same names, shapes and
        devices: it was copied from it) and record ``version``."""
        import torch

        source = dict(policy.named_parameters())
        source.update(policy.named_buffers())
        with torch.no_grad():
            for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
                tensor.copy_(source[name], non_blocking=True)
        if self.stream is not None:
            # the next batch's kernels run on the snapshot's stream: they wait for the copies
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self.version = int(version)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Around one batch's sampling: on a GPU, its kernels go to the snapshot's stream
        (a no-op on a CPU)."""
        if self.stream is None:
            yield
            return
        import torch

        with torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()  # the rollouts are complete before the batch is handed over
