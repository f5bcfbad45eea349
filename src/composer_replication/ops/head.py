"""Per-token log-probabilities and cross-entropy from hidden states, in token chunks.

A causal LM's last step is ``logits = hidden @ W.T`` with (B, T, V) logits: for SmolLM2 at
B=8, T=512 that is 800 MB of fp32, and the naive ``log_softmax -> gather`` path keeps
several such buffers alive for the backward pass. The functions here take the final hidden
states (..., H) and the head weight (V, H) instead, and process ``chunk_size`` rows at a
time: the forward pass keeps only per-token scalars (log-sum-exp), the backward pass
recomputes each chunk's logits and writes the gradient analytically (the fused
linear-cross-entropy idea of Liger-Kernel / Cut Cross-Entropy, arXiv 2411.09009). Peak
extra memory is O(chunk_size * V) plus the head's weight gradient.

- ``token_logprobs_from_hidden``: per-token log-probabilities of given targets (+ entropy).
- ``cross_entropy_from_hidden``: next-token CE with ignore_index, label smoothing and
  reductions.
- ``chunk_workspace`` / ``logits_into`` / ``check_head``: the chunking pieces the other
  hidden-state kernels (:mod:`.jsd`, :mod:`.divergence`) share.
- ``head_matmul_dtype`` / ``head_weight_in``: the precision of the matmuls.

Precision. Under ``torch.autocast`` (a mixed-precision run: float32 master weights, bfloat16
forwards) the matmuls run in autocast's dtype, as a plain ``hidden @ weight.T`` would: the
head weight is cast once per weight version (a small cache, :func:`head_weight_in`), not
once per chunk. What needs range or many terms stays in float32: the logits buffer and its
softmax / log-sum-exp / entropy, the hidden-gradient factor, and the sum over chunks of the
head's gradient (each chunk's product is rounded once, then added into a float32 gradient).
Without autocast the matmuls run in the weight's own dtype, exactly as before.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import Tensor

IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "add_matmul_",
    "check_head",
    "check_temperature",
    "chunk_workspace",
    "clear_head_weight_casts",
    "cross_entropy_from_hidden",
    "default_head_chunk_rows",
    "head_matmul_dtype",
    "head_weight_in",
    "logits_into",
    "token_logprobs_from_hidden",
]


# Rows per chunk on this path: the chunk's (C, V) logits come from a matmul, which needs a
# few hundred rows to run at full speed on a CPU; 2**23 elements (32 MiB of fp32) per chunk.
_HEAD_CHUNK_ELEMENTS = 1 << 23


def default_head_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk for the hidden-state path (about 32 MiB of fp32 logits)."""
    return max(16, _HEAD_CHUNK_ELEMENTS // max(vocab_size, 1))


def head_matmul_dtype(weight: Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in for ``weight`` (V, H), read from the caller's
    autocast state: autocast's dtype when it is on for the weight's device (a float64 weight
    excepted, as autocast leaves float64 alone), else the weight's own dtype."""
    device_type = weight.device.type
    if (
        weight.dtype != torch.float64
        and torch.amp.is_autocast_available(device_type)
        and torch.is_autocast_enabled(device_type)
    ):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


class _WeightCasts:
    """Copies of head weights in a matmul dtype, each valid while its weight's storage lives
    and its version counter is unchanged.

    Entries are keyed on the weight's storage and layout, not on the Python object, so the
    detached aliases the losses pass around (``weight.detach()``, which shares storage and
    version counter) find the same copy. An optimizer step (or any in-place write) bumps
    the version, so a policy's head is cast once per step, however many micro-batches,
    chunks and backward passes read it; a frozen teacher's or reference's head once per
    run. Entries die with their storage, and at most ``max_entries`` are kept (policy,
    teacher, reference, and a spare).
    """

    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        # key -> (storage weakref, version, data_ptr, cast copy)
        self._entries: dict[tuple, tuple[weakref.ref, int, int, Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, weight: Tensor, dtype: torch.dtype) -> Tensor:
        if weight.is_inference():  # no version counter to key on
            return weight.detach().to(dtype)
        storage = weight.untyped_storage()
        key = (id(storage), weight.storage_offset(), weight.shape, weight.stride(), dtype)
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None:
            ref, version, data_ptr, cast = entry
            if (
                ref() is storage
                and version == weight._version
                and data_ptr == weight.data_ptr()
                and cast.device == weight.device
            ):
                return cast
        cast = weight.detach().to(dtype)
        entries, lock = self._entries, self._lock

        def forget(dead: weakref.ref, key: tuple = key) -> None:
            with lock:
                if key in entries and entries[key][0] is dead:
                    del entries[key]

        with lock:
            entries.pop(key, None)
            while len(entries) >= self.max_entries:  # oldest first (dicts keep order)
                del entries[next(iter(entries))]
            entries[key] = (weakref.ref(storage, forget), weight._version, weight.data_ptr(), cast)
        return cast

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_WEIGHT_CASTS = _WeightCasts()


def head_weight_in(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` (V, H) in ``dtype`` for the matmuls, detached: the weight itself when it
    already is, else a cached copy made once per weight version (see :class:`_WeightCasts`).

    A write that bypasses the version counter (``weight.data.copy_(...)``) is not seen:
    call :func:`clear_head_weight_casts` after one.
    """
    if weight.dtype == dtype:
        return weight
    return _WEIGHT_CASTS.get(weight, dtype)


def clear_head_weight_casts() -> None:
    """Drop every cached low-precision head weight (frees their memory)."""
    _WEIGHT_CASTS.clear()


def logits_into(buf: Tensor, hidden_chunk: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """(C, V) logits / temperature written into ``buf`` (re-used across chunks).

    ``weight`` (V, H) is the matmul weight (:func:`head_weight_in`): the product runs in its
    dtype, and lands in ``buf``'s (float32 for low-precision weights: softmax statistics
    need the range)."""
    if weight.dtype == buf.dtype:
        torch.mm(hidden_chunk.to(weight.dtype), weight.T, out=buf)
    else:
        buf.copy_(hidden_chunk.to(weight.dtype) @ weight.T)
    if temperature != 1.0:
        buf.div_(temperature)
    return buf


def add_matmul_(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``acc += a @ b`` (a: (M, K), b: (K, N), acc: (M, N)) with the product in ``a``'s dtype
    and the sum in ``acc``'s: a chunk's bfloat16 product is rounded once and then summed
    over chunks in the float32 accumulator, not in bfloat16."""
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    return acc.add_(a @ b)


def chunk_workspace(n_rows: int, chunk: int, weight: Tensor) -> Tensor:
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return torch.empty(
        min(chunk, max(n_rows, 1)), weight.shape[0], dtype=dtype, device=weight.device
    )


def _softmax_(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Turn a chunk's logits (C, V) into its softmax in place.

    Returns ``(log p(target) (C,), log-sum-exp (C,))``, read before the buffer is overwritten.
    """
    target_logit = z.gather(1, targets[:, None]).squeeze(1)
    row_max = z.amax(dim=1, keepdim=True)
    z.sub_(row_max).exp_()
    denom = z.sum(dim=1, keepdim=True)
    lse = (row_max + denom.log()).squeeze(1)
    z.div_(denom)
    return target_logit - lse, lse


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(target) (M,) and entropy (M,) from hidden rows (M, H) and head weight (V, H).

    With g the upstream gradient and p the softmax, d lp_i / d z_i = (e_t - p_i) / T, so
    d/dh_i = g_i / T * (W[t_i] - p_i @ W): the (M, H) factor ``W[t] - P @ W`` is formed in
    the forward pass while the chunk's probabilities are at hand, and the backward pass for
    the hidden states is a row scaling. Only the head's own gradient (sum over rows of
    outer products weighted by g) needs the probabilities again: they are recomputed.

    ``matmul_dtype`` is the dtype of the three matmuls (:func:`head_matmul_dtype`, chosen by
    the caller: the backward pass may run where autocast is off); the weight is cast to it
    once (:func:`head_weight_in`), the softmax and the gradient sums stay float32.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        matmul_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        need_h = ctx.needs_input_grad[0]
        n_rows = hidden.shape[0]
        mm_weight = head_weight_in(weight, matmul_dtype)
        buf = chunk_workspace(n_rows, chunk, weight)
        logprobs = torch.empty(n_rows, dtype=buf.dtype, device=hidden.device)
        entropy = torch.zeros(n_rows, dtype=buf.dtype, device=hidden.device)
        lse = torch.empty(n_rows, dtype=buf.dtype, device=hidden.device)
        hidden_factor = torch.empty_like(hidden) if need_h else None
        for start in range(0, n_rows, chunk):
            stop = min(start + chunk, n_rows)
            z = logits_into(buf[: stop - start], hidden[start:stop], mm_weight, temperature)
            logprobs[start:stop], lse[start:stop] = _softmax_(z, targets[start:stop])
            probs = z
            if with_entropy:
                entropy[start:stop] = torch.special.entr(probs).sum(dim=1)
            if need_h:
                # W[t] from the master weight: the difference is taken in its precision
                factor = weight.index_select(0, targets[start:stop]) - (
                    probs.to(mm_weight.dtype) @ mm_weight
                )
                hidden_factor[start:stop] = factor
        ctx.save_for_backward(hidden, weight, mm_weight, targets, lse, hidden_factor)
        ctx.settings = (temperature, chunk)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, _grad_entropy: Tensor):  # type: ignore[override]
        hidden, weight, mm_weight, targets, lse, hidden_factor = ctx.saved_tensors
        temperature, chunk = ctx.settings
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scaled = grad_logprobs / temperature
        grad_h = hidden_factor * scaled[:, None].to(hidden_factor.dtype) if need_h else None
        grad_w = None
        if need_w:
            grad_w = torch.zeros_like(weight)
            buf = chunk_workspace(hidden.shape[0], chunk, weight)
            for start in range(0, hidden.shape[0], chunk):
                stop = min(start + chunk, hidden.shape[0])
                h = hidden[start:stop].to(mm_weight.dtype)
                g = scaled[start:stop].to(buf.dtype)
                # G = g * (onehot(target) - softmax(z)), built in the workspace.
                grad_logits = logits_into(buf[: stop - start], h, mm_weight, temperature)
                grad_logits.sub_(lse[start:stop, None]).exp_().mul_(-g[:, None])
                rows = torch.arange(stop - start, device=h.device)
                grad_logits[rows, targets[start:stop]] += g
                add_matmul_(grad_w, grad_logits.T.to(mm_weight.dtype), h)
        return grad_h, grad_w, None, None, None, None, None


class _FusedCrossEntropySum(torch.autograd.Function):
    """Summed next-token CE from hidden rows, gradients formed during the forward pass.

    With label smoothing ``eps`` the per-token loss is
    ``(1 - eps) * -log p(target) + eps * mean_v -log p(v)`` (torch's ``cross_entropy``
    convention, Szegedy et al., arXiv 1512.00567). It is linear in the log-probs, so its
    gradient w.r.t. each chunk's logits, ``(softmax(z) - (1 - eps) onehot - eps / V) / T``,
    is known in the forward pass: the hidden and head gradients are accumulated there
    (3 matmuls in all, as the naive path) and the backward pass scales them by the upstream
    scalar. ``matmul_dtype``: as in :class:`_ChunkedTokenLogprobs`.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        chunk: int,
        label_smoothing: float,
        matmul_dtype: torch.dtype,
    ) -> Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_rows = hidden.shape[0]
        mm_weight = head_weight_in(weight, matmul_dtype)
        buf = chunk_workspace(n_rows, chunk, weight)
        total = torch.zeros((), dtype=buf.dtype, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for start in range(0, n_rows, chunk):
            stop = min(start + chunk, n_rows)
            h = hidden[start:stop].to(mm_weight.dtype)
            z = logits_into(buf[: stop - start], h, mm_weight, temperature)
            logit_sum = z.sum(dim=1) if label_smoothing else None
            target_logprobs, lse = _softmax_(z, targets[start:stop])
            total -= (1.0 - label_smoothing) * target_logprobs.sum()
            if label_smoothing:  # mean_v log p(v) = mean_v z_v - lse
                total -= label_smoothing * (logit_sum / z.shape[1] - lse).sum()
            if need_h or need_w:
                grad_logits = z  # softmax
                rows = torch.arange(stop - start, device=hidden.device)
                grad_logits[rows, targets[start:stop]] -= 1.0 - label_smoothing
                if label_smoothing:
                    grad_logits.sub_(label_smoothing / z.shape[1])
                if temperature != 1.0:
                    grad_logits.div_(temperature)
                grad_logits = grad_logits.to(mm_weight.dtype)
                if need_h:
                    if grad_h.dtype == mm_weight.dtype:
                        torch.mm(grad_logits, mm_weight, out=grad_h[start:stop])
                    else:
                        grad_h[start:stop] = grad_logits @ mm_weight
                if need_w:
                    add_matmul_(grad_w, grad_logits.T, h)
        ctx.grads = (grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):  # type: ignore[override]
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        if grad_h is None and grad_w is None:
            raise RuntimeError("backward through a fused cross-entropy that ran without grad")
        scale = grad_total.to(grad_h.dtype if grad_h is not None else grad_w.dtype)
        grad_h = grad_h.mul_(scale) if grad_h is not None else None
        grad_w = grad_w.mul_(scale) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


def check_head(hidden: Tensor, weight: Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"lm head weight must be (V, H), got {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size {hidden.shape[-1]} does not match the head weight {tuple(weight.shape)}"
        )


def check_temperature(temperature: float) -> None:
    if not float(temperature) > 0.0:
        raise ValueError(f"temperature={temperature} must be > 0")


def _select_rows(
    hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Flattened (M, H) hidden rows and (M,) targets that are not ignored, + their indices.

    Validates shapes and token-id range; ``rows`` is None when nothing is ignored.
    """
    flat_hidden, flat_targets = _flat_checked(hidden, weight, targets)
    keep = flat_targets != ignore_index
    rows = None if bool(keep.all()) else keep.nonzero().squeeze(-1)
    sel_hidden = flat_hidden if rows is None else flat_hidden.index_select(0, rows)
    sel_targets = flat_targets if rows is None else flat_targets.index_select(0, rows)
    if sel_targets.numel() and (
        int(sel_targets.min()) < 0 or int(sel_targets.max()) >= weight.shape[0]
    ):
        raise ValueError(
            f"targets must be token ids in [0, {weight.shape[0]}) or {ignore_index}, got values "
            f"in [{int(sel_targets.min())}, {int(sel_targets.max())}]"
        )
    return sel_hidden, sel_targets, rows


def _take_rows(
    hidden: Tensor, weight: Tensor, targets: Tensor, rows: Tensor
) -> tuple[Tensor, Tensor]:
    """Flattened hidden rows and targets at ``rows`` (flat indices the caller found on the
    host): shapes are checked, target values are not (reading them would stop a GPU)."""
    flat_hidden, flat_targets = _flat_checked(hidden, weight, targets)
    return flat_hidden.index_select(0, rows), flat_targets.index_select(0, rows)


def _flat_checked(hidden: Tensor, weight: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(M, H) hidden rows and (M,) targets, flattened after checking their shapes."""
    check_head(hidden, weight)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} must match hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)


def token_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
    rows: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of ``targets`` under ``softmax(hidden @ weight.T / temperature)``.

    Args:
        hidden: (..., H) final hidden states (after the last norm).
        weight: (V, H) LM-head weight.
        targets: (...) token ids; positions equal to ``ignore_index`` give 0 and no gradient.
        temperature: logits are divided by it (the sampling temperature for RL ratios).
        chunk_size: rows per chunk (default: about 32 MiB of fp32 logits per chunk).
        return_entropy: also return the per-token entropy (nats, detached).
        rows: (M,) flat indices of the positions whose target is not ``ignore_index``, in
            increasing order, when the caller knows them from host data (packed
            micro-batches do): the head then reads nothing back from the device (finding
            them, and checking the token-id range, would). The caller vouches for the ids.

    Returns:
        (...) log-probs, and (...) entropies when ``return_entropy``: float32 (float64 for a
        float64 weight). Under ``torch.autocast`` the matmuls run in autocast's dtype (the
        weight cast once per version, :func:`head_weight_in`), the softmax in float32.
    """
    check_temperature(temperature)
    if rows is None:
        sel_hidden, sel_targets, rows = _select_rows(hidden, weight, targets, ignore_index)
    else:
        sel_hidden, sel_targets = _take_rows(hidden, weight, targets, rows)
    all_kept = rows is None
    flat_targets = targets.reshape(-1)
    chunk = chunk_size or default_head_chunk_rows(weight.shape[0])
    lp, ent = _ChunkedTokenLogprobs.apply(
        sel_hidden,
        weight,
        sel_targets,
        float(temperature),
        int(chunk),
        bool(return_entropy),
        head_matmul_dtype(weight),
    )
    if not all_kept:
        lp = lp.new_zeros(flat_targets.shape).index_put((rows,), lp)
        ent = ent.new_zeros(flat_targets.shape).index_put((rows,), ent)
    lp = lp.reshape(targets.shape)
    if return_entropy:
        return lp, ent.reshape(targets.shape)
    return lp


def cross_entropy_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    temperature: float = 1.0,
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross-entropy of ``targets`` (already shifted) from hidden states.

    ``reduction``: ``mean`` over non-ignored tokens (0 with grad when there are none),
    ``sum``, or ``none`` -> per-token (...) with 0 at ignored positions.
    ``label_smoothing`` in [0, 1): torch's ``cross_entropy`` convention (``mean``/``sum``).
    Precision as :func:`token_logprobs_from_hidden`.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of ('mean', 'sum', 'none')")
    check_temperature(temperature)
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if reduction == "none" and label_smoothing:
        raise ValueError(
            "label_smoothing needs reduction='mean' or 'sum' (per-token smoothed CE is not "
            "offered); use token_logprobs_from_hidden for per-token values"
        )
    if reduction == "none":
        logprobs = token_logprobs_from_hidden(
            hidden,
            weight,
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            ignore_index=ignore_index,
        )
        return -logprobs
    sel_hidden, sel_targets, _ = _select_rows(hidden, weight, targets, ignore_index)
    chunk = chunk_size or default_head_chunk_rows(weight.shape[0])
    total = _FusedCrossEntropySum.apply(
        sel_hidden,
        weight,
        sel_targets,
        float(temperature),
        int(chunk),
        float(label_smoothing),
        head_matmul_dtype(weight),
    )
    if reduction == "sum":
        return total
    return total / max(sel_targets.numel(), 1)
