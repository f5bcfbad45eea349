"""The in-process inference engine: the policy samples in the training process
(``[inference] engine = "in_process"``, the default).

The live policy samples in the controller's thread with the decode options of the run's
``[inference]`` config, which every sampler this engine hands out carries. When the run samples
ahead (``async_level >= 1``), a :class:`~.snapshot.PolicySnapshot` of the weights samples
in the rollout queue's thread instead (the optimizer changes the live weights under a
decode), refreshed after each optimizer step: the same options, the snapshot's version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from composer_replication.inference.decoding.generate import DecodeOptions, InProcessSampler
from composer_replication.inference.snapshot import PolicySnapshot

__all__ = ["InProcessEngine"]


class InProcessEngine:
    """The :class:`~composer_replication.roles.InferenceEngine` of a policy in this process.

    ``sample_ahead``: a snapshot of the weights samples ahead of training (made at
    :meth:`start`); ``autocast``: the context a batch sampled ahead runs in (the run's
    autocast, which is per thread).
    """

    def __init__(
        self,
        policy: Any,
        *,
        decode: DecodeOptions | None = None,
        sample_ahead: bool = False,
        autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.decode = decode or DecodeOptions()
        self.live = InProcessSampler(policy, decode=self.decode)
        self.sample_ahead = sample_ahead
        self.autocast = autocast
        self.snapshot: PolicySnapshot | None = None
        self.ahead: InProcessSampler | None = None
        self._version = 0

    @property
    def sampler(self) -> InProcessSampler:
        """The live policy's sampler."""
        return self.live

    @property
    def version(self) -> int:
        return self.snapshot.version if self.snapshot is not None else self._version

    def start(self, policy: Any, version: int) -> None:
        """Copy the weights that sample ahead (when the run does)."""
        self._version = int(version)
        if self.sample_ahead and self.snapshot is None:
            self.snapshot = PolicySnapshot(policy, version=version)
            self.ahead = InProcessSampler(self.snapshot.model, decode=self.decode)

    @contextlib.contextmanager
    def sampling_ahead(self) -> Iterator[InProcessSampler]:
        """The snapshot's sampler, on its stream and under the run's autocast; the live
        policy's when nothing samples ahead."""
        if self.snapshot is None or self.ahead is None:
            yield self.live
            return
        with self.snapshot.sampling(), self.autocast():
            yield self.ahead

    def after_step(self, policy: Any, version: int) -> dict[str, float]:
        """The snapshot takes the new weights (no metrics: nothing crosses a process)."""
        self._version = int(version)
        if self.snapshot is not None:
            self.snapshot.refresh(policy, version)
        return {}

    def stop(self) -> None:
        self.snapshot = self.ahead = None  # its memory goes with it
