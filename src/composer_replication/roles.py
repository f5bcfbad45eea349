"""The roles of a run as typed protocols: Sampler, Grader, Learner, Evaluator.

A run is roles driven by one controller (the native loop), and the roles are the same
code in every engine: the controller holds each role by its protocol and never asks an
object what it can do (no ``hasattr``). Implementations satisfy a protocol structurally
(nothing here is subclassed); ``isinstance`` against a protocol checks that its members
are present, and the tests also compare the implementations' method signatures with
the protocol's.

- :class:`Sampler`: prompts as token ids in, completions as token ids with their
  sampling log-probs out. ``inference.decoding.generate.InProcessSampler`` (a model in this
  process), ``inference.sampler.EngineSampler`` (the live policy on a vLLM server),
  ``rollout.endpoint_sampler.EndpointSampler`` (a frozen OpenAI-compatible endpoint).
- :class:`Grader`: sampled rollouts in, the same rollouts with rewards, feedback and
  errors out; a bad completion is a graded failure, never an exception.
  ``envs.python_functions.PythonFunctionsEnv`` (in process) and
  ``recipes.monarch.engine.RemoteGrader`` (on the rewarder processes).
- :class:`Learner`: packed micro-batches in, one optimizer step out.
  ``training.learner.Learner`` (in process, or FSDP2 shards under torchrun) and
  ``recipes.monarch.engine.RemoteLearner`` (on the trainer process).
- :class:`Evaluator`: a sampler in, its held-out pass@1 out (the kill switch's signal).
  ``training.lifecycle.RunLifecycle``.
- :class:`Environment`: tasks in, groups of scored rollouts out (single- or multi-turn,
  tools run in a sandbox); :class:`SplitEnvironment` samples and grades in separate calls,
  :class:`DemonstratingEnvironment` also answers its tasks with reference solutions. The
  environments of ``envs/``; the sampler of an ``[[envs]]`` entry
  (``rollout.env_sampler``) reaches them only through these.
- :class:`InferenceEngine`: what samples the live policy, and how its weights follow the
  optimizer. ``inference.in_process.InProcessEngine`` (the policy in this process, or its
  sample-ahead copy) and ``inference.engine.PolicyEngine`` (a vLLM server).

This module imports nothing at run time beyond ``typing``: every layer may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, Protocol, runtime_checkable

if TYPE_CHECKING:
    from composer_replication.samples.generation import Generation, SamplingSettings
    from composer_replication.samples.rollouts import Rollout
    from composer_replication.samples.wire import MicroBatch

__all__ = [
    "DemonstratingEnvironment",
    "Environment",
    "Evaluator",
    "Grader",
    "InferenceEngine",
    "Learner",
    "PolicyWeights",
    "Sampler",
    "SplitEnvironment",
    "protocol_methods",
]


@runtime_checkable
class Sampler(Protocol):
    """Turns prompts (token ids) into completions (token ids) with their sampling
    log-probs.

    Attributes:
        samples_from_live_policy: True when the samples come from the policy being
            trained (their log-probs can form the rl component's importance ratio and
            they age as the policy moves on); False for a frozen source (a teacher
            endpoint, a frozen local model), whose samples never go stale.
    """

    samples_from_live_policy: bool

    def sample_batch(
        self,
        tokenizer: Any,
        prompts: Sequence[Sequence[int]],
        settings: SamplingSettings,
        *,
        max_rows: int | None = None,
        on_row_done: Callable[[int, Generation], None] | None = None,
    ) -> list[Generation]:
        """One completion per prompt, in order.

        ``settings.logprobs`` False: the caller reads no sampling log-probs (a frozen
        source's samples), so a sampler may skip asking for them and report 0.0.
        ``max_rows``: at most this
        many rows sample at once (a hint; samplers without a row limit ignore it).
        ``on_row_done(index, generation)`` is called once per prompt as soon as its
        completion is known (at the latest before this call returns)."""
        ...


@runtime_checkable
class Grader(Protocol):
    """Grades sampled rollouts: rewards, feedback (error sites) and errors filled in."""

    def grade_groups(self, groups: Sequence[Sequence[Rollout]]) -> list[list[Rollout]]:
        """``groups`` graded, same shape and order. Never raises for a bad completion:
        that is a graded failure (reward 0, ``error`` set)."""
        ...


@runtime_checkable
class PolicyWeights(Protocol):
    """How the controller reaches a learner's weights (a no-op for a whole copy)."""

    def gathered(self) -> AbstractContextManager[Any]:
        """Whole weights inside the block (a sharded policy samples collective-free)."""
        ...

    def accumulating(self) -> AbstractContextManager[Any]:
        """Gradients accumulate inside the block (sharded: reduced once at its end)."""
        ...


@runtime_checkable
class Learner(Protocol):
    """The algorithm-blind step over packed micro-batches, the optimizer and its
    schedule.

    Attributes:
        weights: the policy's weights as the controller may use them.
        sync: the DiLoCo hook around the step loop (``NO_SYNC`` when off); the
            controller sets it for the length of a run.
    """

    weights: PolicyWeights
    sync: Any

    def update(self, batches: list[MicroBatch], step: int) -> dict[str, Any]:
        """One optimizer step over ``batches`` (``step``: the step number after it); the
        step's metrics."""
        ...

    def lr(self) -> float:
        """The learning rate of the next step."""
        ...

    def kl_to_initial(self) -> float:
        """Token-mean KL of the policy to its initial weights on the last step's batches."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the learner beyond weights, optimizer and schedule."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (from a checkpoint's extra state)."""
        ...


@runtime_checkable
class Evaluator(Protocol):
    """Measures a sampler on held-out tasks."""

    def evaluate(self, sampler: Sampler, tokenizer: Any, tasks: Sequence[Any]) -> float:
        """Held-out pass@1 of ``sampler`` over ``tasks`` (one
        ``training.lifecycle.HeldoutTasks`` per environment)."""
        ...


@runtime_checkable
class InferenceEngine(Protocol):
    """Samples the live policy for the controller; its weights follow the optimizer.

    Policy version ``v`` is the policy after ``v`` optimizer steps. ``sampler`` samples the
    current weights in the controller's thread (evaluation, a step sampled in turn);
    :meth:`sampling_ahead` is what samples a batch in the rollout queue's thread while the
    policy trains. The controller calls :meth:`start` once its weights are final for the
    run's first step, :meth:`after_step` after each optimizer step (while nothing samples
    ahead) and :meth:`stop` on every exit path.
    """

    @property
    def sampler(self) -> Sampler:
        """The sampler of the policy's current weights."""
        ...

    @property
    def version(self) -> int:
        """The policy version the next batch sampled ahead is sampled by."""
        ...

    def start(self, policy: Any, version: int) -> None:
        """The run begins (or resumes) with ``policy`` at ``version``."""
        ...

    def sampling_ahead(self) -> AbstractContextManager[Sampler]:
        """Around one batch sampled ahead, in the rollout queue's thread: its sampler."""
        ...

    def after_step(self, policy: Any, version: int) -> dict[str, float]:
        """``policy`` took its ``version``-th optimizer step; the sync's metrics."""
        ...

    def stop(self) -> None:
        """Release what the engine holds (servers, weight copies); idempotent."""
        ...


@runtime_checkable
class Environment(Protocol):
    """What the training loop needs from an environment."""

    name: str

    def task_ids(self) -> list[str]:
        """Every task id this environment can run (train and held-out alike)."""
        ...

    def rollouts(
        self,
        sampler: Sampler,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        group_size: int,
        sampling: SamplingSettings,
    ) -> list[list[Rollout]]:
        """``group_size`` scored attempts per task sampled by ``sampler``, one group per
        task id, in order."""
        ...


@runtime_checkable
class SplitEnvironment(Environment, Protocol):
    """A single-turn environment that samples and grades in separate calls (so sampling
    and grading can run in different processes); it is its own
    :class:`~composer_replication.roles.Grader`."""

    def sample(
        self,
        sampler: Sampler,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        group_size: int,
        sampling: SamplingSettings,
    ) -> list[list[Rollout]]:
        """The sampling half of ``rollouts``: ungraded groups, one per task id, in order."""
        ...

    def grade_groups(self, groups: Sequence[Sequence[Rollout]]) -> list[list[Rollout]]:
        """The grading half: ``groups`` with rewards, feedback and errors filled in."""
        ...


@runtime_checkable
class DemonstratingEnvironment(Environment, Protocol):
    """An environment that answers its tasks with reference solutions (the samples of
    ``sampling.source = "reference"``)."""

    def demonstrations(
        self, tokenizer: Any, task_ids: Sequence[str], *, group_size: int = 1
    ) -> list[list[Rollout]]:
        """Each task's prompt answered with its reference solution, one group per task."""
        ...


def protocol_methods(protocol: type) -> tuple[str, ...]:
    """The methods a role protocol requires, sorted (its attributes left out)."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass in (Protocol, Generic, object) or not getattr(klass, "_is_protocol", False):
            continue
        names.update(
            name for name, value in vars(klass).items() if callable(value) and name[0] != "_"
        )
    return tuple(sorted(names))
