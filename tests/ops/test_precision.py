"""The hidden-state head, JSD and pair ops under bfloat16 autocast, and without it.

Under ``torch.autocast`` the head's matmuls run in bfloat16 (checked on the dispatched
``mm`` calls), the head weight is cast once per weight version, and the results stay close
to the float32 path. Without autocast the float32 path is bit-identical to a plain float32
implementation of the same chunked log-softmax.

Tolerances (bfloat16 keeps 8 significant bits: unit roundoff u = 2**-9):

- log-probs (and sums of them: CE, pair log-probs): a first-order bound computed from the
  data. Rounding h and W to bfloat16 (u each) and the product once (u) moves each logit
  z_v = h . W_v by at most ``3u * sum_k |h_k| |W_vk|`` (the float32 accumulation adds a
  negligible ~H * 2**-24); a log-prob ``z_t - logsumexp(z)`` moves by at most twice the
  largest logit move.
- entropy and the head / CE gradients: ``max |bf16 - fp32| <= 2e-2 * max |fp32|``, about
  10u of the largest entry: each entry is a sum of products of rounded operands (error ~3u
  relative to the sum of magnitudes), and entries near the maximum may lose a few bits to
  cancellation (measured: at most 0.8%).
- JSD values and gradients: ``5e-2 * max |fp32|`` (about 25u). They are differences between
  the student's and the teacher's distributions (``p_s - p_t`` at beta 0): each probability
  carries its logits' error, and the difference cancels much of the magnitude, more the
  closer the two distributions (measured here: at most 2.9%).

Every relative check also requires a non-zero difference, so a path that silently stayed in
float32 fails.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from composer_replication.ops.head import (
    clear_head_weight_casts,
    cross_entropy_from_hidden,
    head_matmul_dtype,
    head_weight_in,
    token_logprobs_from_hidden,
)
from composer_replication.ops.jsd import jsd_from_hidden

U_BF16 = 2.0**-9
REL_TOL = 2e-2
JSD_REL_TOL = 5e-2
BF16 = torch.bfloat16


class MatmulLog(TorchDispatchMode):
    """Records the operand dtypes of every ``mm`` / ``addmm`` dispatched, and every
    ``_to_copy`` whose source shares storage with ``watched`` (a cast of that tensor)."""

    def __init__(self, watched: torch.Tensor | None = None) -> None:
        super().__init__()
        self.watched = watched
        self.mm_dtypes: set[tuple[torch.dtype, ...]] = set()
        self.casts: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.mm_dtypes.add(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        if (
            func.overloadpacket is torch.ops.aten._to_copy
            and self.watched is not None
            and args[0].data_ptr() == self.watched.data_ptr()
            and args[0].shape == self.watched.shape
        ):
            self.casts.append(kwargs.get("dtype"))
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _fresh_casts():
    clear_head_weight_casts()
    yield
    clear_head_weight_casts()


def _inputs(seed: int = 0, b: int = 3, t: int = 37, h: int = 64, v: int = 1000):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen).requires_grad_()
    weight = (0.2 * torch.randn(v, h, generator=gen)).requires_grad_()
    teacher_hidden = hidden.detach() + 0.3 * torch.randn(b, t, h, generator=gen)
    targets = torch.randint(0, v, (b, t), generator=gen)
    targets[0, :5] = -100
    upstream = torch.randn(b, t, generator=gen)
    return hidden, weight, teacher_hidden, targets, upstream


def _logit_move_bound(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(...) largest bf16 logit move per row: 3u * max_v sum_k |h_k| |W_vk| (module doc)."""
    return 3 * U_BF16 * (hidden.detach().abs() @ weight.detach().abs().T).amax(-1)


def _assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, rel_tol: float = REL_TOL) -> None:
    assert ours.dtype == ref.dtype == torch.float32
    err = (ours - ref).abs().max()
    assert 0 < err <= rel_tol * ref.abs().max(), (float(err), float(ref.abs().max()))


