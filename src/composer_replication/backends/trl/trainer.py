"""``ComposerReplicationTrainer``: trl's GRPOTrainer plus the two other Composer channels.

``total = trl's GRPO loss + alpha_sdpo * sdpo_jsd + beta_replay * trace_replay_dpo``

- GRPO: whatever ``args`` selects (``po_presets.make_dr_grpo_config`` for Composer's Dr. GRPO).
- ``sdpo_jsd`` (SDPO, arXiv 2601.20802): the token-mean divergence between the policy on
  the plain prompt (student, with grad) and the same policy on the prompt with a hint
  (teacher, no grad), on the sampled tokens of completions that hit an error site: the
  generalized JSD (arXiv 2306.13649), or TAID / entropy-aware OPD with ``sdpo_wrapper``.
- ``trace_replay_dpo``: DPO (arXiv 2305.18290) or SimPO (``dpo_variant``) on preference
  pairs from teacher-consensus trace replay, drawn alongside the prompts; DPO reference
  log-probs computed once per pair from the initial model (at construction, before any
  update) and cached on the pair.

Both channels come from the one loss assembler
(:func:`composer_replication.ops.assembler.micro_batch_losses`, the call the native trainer
step and ``loss.compose_loss`` make): their rows are converted into training samples
(:mod:`composer_replication.ops.padded`), with the same settings under the same names.

Each channel is logged through trl's metrics in the native loop's vocabulary
(``loss/rl`` for trl's GRPO loss, ``loss/jsd``, ``loss/dpo``, ``tokens/dpo`` (pairs),
``sdpo/error_sites``), so a trl run's report plots the same losses; like trl's own loss, the
extra channels are divided by the gradient-accumulation steps in training.

Feedback side channel. A reward function reports error-site text (failing-test output, a
tool error) by exposing ``last_feedback``: after each call, a list with one entry per
completion of that call (``str`` or ``None``), see ``FeedbackRewardFunc``. After trl scores a
generation batch, the trainer turns each completion's feedback into a hint with ``hint_fn``
(default ``default_hint``: ``hint_generator.classify_error`` + ``dispatch``), re-renders the
prompt with the hint in the last user message and appends the SAME completion ids. The batch
gains, per row (so trl's shuffling and splitting keep them aligned):

- ``ctx_teacher_input_ids`` / ``ctx_teacher_attention_mask`` (B, P'+C): hinted prompt
  (left-padded to P') followed by ``completion_ids``;
- ``sdpo_loss_mask`` (B, C): aligned with ``completion_ids``; the completion mask on rows
  with a hint, 0 elsewhere;
- ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}`` (B, L), ``dpo_pair_mask``
  (B,), ``dpo_{chosen,rejected}_ref_logprobs`` (B,): pair k sits on row k, rows without a pair
  have ``dpo_pair_mask = 0``.

Traces through ``data_collator``. Given ``data_collator=ComposerDataCollator(...)`` (trl's
own ``GRPOTrainer`` takes no collator), ``train_dataset`` may hold agent traces (the
``TraceExample`` dict shape: ``trace_id``, ``turns``, ``final_reward``, ``dpo_pairs``; a
``prompt`` column is added from each trace's state when missing) and the collator feeds the
two extra channels: for every generation batch, the batch's distinct traces are collated;

- their SDPO rows (the trace's trained assistant turns after the plain state, student, and
  after the same conversation with each error site's hint written in, teacher; every turn
  after a failing tool result, and the response when it led to an error, is a site) ride
  along as ``trace_*`` fields (B, W) on the first
  row of each trace (``trace_input_ids``, ``trace_attention_mask``, ``trace_response_mask``,
  ``trace_ctx_teacher_{input_ids,attention_mask,response_mask}``, ``trace_sdpo_loss_mask``)
  and are distilled like ``loss.compose_loss``'s channel; the SDPO channel is the token
  mean over these tokens and the feedback tokens together;
- their preference pairs join the drawn pairs in the ``dpo_*`` rows, with reference
  log-probs computed once per pair at construction (every trace of ``train_dataset`` is
  collated then) with the same reference model as ``pairs=``.

Without ``reward_funcs`` every completion of a trace scores the trace's recorded reward
(``CollatorConfig.rlvr_reward_key``; ``TraceReward``): GRPO's group-relative advantage is 0
and the update comes from SDPO and DPO (a ``UserWarning`` says so); pass ``reward_funcs`` to
score the sampled completions. ``processing_class`` defaults to the collator's tokenizer.

A channel with no inputs in a micro-batch contributes nothing and logs nothing.
"""

