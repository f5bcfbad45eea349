"""The in-process decode loop: prefill once per distinct prompt, then decode with drafts.

What it does that a general-purpose ``generate`` does not, and why it pays on a CPU:

- distinct prompts are prefilled once (in length-sorted chunks) and every row's cache
  starts from its prompt's state (a group samples ``group_size`` completions of one
  prompt; inside ``reuse_prompt_states`` the states serve later calls too);
- only the positions whose logits are used are projected on the vocabulary;
- a row that has finished (EOS, stop string) leaves the batch at once, so the steps after
  it run on fewer rows and the loop ends when the last row finishes; with ``max_rows``,
  waiting prompts take the freed places (continuous batching: the cache is re-laid out with
  the live rows and the joining prompts' states, :func:`~.kv_cache.relayout`);
- no per-call set-up: stop strings are matched on the decoded text of each row's new
  tokens, not through a vocabulary-wide table built per call;
- prompt-lookup drafts (arXiv 2304.04487): a small batch is bound by reading the weights,
  not by arithmetic, so one forward can check several tokens for the price of about one.
  Each row proposes the tokens that followed the latest earlier occurrence of its last
  :data:`NGRAM` tokens in its own prompt and completion (answers copy signatures and
  docstrings), and the forward computes the distributions at all of them at once. How
  many drafted positions a forward checks is chosen for the expected tokens per unit of
  time (:func:`draft_positions`): only where drafts are kept often enough to pay.

The distribution is unchanged, and so are the samples. Each position's token is drawn from
``softmax(logits / temperature)`` exactly as without drafts (float32 log-probs, inverse-CDF
draw in float64 with one uniform per emitted token, from the global RNG or from the row's
own generator: :func:`sample_categorical`; ``temperature = 0``: argmax), and a row keeps
drafted positions only while the drawn token equals the drafted one: the first mismatch is
emitted and the rest discarded. A draft therefore decides how many tokens one forward
yields, never which tokens: with the same random numbers the completion is the one plain
decoding would sample (up to the rounding of a wider matrix product). This "sample, then
match" check accepts a drafted token with probability p(token), as speculative sampling
(arXiv 2211.17192) does for a deterministic draft. The log-prob recorded for a token is
``log_softmax(logits / temperature)`` at that token (at temperature 1 for greedy), which is
what the trainer's importance ratio compares against.

Rejected drafted positions stay in the KV cache, masked out of attention (the cache is
compacted when it fills up). Left padding, explicit position ids and the attention mask
keep every row's computation that of its own prompt and accepted tokens.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_replication.common.compat import cache_kwargs
from composer_replication.inference.decoding.kv_cache import (
    PromptStates,
    cache_capacity,
    can_relayout,
    compact_rows,
    finished_row_state,
    new_cache,
    relayout,
)
from composer_replication.inference.decoding.kv_cache import prompt_states as _prompt_states

__all__ = [
    "DecodeStats",
    "DecodedRow",
    "PromptLookup",
    "StopMatcher",
    "decode_rows",
    "draft_positions",
    "forward_cost",
    "sample_categorical",
]

#: The n-gram a row looks up in its own context to draft the tokens that followed it.
NGRAM = 3
#: Most tokens drafted for one row in one forward.
MAX_DRAFT = 7
#: Default upper bound on the tokens one decode forward computes over all live rows.
DRAFT_TOKEN_BUDGET = 32
#: Relative time of a decode forward by the tokens it computes (rows x positions), measured
#: on this project's reference CPU (2 cores, SmolLM2-135M, float32): a forward is bound by
#: reading the weights up to about 8 tokens, then by arithmetic. Interpolated linearly,
#: extrapolated along the last segment.
FORWARD_COST = ((1, 1.0), (8, 1.1), (16, 1.8), (32, 2.2), (64, 3.8), (128, 7.6))
#: A row's draft acceptance before its first check (then an average over its checks).
INITIAL_ACCEPTANCE = 0.6
#: With ``max_rows``, waiting rows join once this share of the rows has finished (each
#: joining re-lays the cache out, so rows join in groups).
REFILL_FRACTION = 0.25


@dataclass(frozen=True)
class DecodedRow:
    """One row's sampled tokens, their log-probs, and why it stopped (eos|stop|length)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class DecodeStats:
    """Counters of one :func:`decode_rows` call: decode forwards after the prefill, prompt
    tokens prefilled (prompts found in :class:`PromptStates` are not), tokens drafted,
    drafted tokens kept, and cache compactions."""

    forwards: int = 0
    prefilled: int = 0
    drafted: int = 0
    accepted: int = 0
    compactions: int = 0


