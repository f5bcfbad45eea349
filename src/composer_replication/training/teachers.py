"""Which model teaches the ``jsd`` component, and the frozen reference for ``dpo``.

- ``policy``: the live policy itself under no_grad (SDPO's self-teacher, arXiv 2601.20802).
- ``initial``: a frozen copy of the policy as it was when training started.
- ``ema``: an exponential moving average of the policy's weights, updated after each
  optimizer step (a slower, steadier self-teacher).

The frozen initial copy doubles as the DPO reference model. For a LoRA policy no copy is
made: the base weights under the adapters are the initial policy
(:class:`~composer_replication.model.parts.AdapterDisabled`), which saves a whole model's
memory and stays the true initial policy across resumes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from composer_replication.model.parts import AdapterDisabled

TEACHER_MODES = ("policy", "initial", "ema")


class TeacherModels:
    """Holds the frozen initial copy and the EMA copy of a policy, as configured."""

    def __init__(
        self,
        policy: Any,
        *,
        mode: str = "policy",
        ema_decay: float = 0.99,
        keep_initial: bool = True,
    ) -> None:
        if mode not in TEACHER_MODES:
            raise ValueError(f"teacher mode {mode!r} is not one of {TEACHER_MODES}")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay={ema_decay} must be in [0, 1)")
        self.mode = mode
        self.ema_decay = ema_decay
        self.initial: Any = None
        if keep_initial or mode == "initial":
            self.initial = (
                AdapterDisabled(policy)
                if AdapterDisabled.applies_to(policy)
                else _frozen_copy(policy)
            )
        self.ema = _frozen_copy(policy) if mode == "ema" else None

    def teacher(self, policy: Any) -> Any:
        """The model the jsd teacher forward runs on."""
        if self.mode == "initial":
            return self.initial
        if self.mode == "ema":
            return self.ema
        return policy

    @property
    def reference(self) -> Any | None:
        """The frozen initial policy (DPO reference), if kept."""
        return self.initial

    @torch.no_grad()
    def update(self, policy: Any) -> None:
        """Fold the policy's current weights into the EMA copy (call after optimizer.step)."""
        if self.ema is None:
            return
        live = dict(policy.named_parameters())
        for name, param in self.ema.named_parameters():
            source = live.get(name)
            if source is not None:
                param.lerp_(source.detach().to(param.dtype), 1.0 - self.ema_decay)

    def state_dict(self) -> dict[str, Any]:
        return {"ema": None if self.ema is None else self.ema.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("ema") is not None and self.ema is not None:
            self.ema.load_state_dict(state["ema"])


def _frozen_copy(model: Any) -> Any:
    frozen = copy.deepcopy(model)
    frozen.eval()
    for param in frozen.parameters():
        param.requires_grad_(False)
    return frozen
