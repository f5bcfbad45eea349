"""``episode_metrics``: what a set of real agent episodes did, as exact metrics.

The episodes run through the real agent loop (``run_agent_rollouts``) with a
``ScriptedSampler`` writing fixed replies and small real tools, one episode per way an
episode can go: finished, a malformed call then a call, a tool error, a plain answer, the
turn limit, a broken tool and a reply cut off by its budget.
"""

from __future__ import annotations

import pytest

from composer_replication.rollout.agent import (
    END_REASONS,
    Episode,
    ScriptedSampler,
    episode_metrics,
    run_agent_rollouts,
)
from composer_replication.rollout.tool_calls import ToolError, format_tool_call
from composer_replication.samples.generation import SamplingSettings
from composer_replication.samples.rollouts import Rollout

PROMPT = [
    {"role": "system", "content": "You use tools."},
    {"role": "user", "content": "Echo something."},
]
SAMPLING = SamplingSettings(max_new_tokens=48)
MALFORMED = '<tool_call>{"name": "echo"</tool_call>'


def echo(state, arguments):
    return f"echo: {sorted(arguments.items())}"


def fail(state, arguments):
    raise ToolError("no such file: x.py", "path_error")


def boom(state, arguments):
    raise RuntimeError("sandbox vanished")


def finish(state, arguments):
    return "done"


TOOLS = {"echo": echo, "fail": fail, "boom": boom, "finish": finish}

# task id -> the replies its episode writes (a script that runs out answers with eos)
SCRIPTS = {
    "finished": [format_tool_call("echo", {"a": 1}), format_tool_call("finish")],
    "malformed_then_call": [MALFORMED, format_tool_call("echo", {"b": 2})],
    "tool_error": [format_tool_call("fail"), format_tool_call("echo", {"c": 3})],
    "answer": ["All done."],
    "turn_limit": [format_tool_call("echo", {"i": i}) for i in range(5)],
    "broken_tool": [format_tool_call("boom")],
    "cut_off": ["word " * 100],  # longer than the reply budget and no call: truncated
}


@pytest.fixture(scope="module")
def episodes(tokenizer) -> dict[str, Rollout]:
    sampler = ScriptedSampler(tokenizer, list(SCRIPTS.values()))
    rollouts = run_agent_rollouts(
        None,
        tokenizer,
        [Episode(task_id, list(PROMPT), None) for task_id in SCRIPTS],
        sampling=SAMPLING,
        max_turns=3,
        tools=TOOLS,
        sample_fn=sampler,
    )
    return {r.task_id: r for r in rollouts}


def test_the_episodes_went_as_scripted(episodes):
    got = {
        task_id: (r.metadata["end_reason"], r.metadata["turns"], r.metadata["tool_calls"])
        for task_id, r in episodes.items()
    }
    assert got == {
        "finished": ("finish", 2, 2),
        "malformed_then_call": ("answer", 3, 1),
        "tool_error": ("answer", 3, 2),
        "answer": ("answer", 1, 0),
        "turn_limit": ("turn_limit", 3, 3),
        "broken_tool": ("sandbox_error", 1, 1),
        "cut_off": ("truncated", 1, 0),
    }
    events = episodes["malformed_then_call"].metadata["events"]
    assert [(e["turn"], e["type"]) for e in events] == [
        (1, "parse_error"),
        (2, "tool_call"),
        (3, "answer"),
    ]


