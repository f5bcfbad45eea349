"""The Learner role: the algorithm-blind step, the optimizer and its schedule, the teachers.

One object owns everything that changes the policy's weights: AdamW (clipped, scheduled),
the loss-weight schedule, the jsd teacher / reference models and the DiLoCo hook. Its
:meth:`Learner.update` turns packed micro-batches into one optimizer step. The native loop
holds one in its own process; the Monarch engine holds one inside its trainer actor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.diloco.integration import NO_SYNC
from composer_replication.distributed.fsdp import NoSharding
from composer_replication.integrations.altered_minds.kl_logging import token_mean_kl
from composer_replication.training.loss_schedule import LossSchedule
from composer_replication.training.setup import kl_to_initial_sum, make_scheduler
from composer_replication.training.step import accumulate_step, step_metrics
from composer_replication.training.teachers import TeacherModels

if TYPE_CHECKING:
    from composer_replication.config.loss import LossConfig
    from composer_replication.config.run import ModelConfig, OptimConfig
    from composer_replication.distributed.ranks import RankGroup
    from composer_replication.samples.wire import MicroBatch

__all__ = ["Learner", "adamw_kernel"]


def adamw_kernel(params: list[Any]) -> dict[str, bool]:
    """AdamW's implementation for ``params``: the fused kernel where torch has one for their
    device and dtype (CUDA, CPU), else the multi-tensor one.

    The multi-tensor (foreach) step reads each parameter's step count on the host (one
    ``item`` per parameter); the fused one keeps the counts on the parameters' device and
    reads nothing."""
    fusable = bool(params) and all(
        p.device.type in _FUSED_DEVICES and p.dtype in _FUSED_DTYPES for p in params
    )
    return {"fused": True} if fusable else {"foreach": True}


_FUSED_DEVICES = ("cuda", "cpu")
_FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def non_finite_parts(sums: dict[str, float], extra: dict[str, float], loss: Any) -> str | None:
    """What in a step's sums is NaN or infinite (the loss, each component, the gradient
    norm), as a phrase naming them and, for the rl component of a custom loss, its import
    path; None when all are finite."""
    bad = [
        f"{name.removeprefix('sum/')} = {value}"
        for name, value in (*sums.items(), *extra.items())
        if (name == "loss" or name.startswith("sum/") or name == "grad_norm")
        and not math.isfinite(value)
    ]
    if not bad:
        return None
    phrase = ", ".join(bad)
    if getattr(loss, "type", None) == "custom" and any(b.startswith("rl =") for b in bad):
        phrase += f" (the rl component is loss.import_path = {loss.import_path!r})"
    return phrase


class Learner:
    """Optimizer, scheduler, loss schedule and teachers of one policy.

    It reads its own config sections (``model``: precision and sharding, ``optim``,
    ``loss``) and two facts of the run: ``steps`` (the schedules' length) and
    ``teacher_mode`` (``(mode, ema_decay)`` of the jsd teacher, ``RunConfig.teacher_mode``);
    ``kl_max_tokens`` bounds the tokens :meth:`kl_to_initial` measures on (``[guard]``).
    """

    def __init__(
        self,
        policy: Any,
        *,
        model: ModelConfig,
        optim: OptimConfig,
        loss: LossConfig,
        steps: int,
        teacher_mode: tuple[str, float] = ("policy", 0.99),
        ranks: RankGroup | None = None,
        kl_max_tokens: int | None = None,
    ) -> None:
        self.optim_config = optim
        self.loss_config = loss
        self.policy = policy
        self.losses = LossSchedule(loss, steps)
        mode, decay = teacher_mode
        self.teachers = TeacherModels(policy, mode=mode, ema_decay=decay)
        self.count_reducer = None
        self.metric_reducer = None
        self.ranks = ranks
        self.kl_max_tokens = kl_max_tokens
        #: gathers a sharded policy for sampling / accumulates its gradients (else no-op)
        self.weights: Any = NoSharding()
        if ranks is not None and ranks.distributed:  # after the teachers' frozen copies
            from composer_replication.distributed.counts import sum_values_over_ranks
            from composer_replication.distributed.data_parallel import shard_for_training

            self.weights, self.count_reducer = shard_for_training(policy, model)
            self.metric_reducer = sum_values_over_ranks
        self.sync: Any = NO_SYNC
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            **adamw_kernel(self.params),
        )
        self.scheduler = make_scheduler(self.optimizer, optim, steps)
        self.last_batches: list[MicroBatch] = []

    def update(self, batches: list[MicroBatch], step: int) -> dict[str, Any]:
        """One optimizer step over ``batches``; ``step`` is the step number after it.

        Returns the step's loss metrics plus ``grad_norm`` (when clipping) and
        ``diloco/synced``. The host reads the device once, before the optimizer step: the
        metric sums and the gradient norm in one transfer; a NaN or infinite loss,
        component or gradient norm skips the update (``guard/non_finite`` in the row names
        them; the lifecycle's numeric guard decides whether the run goes on).
        """
        self.optimizer.zero_grad(set_to_none=True)
        with self.weights.accumulating():
            sums = accumulate_step(
                self.policy,
                batches,
                self.losses.current(),
                teacher=self.teachers.teacher(self.policy),
                reference=self.teachers.reference,
                count_reducer=self.count_reducer,
            )
        extra = {}
        if self.optim_config.grad_clip is not None:
            extra["grad_norm"] = torch.nn.utils.clip_grad_norm_(
                self.params, self.optim_config.grad_clip
            )
        # the step's one read comes before the update: a NaN / inf never reaches the weights
        parts, row = sums.read(extra)
        bad = non_finite_parts(parts, row, self.loss_config)
        if self.ranks is not None:  # every rank steps, or none does
            bad = self.ranks.first_set(bad)
        if bad is None:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            row["guard/non_finite"] = bad
        metrics = step_metrics(parts, sums.counts, self.metric_reducer)
        row["diloco/synced"] = float(self.sync.after_inner_step())
        # autocast keeps its low-precision copy of each trainable weight for as long as the
        # region it was made in lasts (the whole run loop): the weights changed, so drop
        # the copies, or every later forward would compute with the weights of this step
        torch.clear_autocast_cache()
        if bad is None:  # a skipped update leaves the schedule where it was
            self.scheduler.step()
        self.teachers.update(self.policy)
        self.losses.observe(metrics, step)
        self.last_batches = batches
        row.update(metrics)
        return row

    def lr(self) -> float:
        """The learning rate of the next step."""
        return float(self.scheduler.get_last_lr()[0])

    def kl_to_initial(self) -> float:
        """Token-mean KL to the initial policy on the last step's batches (every rank's; of
        each rank's, at most ``kl_max_tokens`` tokens)."""
        with self.weights.gathered():
            total, count = kl_to_initial_sum(
                self.policy,
                self.teachers.initial,
                self.last_batches,
                self.loss_config.log_temperature,
                max_tokens=self.kl_max_tokens,
            )
        if self.ranks is not None and self.ranks.distributed:
            parts = self.ranks.gather_shares([(total, count)], self.ranks.world_size)
            total, count = sum(t for t, _ in parts), sum(c for _, c in parts)
        return token_mean_kl(total, count)

    def state_dict(self) -> dict[str, Any]:
        return {"teachers": self.teachers.state_dict(), "losses": self.losses.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.teachers.load_state_dict(state["teachers"])
        self.losses.load_state_dict(state.get("losses", {}))