def test_matmul_dtype_follows_autocast():
    weight = torch.zeros(4, 3)
    assert head_matmul_dtype(weight) == torch.float32
    with torch.autocast("cpu", dtype=BF16):
        assert head_matmul_dtype(weight) == BF16
        assert head_matmul_dtype(weight.double()) == torch.float64  # autocast skips float64
        assert head_matmul_dtype(weight.to(BF16)) == BF16
    with torch.autocast("cpu", dtype=BF16, enabled=False):
        assert head_matmul_dtype(weight) == torch.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_entropy_and_gradients_under_bf16_autocast(temperature):
    hidden, weight, _, targets, upstream = _inputs()

    def run():
        lp, ent = token_logprobs_from_hidden(
            hidden, weight, targets, temperature=temperature, chunk_size=16, return_entropy=True
        )
        return (lp, ent, *torch.autograd.grad((lp * upstream).sum(), (hidden, weight)))

    ref = run()
    with MatmulLog() as log, torch.autocast("cpu", dtype=BF16):
        low = run()
    assert log.mm_dtypes == {(BF16, BF16)}  # logits, hidden factor and head gradient
    kept = targets != -100
    bound = 2 * _logit_move_bound(hidden, weight) / temperature
    assert low[0].dtype == torch.float32
    assert torch.all((low[0] - ref[0]).abs() <= bound * kept)
    assert torch.all(low[0][~kept] == 0)
    for ours, want in zip(low[1:], ref[1:]):
        _assert_close_rel(ours, want)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_and_gradients_under_bf16_autocast(label_smoothing):
    hidden, weight, _, targets, _ = _inputs(seed=1)

    def run():
        ce = cross_entropy_from_hidden(
            hidden, weight, targets, chunk_size=16, label_smoothing=label_smoothing
        )
        return (ce, *torch.autograd.grad(3.0 * ce, (hidden, weight)))

    ref = run()
    with MatmulLog() as log, torch.autocast("cpu", dtype=BF16):
        low = run()
    assert log.mm_dtypes == {(BF16, BF16)}
    kept = targets != -100
    # CE is a mean of -log p (smoothing mixes in log p of other tokens: same bound)
    bound = (2 * _logit_move_bound(hidden, weight))[kept].mean()
    assert low[0].dtype == torch.float32 and 0 < (low[0] - ref[0]).abs() <= bound
    for ours, want in zip(low[1:], ref[1:]):
        _assert_close_rel(ours, want)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_values_and_gradients_under_bf16_autocast(beta):
    hidden, weight, teacher_hidden, targets, upstream = _inputs(seed=2)
    mask = targets != -100

    def run():
        jsd = jsd_from_hidden(
            hidden, weight, teacher_hidden, mask=mask, beta=beta, temperature=0.9, chunk_size=16
        )
        return (jsd, *torch.autograd.grad((jsd * upstream).sum(), (hidden, weight)))

    ref = run()
    with MatmulLog() as log, torch.autocast("cpu", dtype=BF16):
        low = run()
    assert log.mm_dtypes == {(BF16, BF16)}
    for ours, want in zip(low, ref):
        _assert_close_rel(ours, want, JSD_REL_TOL)


def test_pair_logprobs_under_bf16_autocast():
    """A model with no decoder layers (embedding, final norm, tied head): the head's matmul
    is the only one, so the bound on the summed log-probs is the head's alone."""
    from composer_replication.model.loading import tiny_model
    from composer_replication.model.parts import last_hidden_states, lm_head_weight
    from composer_replication.ops.pairs import pair_logps
    from composer_replication.samples.wire import DPOPairTokens, pair_rows

    model = tiny_model(seed=3, num_hidden_layers=0, vocab_size=512)
    gen = torch.Generator().manual_seed(4)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 512, (n,), generator=gen).tolist()

    pairs = [
        DPOPairTokens(ids(12), [0] * 5 + [1] * 7, ids(9), [0] * 5 + [1] * 4),
        DPOPairTokens(ids(15), [0] * 4 + [1] * 11, ids(15), [0] * 4 + [1] * 11),
    ]
    weight = lm_head_weight(model)
    ref = pair_logps(model, pairs)
    with MatmulLog(weight) as log, torch.autocast("cpu", dtype=BF16):
        low = pair_logps(model, pairs)
        low_again = pair_logps(model, pairs)  # reads the cached bf16 head
    assert (BF16, BF16) in log.mm_dtypes and log.casts == [BF16]
    torch.testing.assert_close(low_again[0], low[0], rtol=0, atol=0)

    rows = pair_rows(pairs)
    with torch.no_grad():
        hidden = last_hidden_states(model, rows.input_ids, rows.attention_mask)[:, :-1]
    per_token = 2 * _logit_move_bound(hidden, weight) * rows.response_mask[:, 1:]
    bound = per_token.sum(-1)
    k = len(pairs)
    for side, ours, want in ((0, low[0], ref[0]), (1, low[1], ref[1])):
        assert ours.dtype == torch.float32
        slack = bound[side * k : (side + 1) * k]
        assert torch.all((ours - want).abs() <= slack), (ours - want, slack)
        assert torch.any(ours != want)
    assert torch.equal(low[2], ref[2]) and torch.equal(low[3], ref[3])  # counts


