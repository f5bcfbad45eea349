"""`replay_trace` against the real local server: results, retries, failures, keys, summary."""

from __future__ import annotations

import email.utils
import time

import pytest
from trace_helpers import local_teachers, make_states, state_of

from composer_replication.teacher_replay import (
    DEFAULT_TEACHERS,
    error_kind,
    prompt_token_upper_bound,
    replay_trace,
)
from composer_replication.teacher_replay.budget import cost_nanos, nanos_to_usd
from composer_replication.testing import Fault, LocalOpenAIServer

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def reply(model: str, messages: list[dict]) -> str:
    return f"{model} answers {messages[-1]['content']}"


async def test_rows_in_state_then_teacher_order_with_exact_costs():
    with LocalOpenAIServer(reply, latency_s=lambda m: 0.05 if m.endswith("t0") else 0.0) as srv:
        teachers = local_teachers(srv, 2, price_in=1.25, price_out=10.0)
        rows = await replay_trace(make_states(3), teachers, max_total_usd=1.0, concurrency=4)
    assert [(r["state_id"], r["teacher_slug"]) for r in rows] == [
        (f"s{i}", f"local/t{j}") for i in range(3) for j in range(2)
    ]
    assert rows[3]["response_text"] == "local/t1 answers task s1"
    for row in rows:
        assert row["error"] is None and row["attempts"] == 1 and row["cached"] is False
        # server usage: prompt 3 + (4 + ceil(23/4)) + (4 + ceil(7/4)) = 19 tokens
        assert row["prompt_tokens"] == 19
        assert row["completion_tokens"] == -(-len(row["response_text"]) // 4)
        expected = cost_nanos(row["prompt_tokens"], row["completion_tokens"], 1.25, 10.0)
        assert row["cost_usd"] == nanos_to_usd(expected)
    s = rows.summary
    assert (s.n_rows, s.n_ok, s.n_calls, s.n_requests, s.n_retries, s.n_cache_hits) == (
        6,
        6,
        6,
        6,
        0,
        0,
    )
    assert s.errors_by_kind == {} and s.overshoot_usd == 0.0
    assert s.spend_usd == pytest.approx(sum(r["cost_usd"] for r in rows), abs=1e-12)
    latencies = sorted(r["latency_s"] for r in rows)
    assert s.latency_p50_s == latencies[2] and s.latency_p95_s == latencies[5]
    assert s.latency_p95_s >= 0.05  # the slow teacher


async def test_retry_after_seconds_is_honoured(server):
    server.add_faults(Fault("status", status=429, retry_after="1"))
    rows = await replay_trace(make_states(1), local_teachers(server, 1), max_retries=2)
    assert rows[0]["error"] is None and rows[0]["attempts"] == 2
    first, second = server.requests
    assert second.received_at - first.received_at >= 1.0
    assert rows[0]["latency_s"] >= 1.0
    assert rows.summary.n_retries == 1 and rows.summary.n_requests == 2


async def test_retry_after_http_date_is_honoured(server):
    wall0, mono0 = time.time(), time.monotonic()
    deadline = int(wall0 + 2.0)  # an HTTP date has whole seconds
    server.add_faults(
        Fault("status", status=503, retry_after=email.utils.formatdate(deadline, usegmt=True))
    )
    rows = await replay_trace(make_states(1), local_teachers(server, 1), max_retries=1)
    first, second = server.requests
    assert rows[0]["error"] is None
    # the retry was sent no earlier than the date the server named
    assert wall0 + (second.received_at - mono0) >= deadline - 0.01
    assert second.received_at - first.received_at >= 0.9


async def test_500_then_success_and_500_until_retries_run_out(server):
    teachers = local_teachers(server, 2)
    server.add_faults(Fault("status", status=500), model="local/t0")
    server.add_faults(*[Fault("status", status=502)] * 3, model="local/t1")
    rows = await replay_trace(
        make_states(1), teachers, max_retries=2, backoff_base_s=0.01, concurrency=2
    )
    ok, failed = rows
    assert ok["error"] is None and ok["attempts"] == 2
    assert error_kind(failed["error"]) == "http_502" and failed["attempts"] == 3
    assert failed["response_text"] is None and failed["cost_usd"] == 0.0  # not billed
    assert rows.summary.errors_by_kind == {"http_502": 1}
    assert rows.summary.n_requests == 5 and rows.summary.n_retries == 3


async def test_client_errors_are_not_retried(server):
    server.add_faults(Fault("status", status=400))
    rows = await replay_trace(make_states(1), local_teachers(server, 1), max_retries=3)
    assert error_kind(rows[0]["error"]) == "http_400" and server.request_count == 1


@pytest.mark.parametrize("kind", ["malformed", "no_choices"])
async def test_malformed_body_is_an_error_row_charged_its_reservation(server, kind):
    server.add_faults(Fault(kind))
    states = make_states(1)
    rows = await replay_trace(states, local_teachers(server, 1), max_tokens=100)
    assert error_kind(rows[0]["error"]) == "malformed_response"
    assert server.request_count == 1  # not retried
    bound = prompt_token_upper_bound(states[0]["messages"])
    assert rows[0]["cost_usd"] == nanos_to_usd(cost_nanos(bound, 100, 1.0, 2.0))  # fail closed
    assert rows.summary.spend_usd == rows[0]["cost_usd"]


async def test_missing_usage_charges_the_reservation(server):
    server.add_faults(Fault("no_usage"))
    states = make_states(1)
    rows = await replay_trace(states, local_teachers(server, 1), max_tokens=64)
    bound = prompt_token_upper_bound(states[0]["messages"])
    assert rows[0]["error"] is None
    assert (rows[0]["prompt_tokens"], rows[0]["completion_tokens"]) == (bound, 64)
    assert rows[0]["cost_usd"] == nanos_to_usd(cost_nanos(bound, 64, 1.0, 2.0))


async def test_hang_becomes_a_timeout_row_and_others_survive(server):
    teachers = local_teachers(server, 2)
    server.add_faults(Fault("hang", delay_s=5.0), model="local/t1")
    rows = await replay_trace(make_states(2), teachers, timeout_s=0.3, max_retries=0)
    kinds = [error_kind(r["error"]) for r in rows]
    # the hang is served to whichever local/t1 request reaches the server first (row 1 or 3)
    assert sorted(kinds, key=str) == [None, None, None, "timeout"]
    hung = kinds.index("timeout")
    assert rows[hung]["teacher_slug"] == "local/t1"
    assert rows[hung]["cost_usd"] > 0  # the hung request may have been billed: fail closed
    assert rows.summary.errors_by_kind == {"timeout": 1}


async def test_dropped_connections_are_retried_then_reported(server):
    server.add_faults(Fault("drop"), model="local/t0")
    server.add_faults(Fault("drop"), Fault("drop"), model="local/t1")
    rows = await replay_trace(
        make_states(1), local_teachers(server, 2), max_retries=1, backoff_base_s=0.01
    )
    assert rows[0]["error"] is None and rows[0]["attempts"] == 2
    assert error_kind(rows[1]["error"]) == "connection_error" and rows[1]["attempts"] == 2


async def test_concurrency_bound_and_progress(server):
    with LocalOpenAIServer(latency_s=0.1) as slow:
        seen = []
        rows = await replay_trace(
            make_states(12), local_teachers(slow, 2), concurrency=5, progress=seen.append
        )
        assert slow.max_in_flight == 5
    assert len(rows) == 24
    assert [p.done for p in seen] == list(range(1, 25)) and seen[-1].total == 24
    assert seen[-1].spend_usd == rows.summary.spend_usd


async def test_api_keys(server, monkeypatch):
    with LocalOpenAIServer(api_key="sk-test") as keyed:
        teacher = {**local_teachers(keyed, 1)[0], "api_key_env": "LOCAL_TEST_KEY"}
        monkeypatch.setenv("LOCAL_TEST_KEY", "sk-test")
        rows = await replay_trace(make_states(1), [teacher])
        assert rows[0]["error"] is None
        assert keyed.requests[0].authorization == "Bearer sk-test"
        monkeypatch.delenv("LOCAL_TEST_KEY")
        with pytest.raises(RuntimeError, match=r"\$LOCAL_TEST_KEY"):
            await replay_trace(make_states(1), [teacher])
        # an explicit api_key is sent to an own endpoint without api_key_env
        plain = local_teachers(keyed, 1)
        assert (await replay_trace(make_states(1), plain, api_key="sk-test"))[0]["error"] is None
    # a local endpoint without a key sends no Authorization header at all
    await replay_trace(make_states(1), local_teachers(server, 1))
    assert server.requests[0].authorization is None
    # OpenRouter teachers need a key
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="OPENROUTER_API_KEY"):
        await replay_trace(make_states(1), DEFAULT_TEACHERS)


