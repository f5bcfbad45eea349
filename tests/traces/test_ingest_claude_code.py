"""`ingestion.claude_code`: real-format session fixtures in, exact states and counters out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trace_helpers import CALC, MAIN_SESSION, PROJECTS

from composer_replication.ingestion import (
    SYSTEM_PROMPT,
    ClaudeCodeIngester,
    IngestionStats,
    estimate_tokens,
)
from composer_replication.ingestion.history import MESSAGE_OVERHEAD_TOKENS

COMPACT = CALC / "2b7d3c41-6c2e-4d4f-8b80-1e3f5c7d9b21.jsonl"
BROKEN = CALC / "3c9e5d02-7d3f-4e50-9c91-2f406d8eac32.jsonl"
REWIND = CALC / "4d1a8f63-8e40-4f61-ad02-305170e9bd43.jsonl"
SIDECHAIN = CALC / "5e2b9a74-9f51-4072-be13-4162810fce54.jsonl"
AGENT = CALC / "agent-7a4d1c96.jsonl"

# the project's one tool-call format (the agent loop parses these as calls)
READ_CALL = (
    '<tool_call>{"name": "Read", "arguments": {"file_path": "/home/dev/calc/calc.py"}}</tool_call>'
)


def ingest(path: Path, **kw) -> tuple[list[dict], IngestionStats]:
    ingester = ClaudeCodeIngester(**kw)
    states = list(ingester.ingest(path))
    return states, ingester.last_stats


def test_one_state_per_turn_with_multi_record_messages_merged():
    states, stats = ingest(MAIN_SESSION)
    # msg_01..msg_08; the synthetic message and the repeated record add none.
    assert [s["state_id"] for s in states] == [f"{MAIN_SESSION.stem}::{i:04d}" for i in range(8)]
    first = states[0]
    assert first["messages"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {
            "role": "user",
            "content": "The tests fail on division by zero. Please make divide() raise "
            "ValueError when b is 0.",
        },
    ]
    # three records of msg_01 (thinking, text, tool_use) form one action, thinking kept
    assert first["student_action"] == (
        "[THINKING]\nLet me read calc.py before changing anything.\n[/THINKING]\n\n"
        f"I'll look at calc.py first.\n\n{READ_CALL}"
    )
    assert first["source"]["session_id"] == "1f0c7a2e-5b1d-4c3e-9a7f-0d2e4b6c8a10"
    assert first["source"]["message_id"] == "msg_01"
    assert stats.n_assistant_turns == 8 and stats.n_states_emitted == 8
    assert stats.n_tool_use_blocks == 8 and stats.n_text_blocks == 4
    assert stats.n_thinking_blocks == 1 and stats.n_tool_results == 7


def test_history_renders_tool_calls_and_results_and_strips_thinking():
    states, _ = ingest(MAIN_SESSION)
    second = states[1]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][2]["content"] == f"I'll look at calc.py first.\n\n{READ_CALL}"
    assert second["messages"][3]["content"].startswith('<tool_result name="Read">\ndef add(a, b):')
    assert second["messages"][3]["content"].endswith("return a / b\n\n</tool_result>")
    assert "[THINKING]" not in json.dumps(second["messages"])
    kept, _ = ingest(MAIN_SESSION, strip_thinking=False)
    assert kept[1]["messages"][2]["content"].startswith("[THINKING]\nLet me read calc.py")


def test_parallel_tool_calls_written_between_blocks_stay_one_turn():
    states, _ = ingest(MAIN_SESSION)
    # msg_04 = Read + Grep, each result written before the next block of the same message
    assert states[3]["student_action"] == (
        f'{READ_CALL}\n\n<tool_call>{{"name": "Grep", "arguments": {{"path": ".", "pattern": "divide"}}}}</tool_call>'
    )
    after = states[4]["messages"]
    assert after[-2]["content"] == states[3]["student_action"]
    results = after[-1]["content"]
    assert results.index('<tool_result name="Read">') < results.index('<tool_result name="Grep">')
    assert "calc.py:5:def divide(a, b):" in results


def test_error_sites_mark_the_state_after_the_failing_result():
    states, stats = ingest(MAIN_SESSION)
    sites = {i: s.get("error_site") for i, s in enumerate(states)}
    # pytest failure text (no is_error flag) -> classified by hint_generator
    assert sites[2]["kind"] == "runtime_error" and sites[2]["tool_name"] == "Bash"
    assert sites[2]["is_error"] is False and "1 failed, 1 passed" in sites[2]["message"]
    # is_error flagged; "<tool_use_error>..." matches no rule -> runtime_error
    assert sites[3] == {
        "kind": "runtime_error",
        "message": "<tool_use_error>File has been modified since read, either by the user or "
        "by a linter. Read it again before attempting to write it.</tool_use_error>",
        "tool_name": "Edit",
        "is_error": True,
    }
    # a Read result, the passing test run and the first turn: no error site
    assert all(sites[i] is None for i in (0, 1, 4, 5, 6, 7))
    assert stats.n_error_sites == 2
    # the rendered history marks the flagged result
    assert '<tool_result name="Edit" error="true">' in states[3]["messages"][-1]["content"]


def test_bookkeeping_records_are_skipped_and_counted():
    _, stats = ingest(MAIN_SESSION)
    assert stats.n_records_total == 28
    assert stats.skipped_summary == 1 and stats.skipped_snapshot == 1
    # isMeta caveat, stop-hook system record, synthetic assistant, queue-operation, repeat
    assert stats.skipped_other == 5
    assert stats.n_records_skipped == 7
    assert stats.version_warnings == [] and stats.warnings == []


def test_compact_boundary_resets_the_history_to_the_summary():
    states, stats = ingest(COMPACT)
    assert len(states) == 4 and stats.n_compact_boundaries == 1
    after = states[2]["messages"]
    assert len(after) == 2 and after[1]["content"].startswith("This session is being continued")
    assert "Add a --verbose flag" not in json.dumps(after)
    assert (
        states[3]["messages"][-1]["content"]
        == '<tool_result name="Bash">\nverbose mode on\n</tool_result>'
    )


def test_broken_file_is_counted_never_raised():
    states, stats = ingest(BROKEN)
    assert [s["student_action"] for s in states] == ["Hello from the future."]
    assert stats.n_records_total == 9
    # corrupt JSON, latin-1 bytes, a JSON array, a user without message, content=5
    assert stats.skipped_malformed_lines == 5
    assert stats.skipped_unknown_type == 1 and stats.skipped_truncated_lines == 1
    assert stats.n_records_skipped == 7
    assert len(stats.version_warnings) == 1 and "'9.1.0'" in stats.version_warnings[0]
    assert any("x-future-record" in w for w in stats.warnings)


def test_rewind_keeps_only_the_branch_of_each_state():
    states, stats = ingest(REWIND)
    assert [s["student_action"] for s in states] == [
        'Renaming.\n\n<tool_call>{"name": "Edit", "arguments": {"file_path": "utils.py", '
        '"new_string": "def bar", "old_string": "def foo"}}</tool_call>',
        "Renamed foo to bar.",
        "Updated the README.",
        "Updated the CHANGELOG.",
    ]
    assert states[2]["messages"][-1]["content"] == "Also update the README."
    last = json.dumps(states[3]["messages"])
    assert "Actually, update the CHANGELOG instead." in last
    assert "README" not in last
    assert stats.n_rewinds == 1


def test_sidechain_records_and_agent_files():
    states, stats = ingest(SIDECHAIN)
    assert len(states) == 2 and stats.skipped_subagent == 4
    assert states[1]["messages"][-1]["content"] == (
        '<tool_result name="Task">\nFound 2 TODOs: a.py:3, b.py:9\n</tool_result>'
    )
    # kept: the sidechain is its own conversation, not mixed into the main history
    kept, kept_stats = ingest(SIDECHAIN, skip_sidechain=False)
    assert len(kept) == 4 and kept_stats.skipped_subagent == 0
    side = [s for s in kept if s["source"]["message_id"].startswith("msg_side")]
    assert side[0]["messages"][1]["content"] == "Search the repo for TODO comments."
    assert "Find all TODO comments." not in json.dumps(side[1]["messages"])
    # an agent file given directly: skipped (with a warning) unless sidechains are kept
    none, agent_stats = ingest(AGENT)
    assert none == [] and agent_stats.skipped_subagent_files == 1
    agent_states, _ = ingest(AGENT, skip_sidechain=False)
    assert [s["student_action"] for s in agent_states][-1] == "One test file: test_calc.py"


def test_directory_ingest_walks_projects_and_skips_agent_files():
    states, stats = ingest(PROJECTS)
    assert stats.n_files == 6  # five sessions + the empty file; agent file skipped
    assert stats.skipped_subagent_files == 1
    assert len(states) == 8 + 4 + 1 + 4 + 2
    assert any(w.endswith("empty file") for w in stats.warnings)
    assert len({s["state_id"] for s in states}) == len(states)
    with_agents, _ = ingest(PROJECTS, skip_sidechain=False)
    assert len(with_agents) == len(states) + 2 + 2  # agent file + in-file sidechain


def test_folder_without_sessions_and_missing_path(tmp_path):
    states, stats = ingest(PROJECTS / "-home-dev-empty")
    assert states == [] and stats.n_files == 0
    assert stats.warnings == [f"{PROJECTS / '-home-dev-empty'}: no session files (*.jsonl) found"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ClaudeCodeIngester().ingest(tmp_path / "nope")


def test_last_stats_is_replaced_per_call():
    ingester = ClaudeCodeIngester()
    list(ingester.ingest(MAIN_SESSION))
    first = ingester.last_stats
    list(ingester.ingest(COMPACT))
    assert ingester.last_stats is not first and ingester.last_stats.n_states_emitted == 4
    assert first.n_states_emitted == 8


def _long_session(path: Path, n_turns: int) -> None:
    lines = []
    parent = None
    for i in range(n_turns):
        uid = f"u{i}"
        lines.append(
            {
                "type": "user",
                "uuid": uid,
                "parentUuid": parent,
                "version": "2.0.0",
                "message": {"role": "user", "content": f"question {i} " + "word " * 50},
            }
        )
        lines.append(
            {
                "type": "assistant",
                "uuid": f"a{i}",
                "parentUuid": uid,
                "version": "2.0.0",
                "message": {
                    "id": f"m{i}",
                    "role": "assistant",
                    "content": [{"type": "text", "text": f"answer {i} " + "x" * 400}],
                },
            }
        )
        parent = f"a{i}"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _context_tokens(messages: list[dict], count=estimate_tokens) -> int:
    return sum(count(m["content"]) + MESSAGE_OVERHEAD_TOKENS for m in messages)


def test_max_history_tokens_drops_the_oldest_history(tmp_path):
    session = tmp_path / "long.jsonl"
    _long_session(session, 30)
    full, _ = ingest(session)
    budget = 1200
    states, stats = ingest(session, max_history_tokens=budget)
    assert len(states) == 30
    last, last_full = states[-1], full[-1]
    assert _context_tokens(last_full["messages"]) > budget  # the limit really bites
    assert _context_tokens(last["messages"]) <= budget
    assert last["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert last["messages"][-1]["content"].startswith("question 29 ")  # latest user turn
    assert last["messages"][1]["role"] == "user"  # the context opens with a user turn
    # what is kept is the newest suffix of the full history
    kept = last["messages"][1:]
    assert last_full["messages"][-len(kept) :] == kept
    assert last["source"]["n_history_dropped"] == len(last_full["messages"]) - len(last["messages"])
    assert stats.n_truncated_states > 0 and states[0]["source"]["n_history_dropped"] == 0


def test_max_history_tokens_never_drops_the_latest_user_turn(tmp_path):
    session = tmp_path / "long.jsonl"
    _long_session(session, 3)
    states, _ = ingest(session, max_history_tokens=5)
    assert [m["role"] for m in states[-1]["messages"]] == ["system", "user"]
    assert states[-1]["messages"][1]["content"].startswith("question 2 ")


def test_custom_token_counter_is_used(tmp_path):
    session = tmp_path / "long.jsonl"
    _long_session(session, 10)
    calls = []

    def chars(text: str) -> int:
        calls.append(text)
        return len(text)

    states, _ = ingest(session, max_history_tokens=2500, token_counter=chars)
    assert calls and _context_tokens(states[-1]["messages"], chars) <= 2500
    with pytest.raises(ValueError, match="max_history_tokens"):
        ClaudeCodeIngester(max_history_tokens=0)


@pytest.mark.slow
def test_hf_tokenizer_counter_truncates_with_real_token_counts(tmp_path):
    from composer_replication.ingestion import hf_token_counter
    from composer_replication.model.loading import load_tokenizer

    tokenizer = load_tokenizer()
    count = hf_token_counter(tokenizer)
    session = tmp_path / "long.jsonl"
    _long_session(session, 20)
    states, stats = ingest(session, max_history_tokens=1500, token_counter=count)
    assert stats.n_truncated_states > 0
    assert _context_tokens(states[-1]["messages"], count) <= 1500


# Records built from the real vocabulary, with any field possibly of the wrong type.
_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "thinking", "tool_use", "tool_result", "image", "odd"])},
    optional={
        "text": _ANY,
        "thinking": _ANY,
        "id": _ANY,
        "name": _ANY,
        "input": _ANY,
        "tool_use_id": _ANY,
        "content": _ANY,
        "is_error": _ANY,
    },
)
_RECORD = st.fixed_dictionaries(
    {"type": st.sampled_from(["user", "assistant", "system", "summary", "progress", "zzz"])},
    optional={
        "uuid": st.sampled_from(["a", "b", "c", "d"]) | _ANY,
        "parentUuid": st.sampled_from(["a", "b", "c", None]) | _ANY,
        "isSidechain": st.booleans() | _ANY,
        "isMeta": _ANY,
        "version": st.sampled_from(["2.0.61", "0.1", "9.9.9"]) | _ANY,
        "subtype": st.sampled_from(["compact_boundary", "x"]),
        "message": st.fixed_dictionaries(
            {},
            optional={
                "id": st.sampled_from(["m1", "m2"]) | _ANY,
                "model": _ANY,
                "content": st.lists(_BLOCK, max_size=3) | _ANY,
            },
        )
        | _ANY,
    },
)
_LINE = _RECORD.map(lambda r: json.dumps(r).encode()) | st.binary(max_size=20)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(_LINE, max_size=12), newline=st.booleans())
def test_any_input_is_counted_never_raised(tmp_path, lines, newline):
    session = tmp_path / "fuzz.jsonl"
    session.write_bytes(b"\n".join(lines) + (b"\n" if newline else b""))
    ingester = ClaudeCodeIngester(max_history_tokens=50)
    states = list(ingester.ingest(session))
    stats = ingester.last_stats
    skipped = sum(
        getattr(stats, f)
        for f in vars(stats)
        if f.startswith("skipped_") and f != "skipped_subagent_files"
    )
    assert stats.n_records_skipped == skipped
    assert stats.n_records_total == sum(
        bool(line.strip()) for line in b"\n".join(lines).split(b"\n")
    )
    assert len(states) == stats.n_states_emitted <= stats.n_assistant_turns
    for s in states:
        assert s["messages"][0]["role"] == "system" and isinstance(s["student_action"], str)
        json.dumps(s)  # JSON-able, ready for the states file


def test_system_prompt_and_thinking_marker_as_documented():
    from composer_replication import SYSTEM_PROMPT as top_level
    from composer_replication.ingestion.claude_code import SYSTEM_PROMPT as documented

    assert top_level is documented is SYSTEM_PROMPT
    print(SYSTEM_PROMPT[:60])
    assert SYSTEM_PROMPT.startswith(
        "You are a senior software engineer working as a coding agent in a terminal environment"
    )
    states, _ = ingest(MAIN_SESSION)
    # the documented marker: [THINKING] blocks stay inside student_action ...
    assert states[0]["student_action"].startswith("[THINKING]\n")
    # ... and leave the history handed to teachers (strip_thinking=True by default)
    assert all("[THINKING]" not in m["content"] for s in states for m in s["messages"])
