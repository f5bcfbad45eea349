"""The loss/model smoke job: load a policy, compute the three-channel loss, take AdamW steps.

It exercises every piece the trainer is built from (model loading, the batch builder, the
chunked hidden-state losses, backward, an optimizer step) in under a minute on a 2-core
CPU, and reports the components before and after each step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composer_replication.config.loss import loss_default


@dataclass
class SmokeReport:
    """What the smoke job measured: loss components per step and timings."""

    model_source: str
    n_parameters: int
    steps: list[dict[str, float]] = field(default_factory=list)
    load_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)


def run_smoke(
    model_source: str | None = None,
    *,
    steps: int = 1,
    lr: float = 1e-5,
    seed: int = 0,
    alpha_sdpo: float = loss_default("alpha_sdpo"),
    beta_replay: float = loss_default("beta_replay"),
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> SmokeReport:
    """Run ``steps`` AdamW steps of ``compose_loss`` on ``build_batch``'s smoke batch.

    ``model_source`` is anything :func:`composer_replication.model.loading.load_policy` accepts
    (None: the embedded SmolLM2-135M-Instruct). Returns a :class:`SmokeReport` whose
    ``steps`` holds ``steps + 1`` rows of components: before the first step and after each.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if not lr > 0:
        raise ValueError(f"lr={lr} must be > 0")
    import torch

    from composer_replication.model.loading import load_policy
    from composer_replication.ops.compose import compose_loss
    from composer_replication.ops.compose_batch import build_batch

    torch.manual_seed(seed)
    start = time.perf_counter()
    model, tokenizer = load_policy(model_source)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # frozen initial policy
    model.train()
    report = SmokeReport(
        model_source=str(model_source or "embedded"),
        n_parameters=sum(p.numel() for p in model.parameters()),
        load_seconds=time.perf_counter() - start,
    )
    batch: dict[str, Any] = build_batch(tokenizer, ref_model=ref_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    kwargs = {"alpha_sdpo": alpha_sdpo, "beta_replay": beta_replay}
    for step in range(steps + 1):
        t0 = time.perf_counter()
        comps = compose_loss(model, batch, ref_model=ref_model, **kwargs)
        values = comps.detached()
        report.steps.append(values)
        if on_step is not None:
            on_step(step, values)
        if step == steps:
            break
        optimizer.zero_grad(set_to_none=True)
        comps.total.backward()
        optimizer.step()
        report.step_seconds.append(time.perf_counter() - t0)
    return report