class StopMatcher:
    """Per row: the decoded text of the new tokens, checked for any stop string after each
    token (both decode loops). A token's piece is decoded once and cached by its id."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.longest = max((len(s) for s in self.stop_strings), default=0)
        self.pieces: dict[int, str] = {}

    def hit(self, text: str, token: int) -> tuple[str, bool]:
        """``text`` extended by ``token``'s piece, and whether a stop string now ends in it."""
        piece = self.pieces.get(token)
        if piece is None:
            piece = self.pieces[token] = self.tokenizer.decode([token])
        text += piece
        # only a match that includes the new piece can be new
        window = text[-(self.longest + len(piece)) :]
        return text, any(s in window for s in self.stop_strings)


class PromptLookup:
    """Drafts for one row: what followed the latest earlier occurrence of its last ``n``
    tokens in its own context (prompt + completion so far).

    The index maps each n-gram whose continuation is known to where that continuation
    starts, so a lookup and an append cost O(n).
    """

    def __init__(self, context: Sequence[int], n: int = NGRAM) -> None:
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        self.n = n
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1  # the n-gram before the new token now has a continuation
            if end >= self.n:
                self._index[tuple(self.tokens[end - self.n : end])] = end

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the context's last n-gram before ([] if none)."""
        if k <= 0 or len(self.tokens) < self.n:
            return []
        start = self._index.get(tuple(self.tokens[-self.n :]))
        return [] if start is None else self.tokens[start : start + k]


def sample_categorical(
    log_probs: torch.Tensor, generators: Sequence[torch.Generator] | None = None
) -> torch.Tensor:
    """One index per row drawn from ``softmax(log_probs)`` by inverting its CDF.

    Exact categorical sampling with one uniform number per row from the global RNG, or from
    each row's own host generator in ``generators`` (the vocabulary-wide exponential draw of
    ``torch.multinomial`` costs several milliseconds a step on a CPU). The CDF is
    accumulated in float64; a zero-probability token is never drawn.
    """
    return _invert_cdf(log_probs.double().exp().cumsum(-1), _uniforms(log_probs, generators))


