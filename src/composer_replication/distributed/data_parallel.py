"""The native trainer's data parallelism, as the loop and the Learner use it.

Every rank builds the same run (same seed, same config), then:

- :func:`start_data_parallel` joins the process group (under ``torchrun``) and gives each
  rank its own sampling seed, so ranks draw different completions;
- the loop picks the step's tasks identically on every rank (same task stream) and each
  rank samples and grades its :meth:`RankGroup.share` of them; the curricula see every
  rank's results;
- :func:`shard_for_training` shards the policy with FSDP2 (after the frozen teacher copies
  are made) and returns the step's ``count_reducer``, which sums token counts over ranks;
- the lifecycle splits held-out evaluation, agrees on stop decisions and lets rank 0
  write (:class:`~composer_replication.distributed.ranks.RankGroup`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_replication.distributed.ranks import RankGroup

if TYPE_CHECKING:
    from composer_replication.config.diloco import DiLoCoConfig
    from composer_replication.config.run import ModelConfig

__all__ = [
    "autocast_for",
    "final_policy",
    "merge_rollout_stats",
    "shard_for_training",
    "start_data_parallel",
]


def start_data_parallel(
    model: ModelConfig, diloco: DiLoCoConfig, *, seed: int, teacher_mode: str = "policy"
) -> RankGroup:
    """Join ``torchrun``'s process group (rank 0 of 1 without ``torchrun``); refuse what
    several ranks cannot run yet. ``model`` and ``diloco``: the run's sections; ``seed``:
    the run's seed; ``teacher_mode``: the jsd teacher's mode (``RunConfig.teacher_mode``)."""
    import torch

    from composer_replication.distributed.setup import init_from_env, launched_by_torchrun
    from composer_replication.model.devices import resolve_device

    if not launched_by_torchrun():
        return RankGroup()
    if teacher_mode == "ema":
        raise ValueError(
            "an EMA jsd teacher is not supported with several training ranks (its copy "
            "would follow sharded weights); use the live policy or the initial policy as "
            "the teacher, or train in one process"
        )
    if diloco.enabled and diloco.backend != "object_store":
        raise ValueError(
            f"diloco.backend = {diloco.backend!r} runs one process per replica; a "
            "replica of several torchrun ranks (FSDP2 inside the replica) needs "
            "diloco.backend = 'object_store', or run each torchft replica as one process"
        )
    ranks = init_from_env(resolve_device(model.device))
    # same task stream on every rank (they share each step's tasks); different sampling
    torch.manual_seed(seed + 7919 * ranks.rank)
    return ranks


def shard_for_training(policy: Any, model: ModelConfig) -> tuple[Any, Any]:
    """Shard ``policy`` with FSDP2 (mixed precision as ``model.dtype`` resolves); return
    its :class:`~composer_replication.distributed.fsdp.GatheredWeights` and the count
    reducer for :func:`~composer_replication.training.step.train_step`."""
    from composer_replication.distributed.counts import sum_counts_over_ranks
    from composer_replication.distributed.fsdp import GatheredWeights, shard_policy
    from composer_replication.model.devices import Precision, module_device, resolve_precision

    device = module_device(policy)
    precision = resolve_precision(model.dtype, device)
    if device.type == "cpu":  # gloo ranks exchange float32: no bfloat16 gathers on CPUs
        precision = Precision(precision.param_dtype)
    shard_policy(policy, precision=precision)
    return GatheredWeights(policy), sum_counts_over_ranks


def autocast_for(model: ModelConfig, policy: Any, ranks: RankGroup) -> Any:
    """bfloat16 autocast for a mixed-precision run in one process (FSDP2 casts by itself
    when sharded); ``nullcontext()`` otherwise."""
    import contextlib

    from composer_replication.model.devices import autocast, module_device, resolve_precision

    if ranks.distributed:
        return contextlib.nullcontext()
    device = module_device(policy)
    return autocast(resolve_precision(model.dtype, device), device)


def final_policy(policy: Any, ranks: RankGroup) -> Any:
    """What the run saves as its final model: the policy itself in one process; gathered
    into a plain copy on rank 0 (every rank takes part) when sharded."""
    if not ranks.distributed:
        return policy
    from composer_replication.distributed.fsdp import gathered_policy

    gathered = gathered_policy(policy, writer=ranks.is_writer)
    return policy if gathered is None else gathered


#: rollout statistics summed over ranks (the rest are recomputed or maxed)
_SUMMED = (
    "rollouts/errors",
    "rollouts/count",
    "rollouts/infrastructure_errors",
    "hack/flagged",
    "rollouts/zero_advantage",
    "rollouts/zero_advantage_dropped",
    "rollouts/truncated",
    "rollouts/truncated_masked",
    "rollouts/demonstrations",
    "agent/tool_errors",
    "agent/parse_failures",
    "agent/call_attempts",
    "tokens/sampled",
    "tokens_per_s/generate",  # ranks sample at the same time: their rates add
)


def merge_rollout_stats(rows: list[dict[str, float]]) -> dict[str, float]:
    """One step's rollout statistics of every rank as one process would report them:
    counts summed, ``reward/*`` and per-episode ``agent/*`` means and shares weighted by each
    rank's rollouts, the flagged share recomputed, times the slowest rank's."""
    if len(rows) == 1:
        return dict(rows[0])
    merged = {key: max(row.get(key, 0.0) for row in rows) for row in rows for key in row}
    for key in [*_SUMMED, *(k for k in merged if k.startswith("agent/calls/"))]:
        if any(key in row for row in rows):
            merged[key] = sum(row.get(key, 0.0) for row in rows)
    total = merged.get("rollouts/count", 0.0)
    per_rollout = [  # per-episode means and shares
        k for k in merged if k.startswith("agent/end/") or k.endswith(("_mean", "_rate"))
    ]
    per_rollout = [
        k for k in per_rollout if k.startswith("agent/") and k != "agent/parse_failure_rate"
    ]
    if "agent/parse_failure_rate" in merged:  # a share of the attempts, not of the rollouts
        attempts = merged.get("agent/call_attempts", 0.0)
        failures = merged.get("agent/parse_failures", 0.0)
        merged["agent/parse_failure_rate"] = failures / attempts if attempts else 0.0
    for key in ("reward/mean", "reward/solved", *per_rollout):
        if total and any(key in row for row in rows):
            weighted = sum(row.get(key, 0.0) * row.get("rollouts/count", 0.0) for row in rows)
            merged[key] = weighted / total
    if "hack/flagged_fraction" in merged:
        merged["hack/flagged_fraction"] = merged["hack/flagged"] / total if total else 0.0
    return merged
