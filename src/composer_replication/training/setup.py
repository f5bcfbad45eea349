"""Run set-up pieces shared by the backends: seeding, the policy (+ LoRA), the LR schedule,
the KL to the initial policy, and the console progress bar. Helpers only; the native loop
(``training.loop``) and the trl backend compose them."""

from __future__ import annotations

import math
import os
import random
import warnings
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from composer_replication.config.run import ModelConfig, OptimConfig


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_policy(model: ModelConfig) -> tuple[Any, Any]:
    """Load the policy onto its device in its parameter dtype (and apply LoRA), as the
    ``[model]`` section says (``device`` / ``dtype`` / ``tf32``:
    :mod:`composer_replication.model.devices`)."""
    from composer_replication.model.devices import resolve_device, resolve_precision, set_tf32
    from composer_replication.model.loading import load_policy

    device = resolve_device(model.device)
    precision = resolve_precision(model.dtype, device)
    set_tf32(model.tf32, device)
    policy, tokenizer = load_policy(model.source, dtype=precision.param_dtype, device=device)
    if model.lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        lora = model.lora
        with warnings.catch_warnings():
            # peft reads transformers' deprecated is_gradient_checkpointing alias, which
            # warns once per run into every log; the setting itself is applied below
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            policy = get_peft_model(
                policy,
                PeftLoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules),
                    task_type="CAUSAL_LM",
                ),
            )
    if model.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if model.lora is not None:
            policy.enable_input_require_grads()
    policy.train()
    return policy, tokenizer


def make_scheduler(optimizer: Any, optim: OptimConfig, steps: int) -> Any:
    """The learning-rate schedule of ``[optim]`` over a run of ``steps`` steps."""
    warmup, total, kind = optim.warmup_steps, steps, optim.schedule

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def kl_to_initial(
    policy: Any,
    initial: Any,
    batches: list[Any],
    temperature: float,
    *,
    max_tokens: int | None = None,
) -> float:
    """Token-mean KL(policy || initial) in nats/token at the batches' trainable positions
    (of at most ``max_tokens`` tokens of them: :func:`spread_micro_batches`).

    Exact over the vocabulary at each position (not a sampled estimate): the batches were
    sampled before the last optimizer step, and a k1/k3 estimate on tokens the current
    policy did not sample can explode (exp of a large log-ratio) where the true KL is small.
    The mean is ``integrations.altered_minds.kl_logging.token_mean_kl`` (the kill switch's
    unit); the device is read once.
    """
    from composer_replication.integrations.altered_minds.kl_logging import token_mean_kl

    total, count = kl_to_initial_sum(policy, initial, batches, temperature, max_tokens=max_tokens)
    return token_mean_kl(total, count)


def spread_micro_batches(batches: list[Any], max_tokens: int | None) -> list[Any]:
    """Whole micro-batches of ``batches`` evenly spread over them, as many as fit in
    ``max_tokens`` (B x T) tokens and at least one; every one when ``max_tokens`` is None
    or all fit. A measurement on a long step costs a fraction of its forwards, on rows
    from all over the step (packing orders them by length)."""
    sizes = [int(mb.input_ids.numel()) for mb in batches]
    if max_tokens is None or sum(sizes) <= max_tokens:
        return list(batches)
    for count in range(len(batches) - 1, 0, -1):
        # the middles of ``count`` equal intervals of the micro-batches
        picked = [int((i + 0.5) * len(batches) / count) for i in range(count)]
        if count == 1 or sum(sizes[i] for i in picked) <= max_tokens:
            return [batches[i] for i in picked]
    raise AssertionError("unreachable: one micro-batch is always picked")


@torch.no_grad()  # a measurement: no graph to build
def kl_to_initial_sum(
    policy: Any,
    initial: Any,
    batches: list[Any],
    temperature: float,
    *,
    max_tokens: int | None = None,
) -> tuple[float, int]:
    """:func:`kl_to_initial`'s sum over the trainable positions and their number (what
    data-parallel ranks add up); ``max_tokens``: of :func:`spread_micro_batches`' share of
    ``batches`` only."""
    from composer_replication.integrations.altered_minds.kl_logging import token_kl_sum
    from composer_replication.model.parts import last_hidden_states, lm_head_weight
    from composer_replication.ops.jsd import jsd_from_hidden

    total, count = None, 0
    device = lm_head_weight(policy).device
    for mb in spread_micro_batches(batches, max_tokens):
        n_trainable = mb.trainable_rows.numel()  # found when packing: no device read
        if mb.n_rows == 0 or n_trainable == 0:
            continue
        mb = mb.to(device)
        hidden = [
            _rows(
                last_hidden_states(
                    model, mb.input_ids, mb.attention_mask, row_tokens=mb.row_tokens()
                )[:, :-1],
                mb.trainable_rows,
            )
            for model in (policy, initial)
        ]
        # Generalized JSD at beta = 1 is KL(student || teacher) (GKD convention).
        per_token = jsd_from_hidden(
            hidden[0],
            lm_head_weight(policy),
            hidden[1],
            teacher_weight=lm_head_weight(initial),
            beta=1.0,
            temperature=temperature,
        )
        # token_kl_sum clamps at 0: float32 rounding can leave -1e-9 where the models agree.
        part, _ = token_kl_sum(per_token)  # the count is n_trainable, known on the host
        total = part if total is None else total + part
        count += n_trainable
    return (0.0 if total is None else float(total)), count  # the one read


def _rows(hidden: Any, flat_rows: Any) -> Any:
    """(M, H) rows of (B, T, H) ``hidden`` at flat indices into (B, T) (as ``hidden[mask]``
    takes them, without the boolean index's device read)."""
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_rows)


def quiet_library_progress_bars(stream: Any = None) -> bool:
    """Turn off the model libraries' own progress bars (weight loading, GGUF conversion)
    when ``stream`` (default: stderr) is not a terminal, so they do not flood logs.
    Returns whether it did."""
    import sys

    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return False
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return True


class ProgressBar:
    """Live training progress: a rich bar with reward and loss on a terminal, one plain line
    per step when the console is not one (CI, ``nohup``, a log file), silent without a
    console."""

    def __init__(self, console: Any, total: int, done: int) -> None:
        self._bar = None
        self._console = console
        self._total = total
        if console is None or not console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
        )
        self._task = self._bar.add_task("train", total=total, completed=done, info="")
        self._bar.start()

    @staticmethod
    def describe(row: dict[str, Any]) -> str:
        """Reward, loss and (when measured) held-out pass@1, sampled and greedy, of a row.
        A step that trained on demonstrations only has no reward of the policy's to show."""
        info = f"loss {row.get('loss', 0):.4f}"
        if row.get("rollouts/count", 1) or not row.get("rollouts/demonstrations"):
            info = f"reward {row.get('reward/mean', 0):.3f} {info}"
        else:
            info = f"demonstrations {row['rollouts/demonstrations']:.0f} {info}"
        if row.get("heldout/pass@1") is not None:
            info += f" held-out {row['heldout/pass@1']:.3f}"
        if row.get("heldout/greedy_pass@1") is not None:
            info += f" greedy {row['heldout/greedy_pass@1']:.3f}"
        return info

    def update(self, row: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=row["step"], info=self.describe(row))
        elif self._console is not None:
            seconds = row.get("time/step_s")
            took = f" {seconds:.1f} s" if seconds is not None else ""
            line = f"step {row['step']}/{self._total} {self.describe(row)}{took}"
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
