"""Loss settings that move during a run: TAID's interpolation ``t``.

With ``loss.sdpo_wrapper = "taid"`` and no fixed ``loss.taid_t``, the jsd component's ``t``
follows :class:`~composer_replication.distillation.TAIDScheduler` (arXiv 2501.16937): a
linear floor from ``taid_t_start`` to ``taid_t_end`` over the run's steps plus an adaptive
bump while the jsd loss falls. :class:`LossSchedule` hands the trainer step the settings of
the current step and folds each step's jsd loss into the schedule; its state goes into
checkpoints so a resumed run continues the same schedule. For every other setting it is
the identity.
"""

from __future__ import annotations

from typing import Any

from composer_replication.config.loss import LossConfig


class LossSchedule:
    """The loss settings of each step (the config itself unless TAID is scheduled)."""

    def __init__(self, config: LossConfig, total_steps: int) -> None:
        self.config = config
        self.taid = None
        if config.sdpo_wrapper == "taid" and config.taid_t is None:
            from composer_replication.ops.taid import TAIDScheduler

            self.taid = TAIDScheduler(
                max(1, total_steps), t_start=config.taid_t_start, t_end=config.taid_t_end
            )

    def current(self) -> LossConfig:
        """The settings for the next step."""
        if self.taid is None:
            return self.config
        return self.config.model_copy(update={"taid_t": self.taid.t})

    def observe(self, metrics: dict[str, float], step: int) -> None:
        """Fold a finished step's metrics in (TAID reads ``loss/jsd``); adds ``taid/t``."""
        if self.taid is None:
            return
        metrics["taid/t"] = self.taid.t
        if metrics.get("tokens/jsd"):
            self.taid.update_t(float(metrics["loss/jsd"]), step)

    def state_dict(self) -> dict[str, Any]:
        return {"taid": None if self.taid is None else self.taid.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.taid is not None and state.get("taid") is not None:
            self.taid.load_state_dict(state["taid"])
