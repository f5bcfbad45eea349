"""The three-channel Composer loss, for verification and for trainers that want it whole.

``total = lm_ce + alpha_sdpo * sdpo_jsd + beta_replay * trace_replay_dpo``

1. ``lm_ce``: next-token cross-entropy on the response tokens.
2. ``sdpo_jsd``: generalized JSD (GKD, arXiv 2306.13649) between the policy on the plain
   context (student, with grad) and the same policy on the hint-augmented context (teacher,
   no grad) at the aligned response positions: self-distillation from the policy's own
   hinted context (SDPO, arXiv 2601.20802).
3. ``trace_replay_dpo``: DPO (arXiv 2305.18290) on (chosen, rejected) sequences from
   teacher-consensus replay of agent traces, with reference log-probs from the frozen
   initial model.

All three run on the hidden-state path of :mod:`composer_replication.chunked_head`, so the
(B, T, V) logits are never materialised. The input dict is documented in
:mod:`composer_replication.batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.chunked_head import (
    IGNORE_INDEX,
    jsd_from_hidden,
    last_hidden_states,
    lm_head_weight,
    token_logprobs_from_hidden,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import Tensor

_SDPO_KEYS = ("ctx_teacher_input_ids", "sdpo_loss_mask")
_DPO_KEYS = (
    "dpo_chosen_input_ids",
    "dpo_chosen_response_mask",
    "dpo_rejected_input_ids",
    "dpo_rejected_response_mask",
)


@dataclass
class LossComponents:
    """Scalar loss tensors of the three channels and their weighted total."""

    lm_ce: Tensor
    sdpo_jsd: Tensor
    trace_replay_dpo: Tensor
    total: Tensor

    def detached(self) -> dict[str, float]:
        """The four values as Python floats (no grad), for logging."""
        return {
            "lm_ce": float(self.lm_ce.detach()),
            "sdpo_jsd": float(self.sdpo_jsd.detach()),
            "trace_replay_dpo": float(self.trace_replay_dpo.detach()),
            "total": float(self.total.detach()),
        }


def compose_loss(
    model: Any,
    inputs: Mapping[str, Tensor],
    *,
    alpha_sdpo: float = 0.1,
    beta_replay: float = 0.05,
    sdpo_jsd_beta: float = 0.5,
    sdpo_temperature: float = 1.0,
    sdpo_token_clip: float | None = None,
    replay_dpo_beta: float = 0.1,
    ref_model: Any | None = None,
    teacher_model: Any | None = None,
    chunk_size: int | None = None,
) -> LossComponents:
    """Compute the three Composer channels on one batch.

    Args:
        model: the policy, a Hugging Face causal LM (PEFT-wrapped or not).
        inputs: the dict of :func:`composer_replication.batch.build_batch`. A channel whose
            keys are absent contributes an exact 0 (a tensor that requires grad).
        alpha_sdpo: weight of the SDPO JSD channel.
        beta_replay: weight of the trace-replay DPO channel.
        sdpo_jsd_beta: the JSD's mixture coefficient (0 forward KL, 1 reverse KL).
        sdpo_temperature: both distributions' softmax temperature.
        sdpo_token_clip: clamp each token's JSD to this value (None: no clamp).
        replay_dpo_beta: DPO's beta.
        ref_model: frozen initial model for the DPO reference log-probs when the batch does
            not carry ``dpo_ref_chosen_logps`` / ``dpo_ref_rejected_logps``. They are
            computed once and written into ``inputs`` (when it is a mutable dict), so a
            re-used batch never pays for them twice. With neither, a PEFT policy's adapters
            are disabled to recover the initial model; otherwise ``ValueError``.
        teacher_model: model for the SDPO teacher forward (default: ``model`` itself, under
            ``no_grad``: the live policy teaches itself through the hint).
        chunk_size: rows per chunk on the hidden-state path.

    Returns:
        :class:`LossComponents`.
    """
    for name, value in (("alpha_sdpo", alpha_sdpo), ("beta_replay", beta_replay)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    if replay_dpo_beta <= 0:
        raise ValueError(f"replay_dpo_beta={replay_dpo_beta} must be > 0")
    if "input_ids" not in inputs or "response_mask" not in inputs:
        raise ValueError(
            "inputs needs 'input_ids' and 'response_mask' (build it with "
            "composer_replication.batch.build_batch)"
        )
    input_ids = inputs["input_ids"]
    attention_mask = inputs.get("attention_mask")
    response_mask = inputs["response_mask"]
    _check_same_shape("response_mask", response_mask, input_ids)

    weight = lm_head_weight(model)
    hidden = last_hidden_states(model, input_ids, attention_mask)

    lm_ce = _response_cross_entropy(hidden, weight, input_ids, response_mask, chunk_size)

    if all(k in inputs for k in _SDPO_KEYS):
        sdpo = _sdpo_jsd(
            model if teacher_model is None else teacher_model,
            hidden,
            weight,
            inputs,
            beta=sdpo_jsd_beta,
            temperature=sdpo_temperature,
            token_clip=sdpo_token_clip,
            chunk_size=chunk_size,
        )
    else:
        sdpo = _graph_zero(hidden)

    if all(k in inputs for k in _DPO_KEYS):
        replay = _trace_replay_dpo(model, weight, inputs, ref_model, replay_dpo_beta, chunk_size)
    else:
        replay = _graph_zero(hidden)

    total = lm_ce + alpha_sdpo * sdpo + beta_replay * replay
    return LossComponents(lm_ce=lm_ce, sdpo_jsd=sdpo, trace_replay_dpo=replay, total=total)


def _graph_zero(like: Tensor) -> Tensor:
    # An exact 0 that carries grad, so `total.backward()` behaves the same whether or not
    # the channel's inputs were present.
    return torch.zeros((), dtype=torch.float32, device=like.device, requires_grad=True)


def _check_same_shape(name: str, tensor: Tensor, ref: Tensor) -> None:
    if tensor.shape != ref.shape:
        raise ValueError(f"{name} {tuple(tensor.shape)} must match {tuple(ref.shape)}")


def _next_token_targets(input_ids: Tensor, response_mask: Tensor) -> Tensor:
    """(B, T-1) targets: token t+1 where it is a response token, else IGNORE_INDEX."""
    targets = input_ids[:, 1:].clone()
    targets[response_mask[:, 1:] == 0] = IGNORE_INDEX
    return targets


def _response_cross_entropy(
    hidden: Tensor, weight: Tensor, input_ids: Tensor, response_mask: Tensor, chunk: int | None
) -> Tensor:
    targets = _next_token_targets(input_ids, response_mask)
    logprobs = token_logprobs_from_hidden(hidden[:, :-1], weight, targets, chunk_size=chunk)
    n_tokens = (targets != IGNORE_INDEX).sum().clamp_min(1)
    return -logprobs.sum() / n_tokens


def response_positions(response_mask: Tensor) -> list[Tensor]:
    """Per row, the positions (ascending) of the response tokens."""
    return [row.nonzero().squeeze(-1) for row in response_mask]


def _sdpo_jsd(
    teacher: Any,
    student_hidden: Tensor,
    weight: Tensor,
    inputs: Mapping[str, Tensor],
    *,
    beta: float,
    temperature: float,
    token_clip: float | None,
    chunk_size: int | None,
) -> Tensor:
    input_ids = inputs["input_ids"]
    response_mask = inputs["response_mask"]
    sdpo_mask = inputs["sdpo_loss_mask"]
    _check_same_shape("sdpo_loss_mask", sdpo_mask, input_ids)
    t_ids = inputs["ctx_teacher_input_ids"]
    t_attn = inputs.get("ctx_teacher_attention_mask", torch.ones_like(t_ids))
    t_resp = inputs.get("ctx_teacher_response_mask")
    if t_resp is None:
        t_resp = _right_aligned_response_mask(t_attn, response_mask)
    _check_same_shape("ctx_teacher_response_mask", t_resp, t_ids)

    # Student position p predicts token p+1; gather the hidden states that predict each
    # response token selected by sdpo_loss_mask, and the teacher's for the same tokens.
    s_rows, t_rows = [], []
    for b, (s_pos, t_pos) in enumerate(
        zip(response_positions(response_mask), response_positions(t_resp))
    ):
        if s_pos.numel() != t_pos.numel():
            raise ValueError(
                f"row {b}: {s_pos.numel()} response tokens in the student context but "
                f"{t_pos.numel()} in the teacher context; both must hold the same response"
            )
        if not torch.equal(input_ids[b, s_pos], t_ids[b, t_pos]):
            raise ValueError(
                f"row {b}: the teacher context's response tokens differ from the student's; "
                "tokenise the response once and append the same ids to both contexts"
            )
        keep = (sdpo_mask[b, s_pos] != 0) & (s_pos > 0) & (t_pos > 0)
        s_rows.append(torch.stack([torch.full_like(s_pos[keep], b), s_pos[keep] - 1]))
        t_rows.append(torch.stack([torch.full_like(t_pos[keep], b), t_pos[keep] - 1]))
    s_index = torch.cat(s_rows, dim=1)
    t_index = torch.cat(t_rows, dim=1)
    if s_index.shape[1] == 0:
        return _graph_zero(student_hidden)

    with torch.no_grad():
        teacher_hidden = last_hidden_states(teacher, t_ids, t_attn)
        teacher_weight = lm_head_weight(teacher)
    student_sel = student_hidden[s_index[0], s_index[1]]
    teacher_sel = teacher_hidden[t_index[0], t_index[1]]
    per_token = jsd_from_hidden(
        student_sel,
        weight,
        teacher_sel,
        teacher_weight=teacher_weight,
        beta=beta,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    if token_clip is not None:
        per_token = per_token.clamp(max=float(token_clip))
    return per_token.sum() / per_token.numel()


def _right_aligned_response_mask(t_attn: Tensor, response_mask: Tensor) -> Tensor:
    # Without an explicit mask, the response is the last n tokens of each teacher row.
    out = torch.zeros_like(t_attn)
    lengths = t_attn.sum(-1)
    counts = (response_mask != 0).sum(-1)
    for b in range(t_attn.shape[0]):
        end = int(lengths[b])
        out[b, end - int(counts[b]) : end] = 1
    return out


def sequence_logps(
    model: Any,
    input_ids: Tensor,
    response_mask: Tensor,
    attention_mask: Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """(B,) summed log-probs of the response tokens, on the hidden-state path."""
    weight = lm_head_weight(model)
    hidden = last_hidden_states(model, input_ids, attention_mask)
    targets = _next_token_targets(input_ids, response_mask)
    logprobs = token_logprobs_from_hidden(hidden[:, :-1], weight, targets, chunk_size=chunk_size)
    return logprobs.sum(-1)


def _trace_replay_dpo(
    model: Any,
    weight: Tensor,
    inputs: Mapping[str, Tensor],
    ref_model: Any | None,
    beta: float,
    chunk_size: int | None,
) -> Tensor:
    from composer_replication.distillation.dpo import dpo_loss

    chosen = _pair_side(inputs, "chosen")
    rejected = _pair_side(inputs, "rejected")
    ref_chosen = inputs.get("dpo_ref_chosen_logps")
    ref_rejected = inputs.get("dpo_ref_rejected_logps")
    if ref_chosen is None or ref_rejected is None:
        ref_chosen, ref_rejected = _reference_logps(model, ref_model, chosen, rejected, chunk_size)
        if isinstance(inputs, dict):  # cache: the frozen reference is computed once per batch
            inputs["dpo_ref_chosen_logps"] = ref_chosen
            inputs["dpo_ref_rejected_logps"] = ref_rejected
    policy_chosen = sequence_logps(model, *chosen, chunk_size=chunk_size)
    policy_rejected = sequence_logps(model, *rejected, chunk_size=chunk_size)
    return dpo_loss(
        policy_chosen,
        policy_rejected,
        ref_chosen.to(policy_chosen.dtype),
        ref_rejected.to(policy_chosen.dtype),
        beta=beta,
    )


def _pair_side(inputs: Mapping[str, Tensor], side: str) -> tuple[Tensor, Tensor, Tensor | None]:
    ids = inputs[f"dpo_{side}_input_ids"]
    resp = inputs[f"dpo_{side}_response_mask"]
    _check_same_shape(f"dpo_{side}_response_mask", resp, ids)
    return ids, resp, inputs.get(f"dpo_{side}_attention_mask")


def _reference_logps(
    model: Any, ref_model: Any | None, chosen: tuple, rejected: tuple, chunk_size: int | None
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        if ref_model is not None:
            return (
                sequence_logps(ref_model, *chosen, chunk_size=chunk_size),
                sequence_logps(ref_model, *rejected, chunk_size=chunk_size),
            )
        if hasattr(model, "disable_adapter"):  # PEFT: the base weights are the initial model
            with model.disable_adapter():
                return (
                    sequence_logps(model, *chosen, chunk_size=chunk_size),
                    sequence_logps(model, *rejected, chunk_size=chunk_size),
                )
    raise ValueError(
        "trace-replay DPO needs reference log-probs: put 'dpo_ref_chosen_logps' and "
        "'dpo_ref_rejected_logps' in the batch, or pass ref_model= (a frozen copy of the "
        "initial policy)"
    )
