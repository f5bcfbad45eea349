"""`replay_trace`: N teachers replay every state of a frozen trace, under a hard spend cap.

For each state, each teacher is asked for the next assistant action over its
OpenAI-compatible chat-completions endpoint. Calls run concurrently (at most `concurrency`
in flight), are retried on transient failures (`client`), are reserved and settled against
the cap (`budget`), and finished rows are cached on disk (`cache`), so a re-run after a
crash or Ctrl-C resumes without paying twice. Rows come back in state order, then teacher
order, whatever order the calls finished in.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from composer_replication.traces.teacher_replay.budget import (
    SpendBudget,
    prompt_token_upper_bound,
)
from composer_replication.traces.teacher_replay.cache import ReplayCache, cache_key
from composer_replication.traces.teacher_replay.client import (
    CallPlan,
    CallStats,
    RetryPolicy,
    run_call,
)
from composer_replication.traces.teacher_replay.records import (
    DEFAULT_TEACHERS,
    OPENROUTER_API_KEY_ENV,
    OPENROUTER_BASE_URL,
    TeacherCallResult,
    TeacherSpec,
    TraceState,
)
from composer_replication.traces.teacher_replay.summary import ReplayProgress, ReplaySummary

__all__ = ["ReplayProgress", "ReplayResults", "ReplaySummary", "replay_trace"]


class ReplayResults(list):  # list[TeacherCallResult]
    """The rows of a run (a plain list) with the run's `summary` attached."""

    summary: ReplaySummary

    def __init__(self, rows: Iterable[TeacherCallResult], summary: ReplaySummary) -> None:
        super().__init__(rows)
        self.summary = summary


@dataclass
class _Run:
    """Mutable state of one run (counters the workers share)."""

    total: int
    done: int = 0
    n_cache_hits: int = 0
    n_errors: int = 0
    stats: CallStats = field(default_factory=CallStats)


# Request fields replay_trace owns: overriding them would change what the reservation bounds
# (max_tokens, n), break response parsing (stream) or the cache key's meaning.
_RESERVED_BODY_KEYS = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "n", "stream"}
)


def _check_teachers(teachers: Sequence[TeacherSpec]) -> list[TeacherSpec]:
    teachers = list(teachers)
    if not teachers:
        raise ValueError("teachers is empty; pass at least one TeacherSpec (see DEFAULT_TEACHERS)")
    seen: set[str] = set()
    for t in teachers:
        slug = t.get("slug") if isinstance(t, dict) else None
        if not isinstance(slug, str) or not slug:
            raise ValueError(f"teacher {t!r} has no 'slug'; every TeacherSpec needs a name")
        if slug in seen:
            raise ValueError(f"teacher slug {slug!r} appears twice; slugs must be unique")
        seen.add(slug)
        for key in ("input_per_mtok", "output_per_mtok"):
            price = t.get(key)
            if not isinstance(price, int | float) or not math.isfinite(price) or price < 0:
                raise ValueError(f"teacher {slug!r}: {key}={price!r} must be a number >= 0")
        extra = t.get("extra_body", {})
        clash = sorted(_RESERVED_BODY_KEYS & set(extra)) if isinstance(extra, dict) else None
        if clash is None or clash:
            raise ValueError(
                f"teacher {slug!r}: extra_body must be a dict without {sorted(_RESERVED_BODY_KEYS)}"
                f" (they are set by replay_trace or break the spend bound); got {extra!r}"
            )
        base_url = t.get("base_url", OPENROUTER_BASE_URL)
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"teacher {slug!r}: base_url={base_url!r} must start with http:// or https://"
            )
    return teachers


def _check_states(states: Iterable[TraceState]) -> list[TraceState]:
    states = list(states)
    seen: set[str] = set()
    for i, s in enumerate(states):
        sid = s.get("state_id") if isinstance(s, dict) else None
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"states[{i}] has no string 'state_id'; is it a TraceState?")
        if sid in seen:
            raise ValueError(f"state_id {sid!r} appears twice; state ids must be unique")
        seen.add(sid)
        messages = s.get("messages")
        ok = isinstance(messages, list) and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok or not messages:
            raise ValueError(
                f"state {sid!r}: 'messages' must be a non-empty list of {{'role', 'content'}} "
                "dicts with string values"
            )
    return states


