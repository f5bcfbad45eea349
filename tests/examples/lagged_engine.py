"""An inference engine added in one module: a copy of the policy that takes the trained
weights every ``every`` optimizer steps instead of after each one (the delayed weight
broadcast of actor-learner systems, e.g. IMPALA, arXiv 1802.01561), named in a run config by
import path::

    [inference]
    engine = "tests.examples.lagged_engine:lagged_engine"
    options = { every = 2 }

The factory gets the ``[inference]`` config and the run's policy; the object it returns has
the ``roles.InferenceEngine`` methods. The loop stamps each rollout with the engine's
``version``, so the staleness metrics see the lag.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from composer_replication.inference.decoding.generate import InProcessSampler


class LaggedEngine:
    """Samples with a copy of the policy refreshed every ``every`` optimizer steps."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"inference.options.every = {every} must be >= 1")
        self.every = every
        self.copy: Any = None
        self._sampler: InProcessSampler | None = None
        self._version = 0
        self.synced_at: list[int] = []

    @property
    def sampler(self) -> InProcessSampler:
        if self._sampler is None:
            raise RuntimeError("the engine samples once the run has started it")
        return self._sampler

    @property
    def version(self) -> int:
        return self._version

    def start(self, policy: Any, version: int) -> None:
        self.copy = copy.deepcopy(policy).requires_grad_(False)
        self._sampler = InProcessSampler(self.copy, live=True)
        self._version = int(version)

    @contextlib.contextmanager
    def sampling_ahead(self) -> Iterator[InProcessSampler]:
        yield self.sampler

    def after_step(self, policy: Any, version: int) -> dict[str, float]:
        if version % self.every:
            return {"engine/synced": 0.0}
        self.copy.load_state_dict(policy.state_dict())
        self._version = int(version)
        self.synced_at.append(int(version))
        return {"engine/synced": 1.0}

    def stop(self) -> None:
        self.copy = self._sampler = None


def lagged_engine(config: Any, *, policy: Any, **run: Any) -> LaggedEngine:
    """The factory ``[inference] engine`` names (``run``: model_source, run_dir, seed,
    sample_ahead, autocast, which this engine does not need)."""
    return LaggedEngine(int(config.options.get("every", 2)))
