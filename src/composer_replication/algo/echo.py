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

The optional filter ``filter_fn(rollout, **kwargs) -> list[list[bool]]``
(``advantage.filter``: ``import_path`` + ``kwargs``) narrows the selection per rollout: it
is called once per rollout and returns one keep-mask per trajectory step
(``Rollout.trajectory``), each spanning that step's ``prompt_ids + completion_ids``. An
observation token trains only where the mask of the step whose completion holds it is True
(entries over a step's prompt repeat earlier steps and are not read); False leaves it out
of ``ce`` (rl credit is never filtered). The raw rollout carries the token ids, roles and
sampling log-probs, so warning or low-probability filters are user code. A mask of any
other shape raises ``ValueError`` naming the filter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from composer_replication.algo.advantage import grpo_advantages
from composer_replication.algo.base import Algorithm, credited, one_per_rollout
from composer_replication.common.callables import load_callable
from composer_replication.config.advantage import EchoAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


class EchoAlgorithm(Algorithm):
    """rl on sampled tokens + ce on observation tokens, per role.

    Args:
        config: an ``AlgorithmConfig`` with ``advantage.type = "echo"``.
        filter_fn: the filter itself (overrides ``advantage.filter.import_path``; the
            config's ``kwargs`` are still passed to it).
    """

    config_class = EchoAdvantage

    def __init__(
        self, config: Any, filter_fn: Callable[..., Sequence[Sequence[bool]]] | None = None
    ) -> None:
        super().__init__(config)
        spec = self.advantage_config.filter
        if filter_fn is None and spec is not None:
            filter_fn = load_callable(spec.import_path, "echo filter")
        self.filter_fn = filter_fn
        self.filter_kwargs: dict[str, Any] = dict(spec.kwargs) if spec is not None else {}

    def observation_weights(self, rollout: Rollout) -> list[float]:
        """Per completion token: the role's alpha on observation tokens the filter keeps,
        0.0 elsewhere (the filter runs only on a rollout with some weight to narrow).

        Raises:
            ValueError: the rollout has observation tokens but no ``token_roles``; the
                filter returned another shape.
        """
        weights = self.role_weights(rollout)
        if any(weights):
            weights = [w if k else 0.0 for w, k in zip(weights, self.token_keep(rollout))]
        return weights

    def role_weights(self, rollout: Rollout) -> list[float]:
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

    def keep_masks(self, rollout: Rollout) -> list[list[bool]]:
        """The filter's keep-masks for ``rollout``: one per trajectory step, each as long as
        that step's ``prompt_ids + completion_ids`` (all True without a filter).

        Raises:
            ValueError: the filter returned another shape.
        """
        steps = rollout.trajectory
        if self.filter_fn is None:
            return [[True] * len(step) for step in steps]
        got = self.filter_fn(rollout, **self.filter_kwargs)
        return _check_keep_masks(got, [len(step) for step in steps], self._filter_name())

    def token_keep(self, rollout: Rollout) -> list[bool]:
        """Per completion token: the keep flag of the step whose completion holds it."""
        keep: list[bool] = []
        for step, mask in zip(rollout.trajectory, self.keep_masks(rollout)):
            keep += mask[len(step.prompt_ids) :]
        return keep

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        """Dr.GRPO advantages on the sampled tokens (the ce weights came with the samples)."""
        cfg = self.advantage_config
        advantages = grpo_advantages([r.reward for r in group]).tolist()
        for (rollout, sample), advantage in zip(one_per_rollout(group, samples), advantages):
            sample.advantages = credited(rollout, advantage, cfg.turn_reward_weight)
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


def _as_list(value: Any) -> Any:
    """A numpy array or tensor mask as a list (``tolist``); anything else unchanged."""
    if not isinstance(value, Sequence) and callable(getattr(value, "tolist", None)):
        return value.tolist()
    return value


def _check_keep_masks(masks: Any, lengths: list[int], name: str) -> list[list[bool]]:
    """``masks`` as one list of bools per trajectory step, of the steps' ``lengths``, or
    ``ValueError`` naming the filter."""
    want = (
        f"echo filter {name} must return one keep-mask per trajectory step of the rollout "
        f"({len(lengths)} steps: Rollout.trajectory), each a list of bools spanning that "
        "step's prompt_ids + completion_ids, as filter_fn(rollout, **kwargs) -> "
        "list[list[bool]]"
    )
    masks = _as_list(masks)
    if isinstance(masks, (str, bytes)) or not isinstance(masks, Sequence):
        raise ValueError(f"{want}; got {type(masks).__name__}")
    if len(masks) != len(lengths):
        raise ValueError(f"{want}; got {len(masks)} masks")
    out = []
    for k, (mask, n) in enumerate(zip(masks, lengths)):
        mask = _as_list(mask)
        if isinstance(mask, (str, bytes)) or not isinstance(mask, Sequence):
            raise ValueError(f"{want}; step {k}'s mask is {type(mask).__name__}")
        if len(mask) != n:
            raise ValueError(f"{want}; step {k}'s mask has {len(mask)} entries for {n} tokens")
        for i, value in enumerate(mask):
            if not _is_bool(value):
                raise ValueError(
                    f"echo filter {name}: step {k}'s mask entry {i} is {value!r} "
                    f"({type(value).__name__}), not a bool"
                )
        out.append([bool(v) for v in mask])
    return out