def _resolve_key(teacher: TeacherSpec, api_key: str | None) -> str | None:
    env = teacher.get("api_key_env")
    if env:
        key = os.environ.get(env)
        if not key:
            raise RuntimeError(
                f"teacher {teacher['slug']!r} reads its key from ${env}, which is not set; "
                f"export {env}=... or remove api_key_env"
            )
        return key
    if "base_url" in teacher and teacher["base_url"].rstrip("/") != OPENROUTER_BASE_URL:
        return api_key  # own endpoint without api_key_env: a local server needs no key
    key = api_key or os.environ.get(OPENROUTER_API_KEY_ENV)
    if not key:
        raise RuntimeError(
            f"no API key for teacher {teacher['slug']!r} on OpenRouter: pass api_key=... or "
            f"export {OPENROUTER_API_KEY_ENV}=..."
        )
    return key


def _plans(
    states: list[TraceState], teachers: list[TeacherSpec], api_key: str | None, max_tokens: int
) -> list[tuple[CallPlan, str]]:
    """(plan, cache key) per call, state-major."""
    headers_by_slug = {}
    for t in teachers:
        key = _resolve_key(t, api_key)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        headers_by_slug[t["slug"]] = headers
    out = []
    for state in states:
        messages = [{"role": m["role"], "content": m["content"]} for m in state["messages"]]
        bound = prompt_token_upper_bound(messages)
        for t in teachers:
            base_url = t.get("base_url", OPENROUTER_BASE_URL).rstrip("/")
            extra = t.get("extra_body", {})
            body: dict[str, Any] = {
                "model": t.get("model", t["slug"]),
                "messages": messages,
                "max_tokens": max_tokens,
                **extra,
            }
            plan = CallPlan(
                state_id=state["state_id"],
                teacher_slug=t["slug"],
                url=f"{base_url}/chat/completions",
                headers=headers_by_slug[t["slug"]],
                body=body,
                # extra_body may add prompt tokens (tools, ...): its bytes join the bound
                prompt_token_bound=bound + len(json.dumps(extra).encode()) if extra else bound,
                max_tokens=max_tokens,
                input_per_mtok=float(t["input_per_mtok"]),
                output_per_mtok=float(t["output_per_mtok"]),
            )
            out.append((plan, cache_key(plan.state_id, plan.teacher_slug, base_url, body)))
    return out


