"""The rollout record: what an environment run produced, before any algorithm touched it.

A rollout is data, not a crash: a failed run still yields a ``Rollout`` whose ``error``
says what went wrong (and whose reward is 0), so algorithms and metrics see every attempt.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: The ``metadata`` key under which an environment gives a task's reference solution (an
#: answer in the requested format): a demonstration for self-distillation, never shown to
#: the policy.
REFERENCE_KEY = "reference"
#: The ``metadata`` key marking a demonstration: a rollout whose completion is the task's
#: reference solution (``sampling.source = "reference"``), not a sample of the policy.
DEMONSTRATION_KEY = "demonstration"
#: The ``metadata`` key of the policy version that sampled a rollout (the optimizer steps
#: its weights had seen); only rollouts of the live policy have one.
POLICY_VERSION_KEY = "policy_version"
#: The ``metadata`` key marking a rollout from a frozen source (a frozen model, the
#: reference solutions): no policy sampled it, so it has no policy version and never goes
#: stale.
FROZEN_SOURCE_KEY = "frozen_source"
#: ``metadata["end_reason"]`` values of an agent episode cut short by a budget (the reply
#: budget, the turn limit, the token cap) rather than ended by the policy
TRUNCATED_END_REASONS = frozenset({"truncated", "turn_limit", "token_limit"})


@dataclass
class Rollout:
    """One sampled attempt at a task.

    Token streams are aligned: ``completion_ids``, ``inference_logprobs``,
    ``completion_mask`` and ``token_roles`` (when given) have one entry per completion token.

    Attributes:
        task_id: the task this attempt belongs to (groups are formed per task).
        prompt_ids: token ids of the prompt the policy saw.
        completion_ids: everything after the prompt: sampled tokens and, for multi-turn
            tool use, the environment's observation tokens in between.
        inference_logprobs: the sampler's log-prob of each completion token (0.0 for
            observation tokens, which were not sampled).
        completion_mask: 1 for tokens the policy sampled, 0 for observation tokens.
        reward: the verifier's score (0.0 for a failed rollout).
        prompt_messages: the chat messages behind ``prompt_ids``, so an algorithm can
            re-render the prompt with a hint or a demonstration.
        prompt_tools: the tools' JSON schemas the chat template rendered the prompt with
            (a model with native tool calls), to be passed again when it is re-rendered;
            None when the template got none.
        token_roles: per completion token, the role that produced it ("assistant",
            "tool", "user", ...), for algorithms that weight observation tokens.
        feedback: error-site text from the environment (failing test output, a tool
            error), the raw material of SDPO hints.
        error: why the rollout failed (sandbox error, timeout, unparsable tool call), or
            None.
        metadata: free-form extras recorded by the environment. Two keys have a meaning
            for the trainer: ``infrastructure_error`` (True: the sandbox failed before the
            attempt ran; the rollout says nothing about the policy and is left out of
            training and evaluation) and ``hack_flags`` (what the attempt did outside its
            answer, counted in the metrics and fed to the kill switch). ``reference``
            (:data:`REFERENCE_KEY`): the task's reference solution, for algorithms that
            distil from a demonstration. ``demonstration`` (:data:`DEMONSTRATION_KEY`):
            the completion IS that reference solution, not a policy sample (left out of
            reward metrics, the curriculum and the kill switch). ``policy_version``
            (:data:`POLICY_VERSION_KEY`): the live policy's version that sampled it.
            ``frozen_source`` (:data:`FROZEN_SOURCE_KEY`): a frozen source sampled it (see
            :func:`mark_frozen_source`).
    """

    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    inference_logprobs: list[float]
    completion_mask: list[int] | None = None
    reward: float = 0.0
    prompt_messages: list[dict[str, Any]] | None = None
    token_roles: list[str] | None = None
    feedback: str | None = None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if self.completion_mask is None:
            self.completion_mask = [1] * n
        for name in ("inference_logprobs", "completion_mask", "token_roles"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"rollout {self.task_id!r}: {name} has {len(value)} entries but there are "
                    f"{n} completion tokens; every per-token list must be aligned"
                )

    @property
    def input_ids(self) -> list[int]:
        """Prompt followed by completion."""
        return [*self.prompt_ids, *self.completion_ids]

    @property
    def infrastructure_error(self) -> bool:
        """The sandbox failed before the attempt ran (not the policy's doing)."""
        return bool(self.metadata.get("infrastructure_error"))

    @property
    def hack_flags(self) -> list[str]:
        """What the attempt did outside its answer (empty when nothing was seen)."""
        return list(self.metadata.get("hack_flags") or ())

    @property
    def truncated(self) -> bool:
        """An agent episode cut short by a budget (``TRUNCATED_END_REASONS``)."""
        return self.metadata.get("end_reason") in TRUNCATED_END_REASONS

    @property
    def is_demonstration(self) -> bool:
        """The completion is the task's reference solution, not a sample of the policy."""
        return bool(self.metadata.get(DEMONSTRATION_KEY))

    @property
    def from_frozen_source(self) -> bool:
        """A frozen source (a frozen model, the reference solutions) sampled it, not the
        live policy: it never goes stale."""
        return bool(self.metadata.get(FROZEN_SOURCE_KEY))

    @property
    def policy_version(self) -> int | None:
        """The live policy's version that sampled it (None: not recorded, or a frozen
        source)."""
        value = self.metadata.get(POLICY_VERSION_KEY)
        return None if value is None else int(value)

    @property
    def reference(self) -> str | None:
        """The task's reference solution, when the environment gives one."""
        value = self.metadata.get(REFERENCE_KEY)
        return str(value) if value else None

    @property
    def n_sampled_tokens(self) -> int:
        """Number of completion tokens the policy sampled."""
        return int(sum(self.completion_mask or ()))

    @property
    def trajectory(self) -> list[TrajectoryStep]:
        """The rollout as trajectory steps (see :class:`TrajectoryStep`)."""
        return trajectory_steps(self)


def mark_frozen_source(rollout: Rollout) -> None:
    """Mark ``rollout`` as a frozen source's sample: no policy version, never stale."""
    rollout.metadata[FROZEN_SOURCE_KEY] = True
    rollout.metadata.pop(POLICY_VERSION_KEY, None)


def stamp_policy_version(rollouts: Iterable[Rollout], version: int) -> None:
    """Record ``version`` as the policy version that sampled each rollout of the live policy
    that has none yet; a frozen source's rollouts stay without one."""
    for rollout in rollouts:
        if not rollout.from_frozen_source:
            rollout.metadata.setdefault(POLICY_VERSION_KEY, version)


@dataclass(frozen=True)
class TrajectoryStep:
    """One step of a (multi-turn) rollout: a turn the policy sampled and what followed it.

    The completion stream is cut at the start of every run of sampled tokens
    (``completion_mask`` 1): step k's ``completion_ids`` are its sampled tokens followed by
    the environment's tokens up to the next sampled run (end-of-turn tokens, the tool
    output or user turn that answered it), and its ``prompt_ids`` are everything before
    that (the rollout's prompt and the earlier steps). Steps partition the completion:
    ``start`` is where this step's completion begins in ``Rollout.completion_ids`` (a
    completion that opens with environment tokens puts them in step 0). A single-turn
    rollout is one step.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    completion_roles: list[str] | None
    start: int

    def __len__(self) -> int:
        """Tokens a per-step mask spans: ``prompt_ids + completion_ids``."""
        return len(self.prompt_ids) + len(self.completion_ids)


def trajectory_steps(rollout: Rollout) -> list[TrajectoryStep]:
    """``rollout`` cut into :class:`TrajectoryStep` s (at least one)."""
    mask = list(rollout.completion_mask or ())
    n = len(rollout.completion_ids)
    starts = [j for j in range(n) if mask[j] and (j == 0 or not mask[j - 1])]
    starts = [0] + [j for j in starts if j > 0]
    ends = [*starts[1:], n]
    roles = rollout.token_roles
    return [
        TrajectoryStep(
            prompt_ids=[*rollout.prompt_ids, *rollout.completion_ids[:a]],
            completion_ids=list(rollout.completion_ids[a:b]),
            completion_mask=mask[a:b],
            completion_logprobs=list(rollout.inference_logprobs[a:b]),
            completion_roles=None if roles is None else list(roles[a:b]),
            start=a,
        )
        for a, b in zip(starts, ends)
    ]