def test_head_weight_is_cast_once_per_step():
    """Two micro-batches of log-probs + CE + JSD (the live policy as its own teacher, passed
    as a detached alias, as the divergence path does), forward and backward: one cast. An
    optimizer step bumps the weight's version: one more cast on the next step."""
    hidden, weight, teacher_hidden, targets, upstream = _inputs(seed=5, t=20)
    weight = torch.nn.Parameter(weight.detach())
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def micro_batch() -> None:
        lp = token_logprobs_from_hidden(hidden, weight, targets, chunk_size=8)
        ce = cross_entropy_from_hidden(hidden, weight, targets, chunk_size=8)
        jsd = jsd_from_hidden(
            hidden, weight, teacher_hidden, teacher_weight=weight.detach(), chunk_size=8
        )
        ((lp * upstream).sum() + ce + jsd.sum()).backward()

    with MatmulLog(weight) as log, torch.autocast("cpu", dtype=BF16):
        micro_batch()
        micro_batch()
        assert log.casts == [BF16]
        optimizer.step()
        optimizer.zero_grad()
        micro_batch()
        micro_batch()
    assert log.casts == [BF16, BF16]
    assert weight.grad is not None and weight.grad.dtype == torch.float32


def test_a_frozen_teachers_head_is_cast_once_across_steps():
    hidden, weight, teacher_hidden, _, _ = _inputs(seed=6, t=10)
    frozen = (weight.detach() + 0.01).requires_grad_(False)
    with MatmulLog(frozen) as log, torch.autocast("cpu", dtype=BF16):
        for _ in range(3):
            jsd_from_hidden(hidden, weight, teacher_hidden, teacher_weight=frozen).sum().backward()
    assert log.casts == [BF16]


def test_the_cached_cast_follows_in_place_writes_and_new_dtypes():
    weight = torch.randn(6, 4)
    first = head_weight_in(weight, BF16)
    assert head_weight_in(weight, BF16) is first and head_weight_in(weight.detach(), BF16) is first
    assert head_weight_in(weight, torch.float32) is weight  # no cast needed
    assert head_weight_in(weight, torch.float16).dtype == torch.float16
    weight.mul_(2.0)
    second = head_weight_in(weight, BF16)
    assert second is not first and torch.equal(second, weight.to(BF16))


# ---------------------------------------------------------------------------------------
# Without autocast: bit-identical to a plain float32 implementation of the same chunking.
# ---------------------------------------------------------------------------------------


def _plain_float32_head(hidden, weight, targets, upstream, chunk, temperature):
    """Log-probs, entropy and both gradients of ``sum(upstream * log p(target))`` with plain
    float32 ops, chunk by chunk: logits ``h @ W.T / T``, the max-shifted log-sum-exp, and
    the analytic gradients ``(g / T) (W[t] - p @ W)`` and ``sum_i (g_i / T) (e_t - p_i) h_i``."""
    lps, ents, grad_h = [], [], []
    grad_w = torch.zeros_like(weight)
    scaled = upstream / temperature
    for start in range(0, hidden.shape[0], chunk):
        h, t, g = (x[start : start + chunk] for x in (hidden, targets, scaled))
        z = h @ weight.T
        if temperature != 1.0:
            z = z / temperature
        row_max = z.amax(dim=1, keepdim=True)
        e = (z - row_max).exp()
        denom = e.sum(dim=1, keepdim=True)
        lse = (row_max + denom.log()).squeeze(1)
        p = e / denom
        lps.append(z.gather(1, t[:, None]).squeeze(1) - lse)
        ents.append(torch.special.entr(p).sum(dim=1))
        grad_h.append((weight.index_select(0, t) - p @ weight) * g[:, None])
        grad_logits = (z - lse[:, None]).exp() * -g[:, None]
        rows = torch.arange(h.shape[0])
        grad_logits[rows, t] += g
        grad_w.addmm_(grad_logits.T, h)
    return torch.cat(lps), torch.cat(ents), torch.cat(grad_h), grad_w


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [8, 16, 1000])
def test_float32_without_autocast_is_bit_identical_to_plain_float32(temperature, chunk):
    hidden, weight, _, targets, upstream = _inputs(seed=7, t=40)
    targets = targets.clamp_min(0)  # every row kept: the head sees the rows as given
    with MatmulLog() as log:
        lp, ent = token_logprobs_from_hidden(
            hidden, weight, targets, temperature=temperature, chunk_size=chunk, return_entropy=True
        )
        grad_h, grad_w = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))
    assert all(set(d) == {torch.float32} for d in log.mm_dtypes)
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    ref = _plain_float32_head(
        flat, weight.detach(), targets.reshape(-1), upstream.reshape(-1), chunk, temperature
    )
    assert torch.equal(lp.reshape(-1), ref[0])
    assert torch.equal(ent.reshape(-1), ref[1])
    assert torch.equal(grad_h.reshape(flat.shape), ref[2])
    assert torch.equal(grad_w, ref[3])
    # and the plain implementation is the textbook log-softmax
    textbook = torch.log_softmax(flat @ weight.detach().T / temperature, dim=-1)
    torch.testing.assert_close(ref[0], textbook.gather(1, targets.reshape(-1, 1)).squeeze(1))