async def replay_trace(
    states: Iterable[TraceState],
    teachers: Sequence[TeacherSpec] = DEFAULT_TEACHERS,
    max_total_usd: float = 5.0,
    api_key: str | None = None,
    *,
    concurrency: int = 16,
    cache_dir: str | os.PathLike[str] | None = None,
    max_tokens: int = 2048,
    timeout_s: float = 120.0,
    max_retries: int = 4,
    backoff_base_s: float = 0.5,
    progress: Callable[[ReplayProgress], None] | None = None,
    seed: int | None = None,
    resend_in_flight: bool = False,
) -> ReplayResults:
    """Ask every teacher for the next action at every state; one row per (state, teacher).

    Spend guarantee: before each HTTP attempt the call reserves an upper bound of its cost,
    (UTF-8 bytes of the prompt and of `extra_body` + 16 tokens per message) x input price +
    `max_tokens` x output price, and it starts only if settled spend + all reservations in flight + its
    own fit in `max_total_usd` (else it waits for calls in flight to settle, or becomes a
    "budget_exceeded" row when nothing is in flight). After the call the reservation is
    released and the real cost (reported usage x the TeacherSpec's prices) settled; an
    unknown charge (timeout after sending, dropped connection, unparsable 200, no usage)
    settles at the full reservation. Hence, exactly (integer nano-dollars):

        settled spend <= max_total_usd + summary.overshoot_usd

    where `overshoot_usd` sums the real costs above their reservations. It is 0 whenever
    the provider honours `max_tokens` and adds no hidden prompt tokens, so the cap is hard;
    the tests measure 0 under 32 concurrent calls, and measure the excess when a server
    ignores `max_tokens`. With a cache the cap covers every run that used it (its ledger);
    rows served from the cache cost nothing more.

    Args:
        states: the trace's states (`TraceState`); state ids must be unique.
        teachers: `TeacherSpec`s (default `DEFAULT_TEACHERS`, all on OpenRouter).
        max_total_usd: hard cap on this run's spend (the guarantee above).
        api_key: key for teachers without `api_key_env` (OpenRouter falls back to
            `$OPENROUTER_API_KEY`).
        concurrency: calls in flight at most.
        cache_dir: directory of the on-disk row cache; None disables it. With a cache the
            cap is cumulative: what earlier runs spent through the same cache (its ledger,
            unknown outcomes charged at their reservations) counts against
            ``max_total_usd`` too.
        resend_in_flight: send again the calls an earlier, killed run left in flight
            (they may have been billed); by default they come back as ``outcome_unknown``
            error rows.
        max_tokens: completion cap sent with every request (and used in the reservation).
        timeout_s: total seconds allowed per HTTP attempt.
        max_retries: retries per call after the first attempt.
        backoff_base_s: first backoff step when the server sends no `Retry-After`.
        progress: called with a `ReplayProgress` after every finished row.
        seed: seeds the backoff jitter (None: random).

    Returns:
        `ReplayResults`: the rows in state order then teacher order, with `.summary`.

    Raises:
        RuntimeError: a teacher needs an API key and none is found.
        ValueError: malformed states, teachers or arguments.
    """
    started = time.perf_counter()
    checked_states = _check_states(states)
    checked_teachers = _check_teachers(teachers)
    for name, value, low in (("concurrency", concurrency, 1), ("max_tokens", max_tokens, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    if not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries={max_retries!r} must be an int >= 0")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    cache = ReplayCache(cache_dir) if cache_dir is not None else None
    prior = cache.prior_spend_nanos if cache is not None else 0
    budget = SpendBudget(max_total_usd, spent_before_nanos=prior)
    plans = _plans(checked_states, checked_teachers, api_key, max_tokens)
    policy = RetryPolicy(max_retries=max_retries, backoff_base_s=backoff_base_s)
    rng = random.Random(seed)
    rows: list[TeacherCallResult | None] = [None] * len(plans)
    run = _Run(total=len(plans))

    def finished(index: int, row: TeacherCallResult) -> None:
        rows[index] = row
        run.done += 1
        run.n_errors += row["error"] is not None
        if progress is not None:
            progress(
                ReplayProgress(
                    done=run.done,
                    total=run.total,
                    n_cache_hits=run.n_cache_hits,
                    n_errors=run.n_errors,
                    spend_usd=budget.settled_usd,
                    max_total_usd=budget.max_total_usd,
                )
            )

    try:
        pending: list[int] = []
        for i, (plan, key) in enumerate(plans):
            hit = cache.get(key) if cache is not None else None
            unknown = hit is None and cache is not None and key in cache.unknown_keys
            if unknown and not resend_in_flight:  # it may have been billed: do not pay again
                finished(i, _unknown_outcome_row(plan))
                continue
            if hit is None:
                pending.append(i)
                continue
            run.n_cache_hits += 1
            finished(i, {**hit, "cached": True, "attempts": 0})
        if pending:
            await _run_pending(
                plans,
                pending,
                budget,
                policy,
                rng,
                run,
                cache,
                finished,
                concurrency=concurrency,
                timeout_s=timeout_s,
            )
    finally:
        if cache is not None:
            cache.close()
    done_rows = [r for r in rows if r is not None]
    summary = ReplaySummary.from_rows(
        done_rows,
        max_total_usd=budget.max_total_usd,
        spend_usd=budget.settled_usd,
        overshoot_usd=budget.overshoot_usd,
        n_requests=run.stats.n_requests,
        n_retries=run.stats.n_retries,
        wall_s=time.perf_counter() - started,
    )
    return ReplayResults(done_rows, summary)


def _nanos(usd: float) -> int:
    return round(Fraction(repr(float(usd))) * 10**9)


def _unknown_outcome_row(plan: CallPlan) -> TeacherCallResult:
    return TeacherCallResult(
        state_id=plan.state_id,
        teacher_slug=plan.teacher_slug,
        response_text=None,
        latency_s=0.0,
        prompt_tokens=0,
        completion_tokens=0,
        cost_usd=0.0,
        error=(
            "outcome_unknown: this call was in flight when an earlier run stopped and may "
            "have been billed (its reservation is in the spend ledger); pass "
            "resend_in_flight=True (--resend-in-flight) to pay for it again"
        ),
        cached=False,
        attempts=0,
    )


async def _run_pending(
    plans: list[tuple[CallPlan, str]],
    pending: list[int],
    budget: SpendBudget,
    policy: RetryPolicy,
    rng: random.Random,
    run: _Run,
    cache: ReplayCache | None,
    finished: Callable[[int, TeacherCallResult], None],
    *,
    concurrency: int,
    timeout_s: float,
) -> None:
    import httpx

    queue = iter(pending)  # shared by the workers; the event loop is single-threaded
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def worker() -> None:
            for index in queue:
                plan, key = plans[index]
                if cache is not None:  # journaled before the request goes out
                    await cache.journal_sent(key, plan.reservation_nanos)
                row = await run_call(
                    client,
                    plan,
                    budget,
                    policy=policy,
                    timeout_s=timeout_s,
                    rng=rng,
                    stats=run.stats,
                )
                if cache is not None:  # charge and row in one write, durable before it counts
                    kept = row if row["error"] is None else None
                    await cache.journal_spent(key, _nanos(row["cost_usd"]), kept)
                finished(index, row)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(pending)))))
