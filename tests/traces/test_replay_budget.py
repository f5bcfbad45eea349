"""The hard spend cap: exact accounting, refusal, waiting, and the guarantee under load."""

from __future__ import annotations

import asyncio

import pytest
from trace_helpers import local_teachers, make_states

from composer_replication.teacher_replay import (
    SpendBudget,
    error_kind,
    parse_retry_after,
    prompt_token_upper_bound,
    replay_trace,
)
from composer_replication.teacher_replay.budget import cost_nanos, usd_to_nanos
from composer_replication.testing import LocalOpenAIServer


def test_cost_is_exact_in_nano_dollars():
    # 1000 x $1.25/M + 500 x $10/M = $0.00125 + $0.005
    assert cost_nanos(1000, 500, 1.25, 10.0) == 6_250_000
    # rounded up, never down: 1 token at $0.0001/M = 0.1 nano-dollars -> 1
    assert cost_nanos(1, 0, 0.0001, 0.0) == 1
    assert usd_to_nanos(5.0) == 5_000_000_000 and usd_to_nanos(0.05) == 50_000_000


def test_prompt_bound_counts_utf8_bytes_plus_template_allowance():
    # 16 for the reply priming + (6 bytes of "héllo" + 16) + (0 + 16)
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": ""}]
    assert prompt_token_upper_bound(messages) == 16 + 22 + 16


@pytest.mark.asyncio
async def test_reserve_settle_refuse_and_wait():
    budget = SpendBudget(1e-6)  # 1000 nano-dollars
    a = await budget.reserve(600)
    assert budget.reserved_nanos == 600
    # 600 + 600 > 1000 but `a` is in flight: the second reservation waits for it
    waiter = asyncio.create_task(budget.reserve(600))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    budget.settle(a, 100)  # the call cost less than reserved: room is released
    b = await asyncio.wait_for(waiter, 1)
    assert b is not None and budget.settled_nanos == 100 and budget.reserved_nanos == 600
    budget.settle(b, 700)  # 100 over its reservation
    assert budget.settled_nanos == 800 and budget.overshoot_nanos == 100
    assert budget.overshoot_usd == 1e-7
    # nothing in flight and 800 + 600 > 1000: refused at once, not waited for
    assert await asyncio.wait_for(budget.reserve(600), 1) is None and budget.n_refused == 1
    assert await budget.reserve(200) is not None  # exactly fills the cap
    with pytest.raises(ValueError, match="max_total_usd"):
        SpendBudget(-1.0)
    with pytest.raises(ValueError, match="max_total_usd"):
        SpendBudget(float("nan"))


@pytest.mark.integration
@pytest.mark.asyncio
async def test_cap_holds_exactly_under_heavy_concurrency():
    # replies of max_tokens tokens: real costs come close to the reservations
    with LocalOpenAIServer(lambda m, msgs: "z" * 1000, latency_s=0.01) as server:
        teachers = local_teachers(server, 3, price_in=3.0, price_out=15.0)
        states = make_states(100)
        per_call = cost_nanos(prompt_token_upper_bound(states[0]["messages"]), 64, 3.0, 15.0)
        cap = 40.5 * per_call / 1e9  # room for about 40 reservations of 300 calls
        rows = await replay_trace(states, teachers, cap, concurrency=32, max_tokens=64)
        assert server.max_in_flight > 1  # the calls really ran concurrently
    s = rows.summary
    assert len(rows) == 300  # every row kept, finished or refused
    kinds = {error_kind(r["error"]) for r in rows}
    assert kinds == {None, "budget_exceeded"}
    assert s.n_ok > 40  # real costs are below the reservations, so the room is reused
    assert s.errors_by_kind["budget_exceeded"] == 300 - s.n_ok
    # the guarantee: settled spend <= cap (exact in nano-dollars), no overshoot
    assert usd_to_nanos(s.spend_usd) <= usd_to_nanos(cap) and s.spend_usd <= cap
    assert s.overshoot_usd == 0.0
    assert s.spend_usd == pytest.approx(sum(r["cost_usd"] for r in rows), rel=1e-9)
    assert s.n_requests == s.n_ok  # refused calls sent nothing


@pytest.mark.integration
@pytest.mark.asyncio
async def test_overshoot_is_measured_when_the_provider_ignores_max_tokens():
    long_reply = "y" * 4000  # 1000 tokens, while max_tokens asks for 10
    with LocalOpenAIServer(lambda m, msgs: long_reply, honour_max_tokens=False) as server:
        teachers = local_teachers(server, 2)
        rows = await replay_trace(make_states(5), teachers, 0.01, concurrency=4, max_tokens=10)
    s = rows.summary
    # each call bills 1000 completion tokens ($0.002) against a ~$1e-7 reservation, so the
    # cap is passed, and exactly by what the overshoot measures: settled <= cap + overshoot
    assert s.spend_usd > 0.01 and s.overshoot_usd > 0
    assert s.spend_usd <= 0.01 + s.overshoot_usd
    assert s.errors_by_kind == {"budget_exceeded": 10 - s.n_ok}


@pytest.mark.integration
@pytest.mark.asyncio
async def test_zero_cap_refuses_everything_without_requests(server):
    rows = await replay_trace(make_states(3), local_teachers(server, 2), 0.0)
    assert [error_kind(r["error"]) for r in rows] == ["budget_exceeded"] * 6
    assert "raise max_total_usd" in rows[0]["error"]
    assert server.request_count == 0 and rows.summary.spend_usd == 0.0


def test_parse_retry_after():
    from datetime import datetime, timezone

    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("0.5") == 0.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("Thu, 01 Jan 2026 12:00:30 GMT", now=now) == 30.0
    assert parse_retry_after("Thu, 01 Jan 2026 11:00:00 GMT", now=now) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    assert parse_retry_after("inf") is None
