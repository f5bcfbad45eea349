"""``echo``: Dr.GRPO on the policy's actions + weighted CE on environment observations.

In multi-turn tool use the completion interleaves sampled tokens (actions) with tokens the
environment wrote (tool output, user turns). Besides ``rl`` credit on the actions, echo
trains the policy to predict the observations with ``ce``, weighted per message role
(``roles.<role>.alpha``; tool bodies 0.1 by default): a world-model signal that needs no
reward.

Observation tokens are the completion tokens with ``completion_mask`` 0; their role comes
from ``rollout.token_roles`` (the environment's role attribution). A rollout with
observation tokens but no roles is an environment that cannot feed echo: ``ValueError``,
never a run that silently trains no ce tokens (built-in environments without role
attribution are already rejected when the config is validated).

The optional filter ``fn(rollouts, **kwargs) -> list[bool]`` (``advantage.filter``:
``import_path`` + ``kwargs``) is called once per group with the rollouts ``assign``
finalises together and returns the step's keep mask, one bool per rollout in order: False
leaves that rollout's observations out of ``ce`` (its rl credit stays). Anything other than
one bool per rollout raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from composer_replication.algo.advantage import grpo_advantages
from composer_replication.algo.base import (
    Algorithm,
    check_group,
    load_callable,
    on_completion,
    rollout_to_sample,
    sampled,
)
from composer_replication.rollout.types import Rollout
from composer_replication.wire import TrainingSample


class EchoAlgorithm(Algorithm):
    """rl on sampled tokens + ce on observation tokens, per role.

    Args:
        config: an ``AlgorithmConfig`` with ``advantage.type = "echo"``.
        filter_fn: the filter itself (overrides ``advantage.filter.import_path``; the
            config's ``kwargs`` are still passed to it).
    """

    name = "echo"
    components = ("rl", "ce")

    def __init__(self, config: Any, filter_fn: Callable[..., Sequence[bool]] | None = None) -> None:
        super().__init__(config)
        spec = self.advantage_config.filter
        if filter_fn is None and spec is not None:
            filter_fn = load_callable(spec.import_path, "echo filter")
        self.filter_fn = filter_fn
        self.filter_kwargs: dict[str, Any] = dict(spec.kwargs) if spec is not None else {}

    def observation_weights(self, rollout: Rollout) -> list[float]:
        """Per completion token: the role's alpha on observation tokens, 0.0 elsewhere.

        Raises:
            ValueError: the rollout has observation tokens but no ``token_roles``.
        """
        mask = rollout.completion_mask or ()
        if rollout.token_roles is None:
            observed = sum(1 for m in mask if not m)
            if observed:
                raise ValueError(
                    f"echo: rollout of task {rollout.task_id!r} has {observed} observation "
                    "tokens (completion_mask 0) but no token_roles, so none can be weighted "
                    "by role: the environment must attribute a role to every completion token "
                    "(Rollout.token_roles, as run_agent_rollouts does), or use type = 'grpo'"
                )
            return [0.0] * len(rollout.completion_ids)
        roles = self.advantage_config.roles
        return [
            0.0 if m or role not in roles else float(roles[role].alpha)
            for m, role in zip(mask, rollout.token_roles)
        ]

    def keep_mask(self, rollouts: Sequence[Rollout]) -> list[bool]:
        """The filter's keep mask over ``rollouts`` (all True without a filter).

        Raises:
            ValueError: the filter did not return exactly one bool per rollout.
        """
        if self.filter_fn is None:
            return [True] * len(rollouts)
        got = self.filter_fn(list(rollouts), **self.filter_kwargs)
        return _check_keep_mask(got, len(rollouts), self._filter_name())

    def assign(self, group: list[Rollout]) -> list[TrainingSample]:
        check_group(group, self.name)
        advantages = grpo_advantages([r.reward for r in group]).tolist()
        weights = [self.observation_weights(rollout) for rollout in group]
        keep = self.keep_mask(group)
        samples = []
        for rollout, advantage, observed, kept in zip(group, advantages, weights, keep):
            sample = rollout_to_sample(rollout, source=self.name)
            sample.advantages = sampled(rollout, advantage)
            if kept and any(observed):
                sample.ce_weights = on_completion(rollout, observed)
            samples.append(sample)
        return samples

    def _filter_name(self) -> str:
        spec = self.advantage_config.filter
        if spec is not None:
            return repr(spec.import_path)
        return getattr(self.filter_fn, "__qualname__", None) or repr(self.filter_fn)


def _is_bool(value: Any) -> bool:
    # Python bools, and numpy's bool scalars (a comparison on an array element).
    dtype = getattr(value, "dtype", None)
    return isinstance(value, bool) or (
        getattr(dtype, "kind", None) == "b" and getattr(value, "ndim", None) == 0
    )


def _check_keep_mask(mask: Any, n: int, name: str) -> list[bool]:
    """``mask`` as a list of ``n`` bools, or ``ValueError`` naming the filter."""
    if isinstance(mask, (str, bytes)) or not isinstance(mask, Sequence):
        raise ValueError(
            f"echo filter {name} must return a list of {n} bools (one per rollout of the "
            f"step), got {type(mask).__name__}"
        )
    if len(mask) != n:
        raise ValueError(
            f"echo filter {name} must return one bool per rollout of the step: got "
            f"{len(mask)} values for {n} rollouts"
        )
    for i, value in enumerate(mask):
        if not _is_bool(value):
            raise ValueError(
                f"echo filter {name}: keep mask entry {i} is {value!r} "
                f"({type(value).__name__}), not a bool"
            )
    return [bool(v) for v in mask]