async def test_boundary_validation(server):
    teachers = local_teachers(server, 1)
    with pytest.raises(ValueError, match="appears twice"):
        await replay_trace(make_states(1) * 2, teachers)
    with pytest.raises(ValueError, match="base_url"):
        await replay_trace(make_states(1), [{**teachers[0], "base_url": "localhost:1/v1"}])
    with pytest.raises(ValueError, match="slug"):
        await replay_trace(make_states(1), teachers * 2)
    with pytest.raises(ValueError, match="extra_body"):
        await replay_trace(make_states(1), [{**teachers[0], "extra_body": {"max_tokens": 9}}])
    with pytest.raises(ValueError, match="concurrency"):
        await replay_trace(make_states(1), teachers, concurrency=0)
    with pytest.raises(ValueError, match="messages"):
        await replay_trace([{"state_id": "x", "messages": [], "student_action": ""}], teachers)
    assert server.request_count == 0


async def test_requests_carry_model_messages_and_extra_body(server):
    teacher = {**local_teachers(server, 1)[0], "model": "served-name", "extra_body": {"seed": 7}}
    states = make_states(1)
    rows = await replay_trace(states, [teacher], max_tokens=33)
    body = server.requests[0].body
    assert body == {
        "model": "served-name",
        "messages": states[0]["messages"],
        "max_tokens": 33,
        "seed": 7,
    }
    assert state_of(server.requests[0]) == "s0"
    assert rows[0]["error"] is None


def test_record_types_know_their_optional_keys_at_run_time():
    from composer_replication.traces.teacher_replay.records import (
        TeacherCallResult,
        TeacherSpec,
        TraceState,
    )

    assert TeacherSpec.__optional_keys__ == {"base_url", "api_key_env", "model", "extra_body"}
    assert TeacherSpec.__required_keys__ == {"slug", "input_per_mtok", "output_per_mtok"}
    assert TraceState.__optional_keys__ == {"error_site", "source"}
    assert TeacherCallResult.__optional_keys__ == {"cached", "attempts"}