from __future__ import annotations

import dataclasses
import json
import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from trl import GRPOTrainer

from composer_replication.algo.context import augment_messages, hint_text
from composer_replication.algo.replay_dpo import PairPool, build_pair_pool
from composer_replication.backends.trl.data_collator import ComposerDataCollator, TraceExample
from composer_replication.config.advantage import DEFAULT_HINT_TEMPLATE
from composer_replication.config.loss import LossConfig, loss_default
from composer_replication.ops.divergence import DIVERGENCE_KNOBS, divergence_settings
from composer_replication.ops.padded import padded_losses, padded_samples
from composer_replication.ops.pairs import (
    PAIR_KNOBS,
    fill_reference_logps,
    pad_rows,
    pair_loss_settings,
    pairs_from_padded,
    sequence_logps,
)
from composer_replication.ops.self_distillation import aligned_from_masks
from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import DPOPairTokens

__all__ = ["ComposerReplicationTrainer", "FeedbackRewardFunc", "TraceReward", "default_hint"]

#: The per-row SDPO fields a ``data_collator`` adds (``trace_`` + the collator's key).
_TRACE_SDPO_KEYS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "ctx_teacher_input_ids",
    "ctx_teacher_attention_mask",
    "ctx_teacher_response_mask",
    "sdpo_loss_mask",
)

_REF_BATCH = 8  # pairs per forward when scoring the reference log-probs


@runtime_checkable
class FeedbackRewardFunc(Protocol):
    """A trl reward function that also reports each completion's error-site text.

    After every call, ``last_feedback`` holds one entry per completion of that call:
    the feedback (failing tests, tool error) or ``None`` for a completion with nothing to
    hint about. The trainer sets it to ``None`` before each generation batch.
    """

    last_feedback: list[str | None] | None

    def __call__(
        self, prompts: list[Any], completions: list[Any], **kwargs: Any
    ) -> list[float | None]: ...


def default_hint(feedback: str) -> str | None:
    """The hint for one completion's feedback: the ``hint_generator`` template of
    ``classify_error(feedback)``, else a generic hint quoting the feedback's tail (the same
    rule as the native ``sdpo`` algorithm's ``hint_source = "generator"``)."""
    carrier = Rollout(
        task_id="", prompt_ids=[], completion_ids=[], inference_logprobs=[], feedback=feedback
    )
    return hint_text(carrier, "generator")


class TraceReward:
    """The trl reward function of a trace dataset without a verifier: every completion of a
    trace scores the trace's recorded reward (``TraceExample.rewards[key]``), read from the
    dataset columns trl passes as keywords."""

    __name__ = "trace_reward"

    def __init__(self, key: str = "final_reward") -> None:
        self.key = key

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        rows = _column_rows(kwargs, len(prompts))
        out = []
        for row in rows:
            rewards = TraceExample.from_dict(row).rewards
            if self.key not in rewards:
                raise ValueError(
                    f"trace {row.get('trace_id')!r} has no reward {self.key!r} "
                    f"(rewards: {sorted(rewards)}); add it or set CollatorConfig.rlvr_reward_key"
                )
            out.append(float(rewards[self.key]))
        return out