def _uniforms(like: torch.Tensor, generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """(rows, 1) float64 uniforms on ``like``'s device: global RNG, or one per generator."""
    if generators is None:
        return torch.rand((like.shape[0], 1), dtype=torch.float64, device=like.device)
    if len(generators) != like.shape[0]:
        raise ValueError(f"{len(generators)} generators for {like.shape[0]} rows")
    draws = [torch.rand(1, dtype=torch.float64, generator=g, device="cpu") for g in generators]
    return torch.stack(draws).to(like.device)


def _invert_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return index.clamp_max(cdf.shape[-1] - 1)


def _draw_along_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    *,
    temperature: float,
    generators: Sequence[torch.Generator] | None,
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Tokens drawn at each row's positions, in order, until a draw leaves the row's draft.

    ``logits``: (rows, q, vocab) float32; position j of a row predicts the token after its
    j-th input (its pending token, then its drafted tokens). Returns per row the drawn
    tokens and their log-probs, up to and including the first draw that differs from the
    draft (or the one after the whole draft), and how many drafted tokens each row keeps.
    A row draws one uniform per returned token, in order (none for greedy).
    """
    greedy = temperature == 0
    log_probs = torch.log_softmax(logits / (1.0 if greedy else temperature), dim=-1)
    rows, q = logits.shape[:2]
    if greedy:
        picked = logits.argmax(-1)
    else:
        picked = torch.zeros((rows, q), dtype=torch.long, device=logits.device)
        cdf = log_probs.double().exp().cumsum(-1)
    accepted = [0] * rows
    live = list(range(rows))  # rows whose draws matched their draft before position j
    for j in range(q):
        if not greedy:
            index = torch.as_tensor(live, dtype=torch.long, device=logits.device)
            row_generators = None if generators is None else [generators[r] for r in live]
            at_j = cdf[index, j]
            picked[index, j] = _invert_cdf(at_j, _uniforms(at_j, row_generators))
        if j == q - 1:
            break
        column = picked[:, j].tolist()
        live = [r for r in live if j < len(drafts[r]) and drafts[r][j] == column[r]]
        if not live:
            break
        for r in live:
            accepted[r] += 1
    picked_lp = log_probs.gather(-1, picked[:, :, None]).squeeze(-1)
    tokens, token_lps = picked.tolist(), picked_lp.tolist()
    return (
        [tokens[r][: accepted[r] + 1] for r in range(rows)],
        [token_lps[r][: accepted[r] + 1] for r in range(rows)],
        accepted,
    )


def forward_cost(tokens: int) -> float:
    """:data:`FORWARD_COST` at ``tokens`` (relative time of a forward computing them)."""
    points = FORWARD_COST
    for (n0, c0), (n1, c1) in itertools.pairwise(points):
        if tokens <= n1:
            return c0 + (c1 - c0) * (max(tokens, n0) - n0) / (n1 - n0)
    (n0, c0), (n1, c1) = points[-2], points[-1]
    return c1 + (c1 - c0) * (tokens - n1) / (n1 - n0)


def draft_positions(drafts: Sequence[Sequence[int]], acceptance: Sequence[float]) -> int:
    """Positions per row of the next forward (1 + drafted tokens kept in it): the number
    that maximises the expected tokens per unit of time, :func:`forward_cost`.

    A row with draft d and acceptance a yields ``1 + a + ... + a^k`` tokens in expectation
    when k of its drafted tokens are checked (each is kept only after the ones before it).
    """
    rows = len(drafts)
    longest = max((len(d) for d in drafts), default=0)
    best_q, best_rate = 1, rows / forward_cost(rows)
    for q in range(2, longest + 2):
        expected = sum(
            sum(a**j for j in range(min(q - 1, len(d)) + 1)) for d, a in zip(drafts, acceptance)
        )
        rate = expected / forward_cost(rows * q)
        if rate > best_rate:
            best_q, best_rate = q, rate
    return best_q


def decode_rows(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_ids: Sequence[int],
    pad_id: int,
    tokenizer: Any = None,
    stop_strings: Sequence[str] = (),
    row_seeds: Sequence[int] | None = None,
    draft_token_budget: int = DRAFT_TOKEN_BUDGET,
    max_rows: int | None = None,
    prompt_states: PromptStates | None = None,
    stats: DecodeStats | None = None,
) -> list[DecodedRow]:
    """Sample one completion per prompt (see the module docstring); no grad, model as is.

    Each row ends at its first EOS (kept), at the token that completes a stop string
    (kept), or after ``max_new_tokens``. ``tokenizer`` is needed only with stop strings.
    ``row_seeds``: one seed per prompt, each row then draws from its own generator.
    ``draft_token_budget``: drafts are considered while a forward stays within this many
    tokens over all live rows (at most :data:`MAX_DRAFT` per row), and a forward checks as
    many drafted positions as :func:`draft_positions` finds worth their cost given each
    row's acceptance so far; 0 decodes one token per row per forward. ``max_rows``: at
    most this many rows decode at once (None: all); the others wait in order and join as
    rows finish (:data:`REFILL_FRACTION`).
    ``prompt_states``: prompt states to reuse and to add to (the weights must be those
    they were computed with). ``stats``, when given, receives the call's counters.
    """
    if stop_strings and tokenizer is None:
        raise ValueError("stop strings need the tokenizer to decode the sampled tokens")
    if row_seeds is not None and len(row_seeds) != len(prompts):
        raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
    if draft_token_budget < 0:
        raise ValueError(f"draft_token_budget={draft_token_budget} must be >= 0 (0 = no drafts)")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows={max_rows} must be >= 1 (or None for every row at once)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    stats = stats if stats is not None else DecodeStats()
    store = prompt_states if prompt_states is not None else PromptStates()
    generators = (
        None
        if row_seeds is None
        else [torch.Generator().manual_seed(int(seed)) for seed in row_seeds]
    )
    device = next(model.parameters()).device
    room = max_new_tokens + 2 * (MAX_DRAFT + 1)  # the completion plus rejected drafts
    if not can_relayout(new_cache(model, 1)):  # no compaction, no rows joining later
        draft_token_budget, max_rows = 0, None
    max_rows = len(prompts) if max_rows is None else min(max_rows, len(prompts))
    eos = set(int(e) for e in eos_ids)
    matcher = StopMatcher(tokenizer, stop_strings) if stop_strings else None
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    texts = [""] * len(prompts)
    reasons = ["length"] * len(prompts)
    lookups = [PromptLookup(p) for p in prompts] if draft_token_budget else None
    acceptance = [INITIAL_ACCEPTANCE] * len(prompts)

    def emit(row: int, run: list[int], run_lp: list[float]) -> bool:
        """Append a row's new tokens up to where it ends; True while it goes on."""
        for token, lp in zip(run, run_lp):
            tokens[row].append(token)
            logprobs[row].append(lp)
            if lookups is not None:
                lookups[row].extend([token])
            if token in eos:
                reasons[row] = "eos"
                return False
            if matcher is not None:
                texts[row], stopped = matcher.hit(texts[row], token)
                if stopped:
                    reasons[row] = "stop"
                    return False
            if len(tokens[row]) >= max_new_tokens:
                return False
        return True

    def row_generators(rows: Sequence[int]) -> list[torch.Generator] | None:
        return None if generators is None else [generators[r] for r in rows]

    waiting = list(range(len(prompts)))  # rows not started yet, in order
    # the live batch: prompt index, last drawn token and its position per row
    active: list[int] = []
    pending: list[int] = []
    pending_position = torch.zeros((0, 1), dtype=torch.long, device=device)
    cache: Any = None
    mask: torch.Tensor | None = None
    with torch.no_grad():
        while True:
            free = max_rows - len(active)
            if waiting and (not active or free >= max(1, int(max_rows * REFILL_FRACTION))):
                # rows join: each draws its first token from its prompt's state
                joining, waiting = waiting[:free], waiting[free:]
                keys = [tuple(int(t) for t in prompts[r]) for r in joining]
                states, prefilled = _prompt_states(model, keys, pad_id, store)
                stats.prefilled += prefilled
                first = torch.stack([states[k].logits for k in keys])[:, None, :]
                runs, run_lps, _ = _draw_along_drafts(
                    first,
                    [[] for _ in joining],
                    temperature=temperature,
                    generators=row_generators(joining),
                )
                going = [b for b, row in enumerate(joining) if emit(row, runs[b], run_lps[b])]
                if going:
                    consumed = []
                    if store.keep_finished:  # the batch will hold these states' only copy
                        needed = {tuple(int(t) for t in prompts[r]) for r in waiting}
                        uses = Counter(keys[b] for b in going)
                        for key in set(uses) - needed:
                            store.drop(model, key)
                        consumed = [uses[keys[b]] == 1 and keys[b] not in needed for b in going]
                    cache, mask = relayout(
                        model,
                        cache,
                        mask,
                        [states[keys[b]] for b in going],
                        room=room,
                        consumed=consumed,
                    )
                    del states
                    active += [joining[b] for b in going]
                    pending += [runs[b][-1] for b in going]
                    joined = torch.as_tensor(
                        [len(keys[b]) for b in going], dtype=torch.long, device=device
                    )[:, None]
                    pending_position = torch.cat([pending_position, joined])
                if not active:
                    if waiting:
                        continue
                    break
            assert cache is not None and mask is not None
            room_per_row = min(MAX_DRAFT, draft_token_budget // len(active) - 1) if lookups else 0
            drafts = [
                lookups[row].draft(min(room_per_row, max_new_tokens - len(tokens[row]) - 1))
                if lookups is not None
                else []
                for row in active
            ]
            q = draft_positions(drafts, [acceptance[row] for row in active])
            drafts = [d[: q - 1] for d in drafts]
            stats.drafted += sum(len(d) for d in drafts)
            inputs = torch.tensor(
                [
                    [token, *draft] + [int(pad_id)] * (q - 1 - len(draft))
                    for token, draft in zip(pending, drafts)
                ],
                dtype=torch.long,
                device=device,
            )
            if cache.get_seq_length() + q > cache_capacity(cache):  # rejected drafts filled it
                cache, mask = relayout(model, cache, mask, [], room=room)
                stats.compactions += 1
            mask = torch.cat([mask, mask.new_ones((len(active), q))], dim=-1)
            out = model(
                input_ids=inputs,
                attention_mask=mask,
                position_ids=pending_position + torch.arange(q, device=device)[None, :],
                use_cache=True,
                **cache_kwargs(cache),
                logits_to_keep=q,
            )
            stats.forwards += 1
            runs, run_lps, accepted = _draw_along_drafts(
                out.logits.float(),
                drafts,
                temperature=temperature,
                generators=row_generators(active),
            )
            stats.accepted += sum(accepted)
            for row, draft, kept_drafts in zip(active, drafts, accepted):
                if draft:  # each check moves the row's estimate halfway to what it saw
                    acceptance[row] = 0.5 * acceptance[row] + 0.5 * kept_drafts / len(draft)
            if q > 1:  # drafted positions after a row's accepted ones: out of attention
                kept = torch.as_tensor(accepted, device=device)[:, None] + 1
                offsets = torch.arange(q, device=device)[None, :]
                mask[:, -q:] = (offsets < kept).to(mask.dtype)
            pending_position = (
                pending_position
                + torch.as_tensor([len(run) for run in runs], device=device)[:, None]
            )
            keep = [b for b, row in enumerate(active) if emit(row, runs[b], run_lps[b])]
            if store.keep_finished:  # a finished row's state, for the turn that extends it
                for b in sorted(set(range(len(active))) - set(keep)):
                    row = active[b]
                    done = (*(int(t) for t in prompts[row]), *tokens[row][:-1])
                    store.put(model, done, finished_row_state(cache, mask, b, len(done)))
            if len(keep) != len(active):  # finished rows leave the batch
                index = torch.as_tensor(keep, dtype=torch.long, device=device)
                compact_rows(cache, keep)
                mask, pending_position = mask[index], pending_position[index]
            pending = [runs[b][-1] for b in keep]
            active = [active[b] for b in keep]
            if not active and not waiting:
                break
    return [DecodedRow(t, lp, r) for t, lp, r in zip(tokens, logprobs, reasons)]