def test_every_metric_has_its_exact_value(episodes):
    rollouts = list(episodes.values())
    metrics = episode_metrics(rollouts)
    n = 7
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts) / n
    episode_s = sum(r.metadata["episode_s"] for r in rollouts) / n
    tool_s = sum(r.metadata["tool_s"] for r in rollouts) / n
    expected = {
        "agent/turns_mean": (2 + 3 + 3 + 1 + 3 + 1 + 1) / n,
        "agent/tool_calls_mean": (2 + 1 + 2 + 0 + 3 + 1 + 0) / n,
        "agent/episode_tokens_mean": tokens,
        # the failing ToolError call and the broken tool's call
        "agent/tool_errors": 2.0,
        "agent/parse_failures": 1.0,
        "agent/call_attempts": 10.0,  # 9 calls that ran + 1 malformed reply
        # 1 malformed reply / (9 calls that ran + 1 malformed reply)
        "agent/parse_failure_rate": 0.1,
        "agent/episode_s_mean": episode_s,
        "agent/tool_s_mean": tool_s,
        "agent/end/answer": 3 / n,
        "agent/end/finish": 1 / n,
        "agent/end/truncated": 1 / n,
        "agent/end/turn_limit": 1 / n,
        "agent/end/token_limit": 0.0,
        "agent/end/sandbox_error": 1 / n,
        "agent/end/render_error": 0.0,
        # calls that ran, failed ones included: finish is a call too
        "agent/calls/boom": 1.0,
        "agent/calls/echo": 6.0,
        "agent/calls/fail": 1.0,
        "agent/calls/finish": 1.0,
    }
    assert metrics.keys() == expected.keys()
    assert metrics == pytest.approx(expected, rel=1e-12, abs=0)
    assert sum(metrics[f"agent/end/{reason}"] for reason in END_REASONS) == pytest.approx(1.0)
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["agent/episode_s_mean"] > 0 and metrics["agent/tool_s_mean"] > 0


def test_the_prefix_is_applied_to_every_key(episodes):
    rollouts = list(episodes.values())
    plain = episode_metrics(rollouts)
    held_out = episode_metrics(rollouts, prefix="heldout/agent/")
    assert held_out == {
        "heldout/agent/" + key.removeprefix("agent/"): value for key, value in plain.items()
    }
    assert episode_metrics(rollouts, prefix="") == {
        key.removeprefix("agent/"): value for key, value in plain.items()
    }


def test_single_turn_rollouts_give_no_metrics_and_do_not_count(episodes):
    single = Rollout(
        task_id="f",
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        inference_logprobs=[-0.1, -0.2],
        reward=1.0,
        metadata={"turns": 9, "events": [{"type": "parse_error", "turn": 1}]},
    )
    assert episode_metrics([single]) == {}
    assert episode_metrics([]) == {}
    only_the_episodes = episode_metrics(list(episodes.values()))
    assert episode_metrics([single, *episodes.values(), single]) == only_the_episodes


def test_a_subset_counts_only_its_own_episodes(episodes):
    subset = [episodes["finished"], episodes["answer"]]
    metrics = episode_metrics(subset, prefix="")
    assert metrics["turns_mean"] == 1.5
    assert metrics["tool_calls_mean"] == 1.0
    assert metrics["end/finish"] == metrics["end/answer"] == 0.5
    assert metrics["parse_failures"] == 0.0 and metrics["parse_failure_rate"] == 0.0
    assert metrics["tool_errors"] == 0.0
    assert {k: v for k, v in metrics.items() if k.startswith("calls/")} == {
        "calls/echo": 1.0,
        "calls/finish": 1.0,
    }
    # one malformed reply beside one call that ran: half the attempts failed to parse
    alone = episode_metrics([episodes["malformed_then_call"]], prefix="")
    assert alone["parse_failure_rate"] == 0.5
    assert episode_metrics([episodes["answer"]], prefix="")["parse_failure_rate"] == 0.0


def _merged_over_two_ranks(episodes) -> tuple[dict, dict]:
    """A data-parallel step's agent metrics (two ranks' rows merged) and one process's."""
    from composer_replication.distributed.data_parallel import merge_rollout_stats

    rollouts = list(episodes.values())
    rank0, rank1 = rollouts[:4], rollouts[4:]
    rows = [
        {"rollouts/count": float(len(share)), **episode_metrics(share)} for share in (rank0, rank1)
    ]
    return merge_rollout_stats(rows), episode_metrics(rollouts)


def test_two_ranks_episode_metrics_merge_as_one_process_reports_them(episodes):
    merged, whole = _merged_over_two_ranks(episodes)
    assert set(whole) <= set(merged)
    rate = "agent/parse_failure_rate"
    assert {k: merged[k] for k in whole if k != rate} == pytest.approx(
        {k: v for k, v in whole.items() if k != rate}, rel=1e-12, abs=0
    )


def test_two_ranks_parse_failure_rate_is_over_all_attempts(episodes):
    merged, whole = _merged_over_two_ranks(episodes)
    assert whole["agent/parse_failure_rate"] == 0.1
    assert merged["agent/parse_failure_rate"] == pytest.approx(0.1, rel=1e-12)
