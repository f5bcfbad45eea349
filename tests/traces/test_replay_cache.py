"""The row cache: keys, durability, and resuming a cancelled run without paying twice."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from trace_helpers import local_teachers, make_states, state_of

from composer_replication.teacher_replay import ReplayCache, cache_key, error_kind, replay_trace
from composer_replication.teacher_replay.cache import CACHE_FILENAME
from composer_replication.testing import Fault, LocalOpenAIServer

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_cache_key_covers_every_part_of_the_call():
    base = cache_key("s0", "t", "http://x/v1", BODY)
    assert base == cache_key("s0", "t", "http://x/v1", dict(reversed(BODY.items())))
    assert len(base) == 64 and int(base, 16) >= 0
    variants = [
        cache_key("s1", "t", "http://x/v1", BODY),
        cache_key("s0", "u", "http://x/v1", BODY),
        cache_key("s0", "t", "http://y/v1", BODY),
        cache_key("s0", "t", "http://x/v1", {**BODY, "max_tokens": 9}),
    ]
    assert base not in variants and len(set(variants)) == 4


@pytest.mark.asyncio
async def test_partial_last_line_is_cut_and_appends_stay_readable(tmp_path):
    row = {"state_id": "s0", "teacher_slug": "t", "response_text": "ok", "error": None}
    cache = ReplayCache(tmp_path)
    await cache.put("k1", row)
    cache.close()
    path = tmp_path / CACHE_FILENAME
    with open(path, "ab") as fh:
        fh.write(b'{"key": "k2", "row": {"state_id": "s1", "te')  # a write cut by a crash
    cache = ReplayCache(tmp_path)
    assert cache.n_corrupt_lines == 1 and len(cache) == 1
    await cache.put("k3", {**row, "state_id": "s3"})
    cache.close()
    lines = path.read_bytes().splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["k1", "k3"]
    reopened = ReplayCache(tmp_path)
    assert reopened.get("k3")["state_id"] == "s3" and reopened.n_corrupt_lines == 0
    reopened.close()
    with pytest.raises(NotADirectoryError):
        ReplayCache(path)


@pytest.mark.asyncio
@pytest.mark.parametrize("yields_before_cancel", [0, 1, 2, 5])
async def test_a_charge_and_its_row_land_together_whenever_the_run_is_cancelled(
    tmp_path, yields_before_cancel
):
    row = {"state_id": "s0", "teacher_slug": "t", "response_text": "ok", "error": None}
    cache = ReplayCache(tmp_path)
    await cache.journal_sent("k", 1000)
    settling = asyncio.create_task(cache.journal_spent("k", 900, row))
    for _ in range(yields_before_cancel):
        await asyncio.sleep(0)
    settling.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await settling
    cache.close()
    reopened = ReplayCache(tmp_path)
    # both on disk (the answer is kept) or neither (the call is in flight: charged at its
    # reservation, never resent by default); never a charge without its row
    if reopened.get("k") is None:
        assert reopened.unknown_keys == {"k"} and reopened.prior_spend_nanos == 1000
    else:
        assert reopened.unknown_keys == set() and reopened.prior_spend_nanos == 900
    reopened.close()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_second_run_is_served_from_the_cache(server, tmp_path):
    teachers = local_teachers(server, 2)
    first = await replay_trace(make_states(3), teachers, cache_dir=tmp_path)
    assert server.request_count == 6
    second = await replay_trace(make_states(3), teachers, cache_dir=tmp_path)
    assert server.request_count == 6  # no new request
    assert all(r["cached"] and r["attempts"] == 0 for r in second)
    strip = [{k: v for k, v in r.items() if k not in ("cached", "attempts")} for r in second]
    assert strip == [{k: v for k, v in r.items() if k not in ("cached", "attempts")} for r in first]
    s = second.summary
    assert (s.n_cache_hits, s.n_calls, s.n_requests, s.spend_usd) == (6, 0, 0, 0.0)
    # a changed request (max_tokens) is a different call: asked again
    await replay_trace(make_states(3), teachers, cache_dir=tmp_path, max_tokens=7)
    assert server.request_count == 12


@pytest.mark.integration
@pytest.mark.asyncio
async def test_failed_rows_are_not_cached(server, tmp_path):
    teachers = local_teachers(server, 2)
    server.add_faults(Fault("status", status=500), model="local/t1")
    first = await replay_trace(make_states(1), teachers, cache_dir=tmp_path, max_retries=0)
    assert error_kind(first[1]["error"]) == "http_500"
    second = await replay_trace(make_states(1), teachers, cache_dir=tmp_path, max_retries=0)
    assert [r["cached"] for r in second] == [True, False]
    assert second[1]["error"] is None and server.request_count == 3


@pytest.mark.integration
@pytest.mark.asyncio
async def test_resume_after_cancelling_midway_pays_only_for_unfinished_rows(tmp_path):
    states = make_states(40)
    with LocalOpenAIServer(latency_s=0.05) as server:
        teachers = local_teachers(server, 2)
        task = asyncio.create_task(
            replay_trace(states, teachers, cache_dir=tmp_path, concurrency=4)
        )
        cache_file = tmp_path / CACHE_FILENAME
        while not cache_file.exists() or cache_file.read_bytes().count(b'"row"') < 20:
            await asyncio.sleep(0.01)
        task.cancel()  # what Ctrl-C does to the run
        with pytest.raises(asyncio.CancelledError):
            await task
        entries = list(map(json.loads, cache_file.read_bytes().splitlines()))
        finished = {(e["row"]["state_id"], e["row"]["teacher_slug"]) for e in entries if "row" in e}
        in_flight = {e["sent"] for e in entries if "sent" in e} - {
            e["spent"] for e in entries if "spent" in e
        }
        assert 20 <= len(finished) < 80 and 1 <= len(in_flight) <= 4
        # every call charged as answered (all succeed here) has its row: none is lost to
        # a cancel between the charge and the row, to be paid for again
        charged = {e["spent"] for e in entries if "spent" in e}
        assert charged == {e["key"] for e in entries if "row" in e}
        server.reset_counts()
        rows = await replay_trace(states, teachers, cache_dir=tmp_path, concurrency=4)
        asked = [(state_of(r), r.model) for r in server.requests]
        # calls that were in flight may have been billed: not paid for again by default
        unknown = [r for r in rows if (r["error"] or "").startswith("outcome_unknown")]
        assert len(unknown) == len(in_flight)
        assert len(asked) == 80 - len(finished) - len(in_flight)
        assert not set(asked) & finished
        server.reset_counts()
        again = await replay_trace(
            states, teachers, cache_dir=tmp_path, concurrency=4, resend_in_flight=True
        )
        assert len(server.requests) == len(in_flight)  # only those, on request
        assert [r["error"] for r in again if r["error"]] == []
    assert [(r["state_id"], r["teacher_slug"]) for r in rows] == [
        (s["state_id"], t["slug"]) for s in states for t in teachers
    ]
    assert all(r["error"] is None for r in rows if r not in unknown)
    assert rows.summary.n_cache_hits == len(finished)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_the_spend_cap_holds_across_runs_sharing_a_cache(server, tmp_path):
    teachers = local_teachers(server, 1)
    first = await replay_trace(make_states(4), teachers, max_total_usd=1.0, cache_dir=tmp_path)
    spent = first.summary.spend_usd
    assert spent > 0 and all(r["error"] is None for r in first)
    # a second run through the same cache with a cap just above the first run's spend:
    # the ledger leaves almost nothing, so the new states are refused, not paid for
    server.reset_counts()
    second = await replay_trace(
        make_states(8), teachers, max_total_usd=spent * 1.01, cache_dir=tmp_path
    )
    assert [r["cached"] for r in second[:4]] == [True] * 4
    assert all((r["error"] or "").startswith("budget_exceeded") for r in second[4:])
    assert server.request_count == 0
    from composer_replication.traces.teacher_replay.cache import ReplayCache

    ledger = ReplayCache(tmp_path)
    assert abs(ledger.prior_spend_nanos / 1e9 - spent) < 1e-9
    ledger.close()
