"""One teacher call over an OpenAI-compatible `/chat/completions` endpoint, with retries.

A call reserves its cost bound from the `SpendBudget`, sends the request (httpx, imported
here lazily), and turns every outcome into a `TeacherCallResult` row: a failure is a row
whose `error` is `"<kind>: <detail>"`, never an exception.

Retried (up to `RetryPolicy.max_retries` times): HTTP 408, 409, 425, 429 and 5xx, timeouts
and connection errors. The wait is the server's `Retry-After` (seconds or an HTTP date) when
it sends one (a wait above `max_retry_after_s` gives up instead), else exponential backoff
with "equal jitter": uniform in [b/2, b] with b = min(backoff_max_s, backoff_base_s * 2**k).
Not retried: other 4xx, and a 200 that is not a chat completion ("malformed_response").
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from composer_replication.traces.teacher_replay.budget import (
    Reservation,
    SpendBudget,
    cost_nanos,
    nanos_to_usd,
)
from composer_replication.traces.teacher_replay.records import TeacherCallResult

__all__ = ["CallPlan", "CallStats", "RetryPolicy", "parse_retry_after", "run_call"]

_RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
_DETAIL_CHARS = 300


@dataclass(frozen=True)
class RetryPolicy:
    """How failed attempts are retried (see the module docstring)."""

    max_retries: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    max_retry_after_s: float = 120.0


@dataclass(frozen=True)
class CallPlan:
    """Everything one (state, teacher) call needs; built once by `replay_trace`."""

    state_id: str
    teacher_slug: str
    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    prompt_token_bound: int
    max_tokens: int
    input_per_mtok: float
    output_per_mtok: float

    @property
    def reservation_nanos(self) -> int:
        return cost_nanos(
            self.prompt_token_bound, self.max_tokens, self.input_per_mtok, self.output_per_mtok
        )


@dataclass
class CallStats:
    """Run-wide request counters (mutable state shared by the workers of one run)."""

    n_requests: int = 0
    n_retries: int = 0


@dataclass(frozen=True)
class _Outcome:
    error: str | None  # "<kind>: <detail>", None on success
    retryable: bool = False
    maybe_charged: bool = False
    retry_after_s: float | None = None
    text: str | None = None
    usage: tuple[int, int] | None = None


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header (delta-seconds or HTTP date); None if bad."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def _backoff_s(retry_index: int, policy: RetryPolicy, rng: random.Random) -> float:
    ceiling = min(policy.backoff_max_s, policy.backoff_base_s * 2**retry_index)
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


def _message_text(choice: Any) -> str | None:
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    return None


def _parse_completion(data: Any) -> _Outcome:
    if isinstance(data, dict) and isinstance(data.get("error"), dict) and "choices" not in data:
        code = data["error"].get("code")
        detail = str(data["error"].get("message", ""))[:_DETAIL_CHARS]
        if isinstance(code, int) and 400 <= code < 600:
            retryable = code in _RETRYABLE_STATUS or code >= 500
            return _Outcome(error=f"http_{code}: {detail}", retryable=retryable)
        return _Outcome(error=f"malformed_response: error object {detail!r}")
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        return _Outcome(error="malformed_response: no choices in the body", maybe_charged=True)
    text = _message_text(choices[0])
    if text is None:
        return _Outcome(
            error="malformed_response: choices[0].message.content is not text", maybe_charged=True
        )
    usage = data.get("usage")
    tokens = None
    if isinstance(usage, dict):
        pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(pt, int) and isinstance(ct, int) and pt >= 0 and ct >= 0:
            tokens = (pt, ct)
    return _Outcome(error=None, text=text, usage=tokens)


async def _attempt(client: Any, plan: CallPlan, timeout_s: float) -> _Outcome:
    import httpx

    try:
        # wait_for bounds the whole exchange; httpx's own timeouts are per read/write.
        response = await asyncio.wait_for(
            client.post(plan.url, json=plan.body, headers=plan.headers), timeout_s
        )
    except httpx.ConnectTimeout:
        return _Outcome(error=f"timeout: connect after {timeout_s:g} s", retryable=True)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        # The request may have reached the provider and been billed: fail closed.
        return _Outcome(
            error=f"timeout: no response within {timeout_s:g} s", retryable=True, maybe_charged=True
        )
    except httpx.ConnectError as exc:
        return _Outcome(error=f"connection_error: {exc!r}"[:_DETAIL_CHARS], retryable=True)
    except httpx.TransportError as exc:
        return _Outcome(
            error=f"connection_error: {exc!r}"[:_DETAIL_CHARS], retryable=True, maybe_charged=True
        )
    if response.status_code != 200:
        status = response.status_code
        return _Outcome(
            error=f"http_{status}: {response.text[:_DETAIL_CHARS]}",
            retryable=status in _RETRYABLE_STATUS or status >= 500,
            retry_after_s=parse_retry_after(response.headers.get("retry-after")),
        )
    try:
        data = response.json()
    except ValueError:
        snippet = response.text[:80]
        return _Outcome(
            error=f"malformed_response: body is not JSON ({snippet!r})", maybe_charged=True
        )
    return _parse_completion(data)


def _row(
    plan: CallPlan,
    *,
    text: str | None = None,
    error: str | None = None,
    latency_s: float = 0.0,
    tokens: tuple[int, int] = (0, 0),
    charged_nanos: int = 0,
    attempts: int = 0,
) -> TeacherCallResult:
    return TeacherCallResult(
        state_id=plan.state_id,
        teacher_slug=plan.teacher_slug,
        response_text=text,
        latency_s=latency_s,
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        cost_usd=nanos_to_usd(charged_nanos),
        error=error,
        cached=False,
        attempts=attempts,
    )


def _refusal(plan: CallPlan, budget: SpendBudget) -> str:
    left = nanos_to_usd(budget.cap_nanos - budget.settled_nanos)
    need = nanos_to_usd(plan.reservation_nanos)
    return (
        f"budget_exceeded: this call needs a ${need:.6f} reservation but only ${left:.6f} of "
        f"max_total_usd={budget.max_total_usd:g} is left; raise max_total_usd or lower max_tokens"
    )


async def run_call(
    client: Any,
    plan: CallPlan,
    budget: SpendBudget,
    *,
    policy: RetryPolicy,
    timeout_s: float,
    rng: random.Random,
    stats: CallStats,
) -> TeacherCallResult:
    """Make one call with retries under `budget`; every outcome is a row."""
    reservation: Reservation | None = await budget.reserve(plan.reservation_nanos)
    if reservation is None:
        return _row(plan, error=_refusal(plan, budget))
    charged = attempts = 0
    start = time.perf_counter()

    def failed(error: str) -> TeacherCallResult:
        # what this call has cost and tried so far, read when it ends
        return _row(
            plan,
            error=error,
            latency_s=time.perf_counter() - start,
            charged_nanos=charged,
            attempts=attempts,
        )

    try:
        while True:
            attempts += 1
            stats.n_requests += 1
            outcome = await _attempt(client, plan, timeout_s)
            if outcome.error is None:
                tokens = outcome.usage or (plan.prompt_token_bound, plan.max_tokens)
                actual = (
                    cost_nanos(*tokens, plan.input_per_mtok, plan.output_per_mtok)
                    if outcome.usage is not None
                    else reservation.nanos  # no usage reported: charge the bound
                )
                budget.settle(reservation, actual)
                reservation = None
                return _row(
                    plan,
                    text=outcome.text,
                    latency_s=time.perf_counter() - start,
                    tokens=tokens,
                    charged_nanos=charged + actual,
                    attempts=attempts,
                )
            if outcome.maybe_charged:
                budget.settle(reservation, reservation.nanos)
                charged += reservation.nanos
                reservation = None
            delay: float | None = None
            if outcome.retryable and attempts <= policy.max_retries:
                if outcome.retry_after_s is not None:
                    if outcome.retry_after_s <= policy.max_retry_after_s:
                        delay = outcome.retry_after_s
                else:
                    delay = _backoff_s(attempts - 1, policy, rng)
            if delay is None:
                if reservation is not None:  # a failure the provider does not bill
                    budget.settle(reservation, 0)
                    reservation = None
                return failed(outcome.error)
            await asyncio.sleep(delay)
            if reservation is None:
                reservation = await budget.reserve(plan.reservation_nanos)
                if reservation is None:
                    return failed(_refusal(plan, budget))
            stats.n_retries += 1
    finally:
        if reservation is not None:
            # Cancelled while holding a reservation (mid-request or in backoff): the request
            # may have been billed, so fail closed.
            budget.settle(reservation, reservation.nanos)
