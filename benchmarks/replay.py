"""Teacher-replay benchmark: `replay_trace` throughput, budget and cache, on a local server.

Run: ``python benchmarks/replay.py`` (about 15 seconds). 200 states x 3 teachers are
replayed against `LocalOpenAIServer` answering every request after a fixed 200 ms, at
concurrency 32. The server runs in its own process (``python -m composer_replication.
testing``), so it does not share the client's interpreter lock; ``--in-process`` runs it in
a thread instead. Printed:

- the wall time of `replay_trace` against the ideal ceil(calls / concurrency) x latency,
  as a ratio (goal <= 1.25x), next to a naive peer (bare httpx calls under an
  `asyncio.Semaphore`, no budget, retries or cache) on the same server;
- the spend against the cap and the measured overshoot (must be 0);
- a second run on the same cache: the requests it made (must be 0) and its time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from composer_replication.teacher_replay import replay_trace
from composer_replication.testing import LocalOpenAIServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, check_number, check_seconds


def make_states(n: int) -> list[dict]:
    task = "Fix the failing test in calc.py; run pytest afterwards. " * 8
    return [
        {
            "state_id": f"bench::{i:04d}",
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"[{i}] {task}"},
            ],
            "student_action": "pytest -q",
        }
        for i in range(n)
    ]


async def naive_peer(base_url: str, states: list[dict], teachers: list[dict], concurrency: int):
    """The floor: the same requests, bare httpx under a semaphore."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one(state: dict, teacher: dict) -> None:
            async with gate:
                body = {"model": teacher["slug"], "messages": state["messages"], "max_tokens": 256}
                response = await client.post(f"{base_url}/chat/completions", json=body)
                response.raise_for_status()

        await asyncio.gather(*(one(s, t) for s in states for t in teachers))


@contextlib.contextmanager
def local_server(latency: float, in_process: bool) -> Iterator[tuple[str, Callable[[], dict]]]:
    """(base_url, stats()) of a local server, in a thread or in a child process."""
    if in_process:
        with LocalOpenAIServer(latency_s=latency) as server:
            yield (
                server.base_url,
                lambda: {
                    "requests": server.request_count,
                    "max_in_flight": server.max_in_flight,
                },
            )
        return
    cmd = [sys.executable, "-m", "composer_replication.testing", "--latency", str(latency)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        base_url = proc.stdout.readline().strip()
        if not base_url.startswith("http"):
            raise SystemExit(f"the server did not start: {base_url!r}")
        root = base_url.removesuffix("/v1")
        yield base_url, lambda: httpx.get(f"{root}/_stats").json()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=200)
    parser.add_argument("--teachers", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-usd", type=float, default=5.0)
    parser.add_argument("--in-process", action="store_true", help="serve from a thread")
    args = parser.parse_args()
    check_count(args.states, "--states", what="states")
    check_count(args.teachers, "--teachers", what="teachers")
    check_seconds(args.latency, "--latency")
    check_count(args.concurrency, "--concurrency", what="calls in flight")
    check_number(args.max_usd, "--max-usd", above=True, what="a spending cap in USD")

    states = make_states(args.states)
    calls = args.states * args.teachers
    ideal = math.ceil(calls / args.concurrency) * args.latency
    server = local_server(args.latency, args.in_process)
    with server as (base_url, stats), tempfile.TemporaryDirectory() as cache:
        teachers = [
            {
                "slug": f"local/t{j}",
                "input_per_mtok": 5.0,
                "output_per_mtok": 25.0,
                "base_url": base_url,
            }
            for j in range(args.teachers)
        ]
        start = time.perf_counter()
        asyncio.run(naive_peer(base_url, states, teachers, args.concurrency))
        naive_s = time.perf_counter() - start

        def run() -> tuple[float, int, Any]:
            before = stats()["requests"]
            start = time.perf_counter()
            rows = asyncio.run(
                replay_trace(
                    states,
                    teachers,
                    args.max_usd,
                    concurrency=args.concurrency,
                    cache_dir=cache,
                    max_tokens=256,
                )
            )
            return time.perf_counter() - start, stats()["requests"] - before, rows

        first_s, first_requests, first = run()
        second_s, second_requests, second = run()
        peak = stats()["max_in_flight"]

    s1, s2 = first.summary, second.summary
    where = "a thread" if args.in_process else "its own process"
    print(
        f"replay: {args.states} states x {args.teachers} teachers = {calls} calls, "
        f"latency {args.latency * 1000:.0f} ms, concurrency {args.concurrency}, "
        f"server in {where}"
    )
    print(f"ideal ceil({calls}/{args.concurrency}) x {args.latency:g} s = {ideal:.2f} s")
    print(f"naive httpx + semaphore : {naive_s:6.2f} s  ({naive_s / ideal:.3f}x ideal)")
    print(
        f"replay_trace (run 1)    : {first_s:6.2f} s  ({first_s / ideal:.3f}x ideal, "
        f"{first_s / naive_s:.3f}x naive)  requests {first_requests}, "
        f"ok {s1.n_ok}/{s1.n_rows}, peak in flight {peak}"
    )
    print(
        f"  spend ${s1.spend_usd:.6f} of cap ${args.max_usd:g}; overshoot ${s1.overshoot_usd:.6f}; "
        f"within cap: {s1.spend_usd <= args.max_usd}; latency p50 {s1.latency_p50_s:.3f} s, "
        f"p95 {s1.latency_p95_s:.3f} s"
    )
    print(
        f"replay_trace (run 2, cache): {second_s:6.3f} s  requests made {second_requests}, "
        f"cache hits {s2.n_cache_hits}/{s2.n_rows}, spend ${s2.spend_usd:.6f}"
    )
    if s1.overshoot_usd != 0 or s1.spend_usd > args.max_usd or second_requests != 0:
        raise SystemExit("FAILED: overspend or cache misses")


if __name__ == "__main__":
    main()