def _column_rows(columns: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    """The dataset rows behind trl's reward keywords (the per-row lists of length ``n``)."""
    keys = [k for k, v in columns.items() if isinstance(v, list) and len(v) == n]
    return [{k: columns[k][i] for k in keys} for i in range(n)]


def _trace_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A dataset row as a trace dict (trl's ``prompt`` column left out)."""
    return {k: v for k, v in row.items() if k != "prompt"}


def _add_prompt(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"prompt": TraceExample.from_dict(_trace_row(row)).messages()}


def _with_prompts(dataset: Any) -> Any:
    """``dataset`` with a ``prompt`` column (each trace's state as chat messages) when it
    has none."""
    columns = getattr(dataset, "column_names", None)
    if dataset is None or columns is None or "prompt" in columns:
        return dataset
    return dataset.map(_add_prompt)


def _check_dataset_split(dataset: Any, split: HeldoutSplit | None) -> None:
    """Refuse a training dataset that holds a held-out task (by its ``task_id`` column)."""
    if split is None or dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None or "task_id" not in columns:
        return
    split.check_trainable([str(t) for t in dataset["task_id"] if t])


#: The padded rollout tensors of trl's micro-batch kept as ``last_sampled`` (in this order).
SAMPLED_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


class ComposerReplicationTrainer(GRPOTrainer):
    """trl's ``GRPOTrainer`` whose loss adds Composer's SDPO and trace-replay DPO channels.

    Positional and other keyword arguments are trl's (``model``, ``reward_funcs``, ``args``,
    ``train_dataset``, ``processing_class``, ``peft_config``, ...). Extra keyword-only args:

    Args:
        alpha_sdpo: weight of the SDPO JSD channel (0 turns it off).
        beta_replay: weight of the trace-replay DPO channel (0 turns it off).
        sdpo_jsd_beta: the JSD's mixture coefficient in [0, 1] (0 forward KL, 1 reverse KL).
        sdpo_temperature: softmax temperature of both JSD distributions.
        sdpo_token_clip: clamp each token's divergence to this value (None: no clamp).
        sdpo_wrapper: ``"none"`` (generalized JSD), ``"taid"`` (TAID at ``taid_t``, a
            number or a ``TAIDScheduler``) or ``"entropy_opd"`` (``entropy_opd_h_max``).
        replay_dpo_beta: DPO's beta.
        dpo_variant: ``"dpo"`` or ``"simpo"`` (reference-free; ``simpo_beta``,
            ``simpo_gamma``).
        hint_fn: feedback text -> hint (None: no hint for that completion).
        pairs: preference pairs (``DPOPair`` / ``NormalizedDPOPair`` objects or dicts, or
            ``DPOPairTokens``); or ``pairs_path``, a JSONL file of them.
        pairs_per_prompt: pairs drawn per prompt of each generation batch.
        max_pair_length: a pair side longer than this keeps its last tokens.
        replay_ref_model: model for the DPO reference log-probs (default: trl's reference
            model when it has one, else the policy itself at construction time, which is
            the initial model).
        split: a ``train_dataset`` with a ``task_id`` column may hold no task this split
            holds out (``HeldoutLeakError`` at construction); the project's split by default,
            None for a dataset of tasks with no held-out pool.
        data_collator: a ``ComposerDataCollator``: the SDPO and DPO inputs of the traces in
            ``train_dataset`` (see the module docstring); None: feedback and ``pairs`` only.
    """

    def __init__(
        self,
        *args: Any,
        alpha_sdpo: float = loss_default("alpha_sdpo"),
        beta_replay: float = loss_default("beta_replay"),
        sdpo_jsd_beta: float = loss_default("sdpo_jsd_beta"),
        sdpo_temperature: float = loss_default("sdpo_temperature"),
        sdpo_token_clip: float | None = loss_default("sdpo_token_clip"),
        replay_dpo_beta: float = loss_default("replay_dpo_beta"),
        sdpo_wrapper: str = loss_default("sdpo_wrapper"),
        taid_t: Any = None,
        entropy_opd_h_max: float | None = loss_default("entropy_opd_h_max"),
        dpo_variant: str = loss_default("dpo_variant"),
        simpo_beta: float = loss_default("simpo_beta"),
        simpo_gamma: float = loss_default("simpo_gamma"),
        hint_fn: Callable[[str], str | None] | None = default_hint,
        pairs: Sequence[Any] | None = None,
        pairs_path: str | None = None,
        pairs_per_prompt: int = 1,
        max_pair_length: int = 2048,
        replay_ref_model: Any | None = None,
        split: HeldoutSplit | None = DEFAULT_SPLIT,
        data_collator: ComposerDataCollator | None = None,
        **kwargs: Any,
    ) -> None:
        # Set and checked before trl starts, so a bad value fails fast.
        self.alpha_sdpo, self.beta_replay = float(alpha_sdpo), float(beta_replay)
        self.sdpo_jsd_beta, self.sdpo_temperature = float(sdpo_jsd_beta), float(sdpo_temperature)
        self.sdpo_token_clip = None if sdpo_token_clip is None else float(sdpo_token_clip)
        self.replay_dpo_beta, self.hint_fn = float(replay_dpo_beta), hint_fn
        self.sdpo_wrapper, self.taid_t, self.entropy_opd_h_max = (
            sdpo_wrapper,
            taid_t,
            entropy_opd_h_max,
        )
        self.dpo_variant, self.simpo_beta, self.simpo_gamma = dpo_variant, simpo_beta, simpo_gamma
        self.pairs_per_prompt = int(pairs_per_prompt)
        self._check_settings(max_pair_length)
        self._divergence(), self._pair_settings()  # validates them under their public names
        self.trace_collator = data_collator
        self.max_pair_length = int(max_pair_length)
        if data_collator is not None:
            self._prepare_trace_kwargs(args, kwargs)
        _check_dataset_split(kwargs.get("train_dataset"), split)
        super().__init__(*args, **kwargs)
        self._feedback_funcs = [f for f in self.reward_funcs if hasattr(f, "last_feedback")]
        # the last trained micro-batch's rollouts (``SAMPLED_KEYS``), None before the first
        self.last_sampled: tuple[torch.Tensor, ...] | None = None
        trace_cfg = None if data_collator is None else data_collator.config
        trace_sdpo = (
            trace_cfg is not None and trace_cfg.enable_sdpo and bool(trace_cfg.hint_generator)
        )
        trace_dpo = trace_cfg is not None and trace_cfg.enable_replay_dpo
        feedback_sdpo = hint_fn is not None and bool(self._feedback_funcs)
        if self.alpha_sdpo > 0 and not (feedback_sdpo or trace_sdpo):
            _channel_off(
                f"alpha_sdpo={alpha_sdpo} but no reward function reports feedback (a "
                "`last_feedback` attribute, see FeedbackRewardFunc) or hint_fn is None, and "
                "no data_collator with a hint_generator gives trace error sites"
            )
        self._pair_pool: PairPool | None = None
        self._trace_refs: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, float]] = {}
        reference = next(m for m in (replay_ref_model, self.ref_model, self.model) if m is not None)
        if self.beta_replay > 0 and (pairs is not None or pairs_path is not None or not trace_dpo):
            pool = build_pair_pool(pairs, pairs_path, self._tokenizer, weight=1.0)
            if not pool:
                _channel_off(f"beta_replay={beta_replay} but no pairs (pairs= or pairs_path=)")
            else:
                pool = [_clip_pair(p, max_pair_length) for p in pool]
                if self._pair_settings().needs_reference:
                    self._fill_reference_logps(pool, reference)
                self._pair_pool = PairPool(pool, random.Random(self.args.seed))
        if self.beta_replay > 0 and trace_dpo:
            self._score_trace_pairs(reference)

    def _prepare_trace_kwargs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """trl's keywords for a trace dataset: prompts from the traces' states, the
        collator's tokenizer, and ``TraceReward`` when no reward function is given."""
        collator = self.trace_collator
        for name in ("train_dataset", "eval_dataset"):
            if kwargs.get(name) is not None:
                kwargs[name] = _with_prompts(kwargs[name])
        kwargs.setdefault("processing_class", collator.tokenizer)
        if len(args) < 2 and kwargs.get("reward_funcs") is None:
            kwargs["reward_funcs"] = [TraceReward(collator.config.rlvr_reward_key)]
            warnings.warn(
                "ComposerReplicationTrainer: no reward_funcs, so every completion of a trace "
                f"scores the trace's recorded {collator.config.rlvr_reward_key!r}: GRPO's "
                "group-relative advantage is 0 and the update comes from the SDPO and DPO "
                "channels; pass reward_funcs to score the sampled completions",
                UserWarning,
                stacklevel=3,
            )

    def _score_trace_pairs(self, reference: Any) -> None:
        """Reference log-probs of every preference pair of ``train_dataset``'s traces,
        computed once now (before any update) and cached by the pair's token ids."""
        if not self._pair_settings().needs_reference or self.train_dataset is None:
            return
        found: dict[tuple[tuple[int, ...], tuple[int, ...]], DPOPairTokens] = {}
        for row in self.train_dataset:
            for pair in self._collated_pairs(self.trace_collator([_trace_row(row)])):
                found.setdefault(_pair_key(pair), pair)
        pool = list(found.values())
        self._fill_reference_logps(pool, reference)
        self._trace_refs = {
            _pair_key(p): (float(p.ref_chosen_logp), float(p.ref_rejected_logp)) for p in pool
        }

    def _collated_pairs(self, batch: Mapping[str, torch.Tensor]) -> list[DPOPairTokens]:
        """The collator's pair rows as tokenised pairs (clipped to ``max_pair_length``)."""
        if "dpo_chosen_input_ids" not in batch:
            return []
        sides = [
            tuple(
                batch[f"dpo_{side}_{part}"]
                for part in ("input_ids", "response_mask", "attention_mask")
            )
            for side in ("chosen", "rejected")
        ]
        pairs = pairs_from_padded(sides[0], sides[1])
        return [_clip_pair(p, self.max_pair_length) for p in pairs]

    def _check_settings(self, max_pair_length: int) -> None:
        for name in ("alpha_sdpo", "beta_replay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 turns it off)")
        for name, value in (
            ("pairs_per_prompt", self.pairs_per_prompt),
            ("max_pair_length", max_pair_length),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")

    def _divergence(self) -> Any:
        """The SDPO divergence settings (``taid_t`` read now: a scheduler may move it)."""
        return divergence_settings(**{k: getattr(self, k) for k in DIVERGENCE_KNOBS})

    def _pair_settings(self) -> Any:
        return pair_loss_settings(**{k: getattr(self, k) for k in PAIR_KNOBS})

    def _loss_config(self) -> LossConfig:
        """The assembler's settings: the pair knobs (the divergence is passed as built by
        :meth:`_divergence`, its ``taid_t`` possibly a scheduler)."""
        return LossConfig.from_knobs(**{k: getattr(self, k) for k in PAIR_KNOBS})

    # ------------------------------------------------------------------ batch building

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        for func in self._feedback_funcs:
            func.last_feedback = None
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        n_rows = output["completion_ids"].shape[0]
        if self.alpha_sdpo > 0 and self.hint_fn is not None and self._feedback_funcs:
            hints = [(self.hint_fn(t) or None) if t else None for t in self._feedback(n_rows)]
            self._metrics[mode]["sdpo/error_sites"].append(
                sum(h is not None for h in hints) / max(n_rows, 1)
            )
            if any(hints):
                output.update(self._teacher_fields(inputs, output, hints))
        trace_pairs: list[DPOPairTokens] = []
        if self.trace_collator is not None:
            trace_pairs = self._trace_fields(inputs, output, mode)
        if self._pair_pool is not None or trace_pairs:
            pairs: list[DPOPairTokens] = []
            if self._pair_pool is not None:
                group = self.num_generations if mode == "train" else self.num_generations_eval
                n_pairs = min(n_rows, -(-n_rows // group) * self.pairs_per_prompt)
                pairs = self._pair_pool.draw(n_pairs)
            pairs = (pairs + trace_pairs)[:n_rows]
            self._metrics[mode]["tokens/dpo"].append(float(len(pairs)))
            output.update(self._pair_fields(pairs, n_rows))
        return output

    def _trace_fields(
        self, inputs: list[dict[str, Any]], output: dict[str, Any], mode: str
    ) -> list[DPOPairTokens]:
        """Collate the batch's distinct traces: their SDPO rows go into ``output`` as
        ``trace_*`` fields on each trace's first row; returns their pairs (with the cached
        reference log-probs)."""
        n_rows = output["completion_ids"].shape[0]
        first: dict[str, int] = {}
        for i, row in enumerate(inputs[:n_rows]):
            key = json.dumps(_trace_row(row), sort_keys=True, default=str)
            first.setdefault(key, i)
        rows = sorted(first.values())
        batch = self.trace_collator([_trace_row(inputs[i]) for i in rows])
        device = output["completion_ids"].device
        if self.alpha_sdpo > 0 and "sdpo_loss_mask" in batch:
            has_hint = batch["sdpo_loss_mask"].any(dim=-1)
            self._metrics[mode]["sdpo/trace_error_sites"].append(float(has_hint.float().mean()))
            if bool(has_hint.any()):
                pad = self.trace_collator.config.pad_token_id
                for key in _TRACE_SDPO_KEYS:
                    value = batch[key]
                    fill = pad if key.endswith("input_ids") else 0
                    spread = value.new_full((n_rows, value.shape[1]), fill)
                    spread[rows] = value
                    output[f"trace_{key}"] = spread.to(device)
        if self.beta_replay <= 0:
            return []
        pairs = self._collated_pairs(batch)
        if self._pair_settings().needs_reference:
            for pair in pairs:
                ref = self._trace_refs.get(_pair_key(pair))
                if ref is None:
                    raise RuntimeError(
                        "a trace's preference pair has no cached reference log-probs: the "
                        "trainer scores the pairs of train_dataset once at construction; "
                        "traces must come from train_dataset"
                    )
                pair.ref_chosen_logp, pair.ref_rejected_logp = ref
        return pairs

    def _feedback(self, n_rows: int) -> list[str | None]:
        """Per completion, the feedback of every reporting reward function, joined."""
        merged: list[list[str]] = [[] for _ in range(n_rows)]
        for func in self._feedback_funcs:
            reported = func.last_feedback
            if reported is None:
                continue
            if len(reported) != n_rows:
                raise ValueError(
                    f"reward function {type(func).__name__} reported {len(reported)} feedback "
                    f"entries for {n_rows} completions; set last_feedback to one entry (str or "
                    "None) per completion of the call"
                )
            for i, text in enumerate(reported):
                if text:
                    merged[i].append(str(text))
        return ["\n".join(texts) if texts else None for texts in merged]

    def _hinted_prompt_ids(self, prompt: Any, hint: str) -> list[int]:
        if isinstance(prompt, str):
            text = DEFAULT_HINT_TEMPLATE.format(content=prompt, hint=hint)
            return list(self.processing_class(text=text)["input_ids"])
        messages = augment_messages(prompt, DEFAULT_HINT_TEMPLATE, hint=hint)
        ids = self.processing_class.apply_chat_template(
            messages,
            tools=self.tools or None,
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **self.chat_template_kwargs,
        )["input_ids"]
        return [int(t) for t in ids]

    def _teacher_fields(
        self, inputs: list[dict[str, Any]], output: dict[str, Any], hints: list[str | None]
    ) -> dict[str, torch.Tensor]:
        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        rows = []
        for i, hint in enumerate(hints):
            if hint is None:  # the plain prompt: aligned, never used by the loss
                rows.append(prompt_ids[i][prompt_mask[i].bool()].tolist())
            else:
                rows.append(self._hinted_prompt_ids(inputs[i]["prompt"], hint))
        t_prompt, t_mask = pad_rows(rows, self._tokenizer.pad_token_id, left=True)
        device = completion_ids.device
        response = completion_mask * output.get("tool_mask", torch.ones_like(completion_mask))
        has_hint = torch.tensor([h is not None for h in hints], device=device)
        return {
            "ctx_teacher_input_ids": torch.cat([t_prompt.to(device), completion_ids], dim=1),
            "ctx_teacher_attention_mask": torch.cat([t_mask.to(device), completion_mask], dim=1),
            "sdpo_loss_mask": response * has_hint[:, None].to(response.dtype),
        }

    def _pair_fields(self, pairs: list[DPOPairTokens], n_rows: int) -> dict[str, torch.Tensor]:
        device = self.accelerator.device
        ids, attn, resp = _pair_rows(pairs, n_rows, self._tokenizer.pad_token_id)
        out: dict[str, torch.Tensor] = {}
        for k, side in enumerate(("chosen", "rejected")):
            half = slice(k * n_rows, (k + 1) * n_rows)
            out[f"dpo_{side}_input_ids"] = ids[half].to(device)
            out[f"dpo_{side}_attention_mask"] = attn[half].to(device)
            out[f"dpo_{side}_response_mask"] = resp[half].to(device)
            refs = [getattr(p, f"ref_{side}_logp") for p in pairs] + [0.0] * (n_rows - len(pairs))
            out[f"dpo_{side}_ref_logprobs"] = torch.tensor(refs, dtype=torch.float32, device=device)
        out["dpo_pair_mask"] = (torch.arange(n_rows, device=device) < len(pairs)).long()
        return out

    def _fill_reference_logps(self, pool: list[DPOPairTokens], ref: Any) -> None:
        """Summed response log-probs of both sides of every pair under ``ref``, cached."""
        was_training = ref.training
        ref.eval()
        try:
            fill_reference_logps(ref, pool, batch_size=_REF_BATCH)
        finally:
            ref.train(was_training)

    # ------------------------------------------------------------------ loss

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if self.model.training:  # what the kill switch measures KL to the initial policy on
            self.last_sampled = tuple(inputs[key].detach() for key in SAMPLED_KEYS)
        loss = super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        scale = 1.0 / self.current_gradient_accumulation_steps if mode == "train" else 1.0
        metrics = self._metrics[mode]
        metrics["loss/rl"].append(float(loss.detach()))
        extra = loss.new_zeros(())
        parts = []
        if self.alpha_sdpo > 0 and _has_rows(inputs, "sdpo_loss_mask"):
            parts.append(self._sdpo_terms(model, inputs))
        if self.alpha_sdpo > 0 and _has_rows(inputs, "trace_sdpo_loss_mask"):
            total, count = self._trace_sdpo_terms(model, inputs)
            metrics["loss/jsd/traces"].append(float(total.detach()) / max(count, 1))
            parts.append((total, count))
        if parts:
            count = sum(n for _, n in parts)
            sdpo = sum(t for t, _ in parts) / max(count, 1)
            metrics["loss/jsd"].append(float(sdpo.detach()))
            extra = extra + self.alpha_sdpo * sdpo
        if self.beta_replay > 0 and _has_rows(inputs, "dpo_pair_mask"):
            replay = self._compute_trace_replay_loss(model, inputs)
            metrics["loss/dpo"].append(float(replay.detach()))
            extra = extra + self.beta_replay * replay
        return loss + scale * extra

    def _compute_sdpo_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """Token-mean divergence(student || hinted teacher) over ``sdpo_loss_mask``.

        Prompts are left-padded to a common width, so completion token j sits at column
        P + j of the student context and P' + j of the teacher context. Only rows with a
        hint run (the teacher forward too).
        """
        total, count = self._sdpo_terms(model, inputs)
        return total / max(count, 1)

    def _sdpo_terms(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """``_compute_sdpo_loss``'s divergence sum and its number of tokens."""
        mask = inputs["sdpo_loss_mask"]
        rows = mask.any(dim=-1).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return mask.new_zeros((), dtype=torch.float32), 0
        completion = inputs["completion_mask"][rows]
        student_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)[rows]
        student_attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)[rows]
        teacher_ids = inputs["ctx_teacher_input_ids"][rows]
        teacher_attn = inputs["ctx_teacher_attention_mask"][rows]

        def after_prompt(values: torch.Tensor, width: int) -> torch.Tensor:
            return torch.cat(
                [values.new_zeros((values.shape[0], width - values.shape[1])), values], 1
            )

        tokens = aligned_from_masks(
            student_ids,
            after_prompt(completion, student_ids.shape[1]),
            teacher_ids,
            after_prompt(completion, teacher_ids.shape[1]),
            after_prompt(mask[rows], student_ids.shape[1]),
        )
        return self._jsd_terms(model, student_ids, student_attn, teacher_ids, teacher_attn, tokens)

    def _compute_trace_sdpo_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """Token-mean divergence on the ``data_collator``'s trace rows (``trace_*``): the
        policy on the trace's state + response (student) against the policy on the hinted
        state + the same response (teacher), as ``loss.compose_loss`` computes it."""
        total, count = self._trace_sdpo_terms(model, inputs)
        return total / max(count, 1)

    def _trace_sdpo_terms(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:
        from composer_replication.ops.compose import sdpo_tokens

        mask = inputs["trace_sdpo_loss_mask"]
        rows = mask.any(dim=-1).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return mask.new_zeros((), dtype=torch.float32), 0
        batch = {key: inputs[f"trace_{key}"][rows] for key in _TRACE_SDPO_KEYS}
        tokens = sdpo_tokens(batch)
        return self._jsd_terms(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["ctx_teacher_input_ids"],
            batch["ctx_teacher_attention_mask"],
            tokens,
        )

    def _jsd_terms(
        self,
        model: Any,
        ids: torch.Tensor,
        attention: torch.Tensor,
        teacher_ids: torch.Tensor,
        teacher_attention: torch.Tensor,
        tokens: Any,
    ) -> tuple[torch.Tensor, int]:
        """The jsd component's sum and token count over these rows, from the one loss
        assembler (the rows converted into training samples, as ``compose_loss`` does)."""
        samples = padded_samples(
            ids,
            attention,
            teacher_ids=teacher_ids,
            teacher_attention_mask=teacher_attention,
            tokens=tokens,
        )
        losses = padded_losses(
            self.accelerator.unwrap_model(model),
            samples,
            cfg=self._loss_config(),
            divergence=self._divergence(),
        )
        count = losses.counts.get("jsd", 0)
        if not count:
            return ids.new_zeros((), dtype=torch.float32), 0
        return losses.sums["jsd"], count

    def _compute_trace_replay_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """Mean pair loss over the micro-batch's pairs (chosen and rejected in one forward)."""
        rows = inputs["dpo_pair_mask"].nonzero().squeeze(-1)
        if rows.numel() == 0:
            return inputs["dpo_pair_mask"].new_zeros((), dtype=torch.float32)
        pairs = pairs_from_padded(
            *(
                tuple(
                    inputs[f"dpo_{side}_{part}"][rows]
                    for part in ("input_ids", "response_mask", "attention_mask")
                )
                for side in ("chosen", "rejected")
            ),
            ref_chosen=inputs["dpo_chosen_ref_logprobs"][rows],
            ref_rejected=inputs["dpo_rejected_ref_logprobs"][rows],
        )
        losses = padded_losses(
            self.accelerator.unwrap_model(model), [], pairs, cfg=self._loss_config()
        )
        return losses.mean("dpo", inputs["dpo_pair_mask"].new_zeros((), dtype=torch.float32))

    @staticmethod
    def _sequence_logprobs(
        model: Any,
        input_ids: torch.Tensor,
        response_mask: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B,) summed log-probs of the response tokens under ``model`` (the quantity the
        replay DPO channel compares; ``ops.pairs.sequence_logps``)."""
        return sequence_logps(model, input_ids, response_mask, attention_mask)


def _clip_pair(pair: DPOPairTokens, max_length: int) -> DPOPairTokens:
    """The pair with each side cut to its last ``max_length`` tokens (the response end)."""
    if max(len(pair.chosen_ids), len(pair.rejected_ids)) <= max_length:
        return pair
    return dataclasses.replace(
        pair,
        chosen_ids=pair.chosen_ids[-max_length:],
        chosen_mask=pair.chosen_mask[-max_length:],
        rejected_ids=pair.rejected_ids[-max_length:],
        rejected_mask=pair.rejected_mask[-max_length:],
        ref_chosen_logp=None,
        ref_rejected_logp=None,
    )


def _pair_rows(
    pairs: Sequence[DPOPairTokens], n_rows: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(2 n_rows, W) ids, attention and response masks: the chosen sides (pairs first, then
    empty rows up to n_rows), then the rejected sides in the same layout; one width W."""
    blank = n_rows - len(pairs)
    seqs, masks = [], []
    for side in ("chosen", "rejected"):
        seqs += [getattr(p, f"{side}_ids") for p in pairs] + [[pad_id]] * blank
        masks += [getattr(p, f"{side}_mask") for p in pairs] + [[0]] * blank
    ids, attn = pad_rows(seqs, pad_id)
    resp, _ = pad_rows(masks, 0)
    attn[resp.sum(-1) == 0] = 0  # the empty rows
    return ids, attn, resp


def _pair_key(pair: DPOPairTokens) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(pair.chosen_ids), tuple(pair.rejected_ids)


def _has_rows(inputs: dict[str, Any], mask_key: str) -> bool:
    return mask_key in inputs and bool(inputs[mask_key].any())


def _channel_off(reason: str) -> None:
    warnings.warn(f"{reason}: that channel stays 0", UserWarning, stacklevel=3)
