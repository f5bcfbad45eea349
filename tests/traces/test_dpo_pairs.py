"""`extract_dpo_pairs` and `save_pairs`: agreement rules and JSONL output."""

from __future__ import annotations

import json

import pytest

from composer_replication.teacher_replay import (
    extract_dpo_pairs,
    normalize_action,
    read_jsonl,
    save_pairs,
    write_jsonl,
)

MESSAGES = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"}]


def state(sid: str, student: str) -> dict:
    return {"state_id": sid, "messages": MESSAGES, "student_action": student}


def row(sid: str, slug: str, text: str | None, error: str | None = None) -> dict:
    return {
        "state_id": sid,
        "teacher_slug": slug,
        "response_text": text,
        "latency_s": 0.1,
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "cost_usd": 0.0,
        "error": error,
    }


def test_majority_against_the_student_makes_one_pair():
    states = [state("s0", "rm -rf build")]
    rows = [
        row("s0", "a", "Run the tests:\n\n  pytest -q"),
        row("s0", "b", "Run the tests: pytest   -q "),
        row("s0", "c", "something else"),
    ]
    assert extract_dpo_pairs(states, rows) == [
        {
            "state_id": "s0",
            "state_messages": MESSAGES,
            "chosen": "Run the tests:\n\n  pytest -q",  # the first agreeing original text
            "rejected": "rm -rf build",
            "n_teachers_agreeing": 2,
        }
    ]


def test_no_pair_when_the_winner_equals_the_student_or_too_few_agree():
    rows = [row("s0", "a", "ls  -la"), row("s0", "b", "ls -la\n")]
    assert extract_dpo_pairs([state("s0", " ls -la")], rows) == []
    assert extract_dpo_pairs([state("s0", "pwd")], rows, agreement_threshold=3) == []
    assert len(extract_dpo_pairs([state("s0", "pwd")], rows, agreement_threshold=2)) == 1


@pytest.mark.parametrize(
    ("open_", "close"), [("[THINKING]", "[/THINKING]"), ("<thinking>", "</thinking>")]
)
def test_thinking_alone_does_not_make_the_student_differ(open_, close):
    student = f"{open_}\nthe file is small\n{close}\n\nls -la"
    rows = [row("s0", "a", "ls -la"), row("s0", "b", "ls -la")]
    assert extract_dpo_pairs([state("s0", student)], rows) == []
    differing = f"{open_}\nhmm\n{close}\n\npwd"
    (pair,) = extract_dpo_pairs([state("s0", differing)], rows)
    assert pair["rejected"] == differing  # rejected keeps the student's text as it was


def test_errors_do_not_vote_ties_go_to_teacher_order_and_state_order_is_kept():
    states = [state("s1", "x"), state("s0", "x")]
    rows = [
        row("s0", "a", "alpha"),
        row("s0", "b", "beta"),
        row("s0", "c", "alpha"),
        row("s0", "d", "beta"),  # 2-2 tie: "alpha" came first
        row("s1", "a", "gamma"),
        row("s1", "b", None, error="timeout: 1 s"),
        row("s1", "c", "gamma"),
        row("unknown", "a", "zeta"),
        row("unknown", "b", "zeta"),
    ]
    pairs = extract_dpo_pairs(states, rows)
    assert [(p["state_id"], p["chosen"], p["n_teachers_agreeing"]) for p in pairs] == [
        ("s1", "gamma", 2),
        ("s0", "alpha", 2),
    ]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_threshold_is_validated(bad):
    with pytest.raises(ValueError, match="agreement_threshold"):
        extract_dpo_pairs([], [], agreement_threshold=bad)


def test_save_pairs_writes_jsonl_atomically(tmp_path):
    pairs = extract_dpo_pairs(
        [state("s0", "wrong")], [row("s0", "a", "right ✓"), row("s0", "b", "right ✓")]
    )
    target = tmp_path / "deep" / "dir" / "pairs.jsonl"
    assert save_pairs(pairs, target) == target
    assert list(read_jsonl(target)) == pairs
    assert "✓" in target.read_text(encoding="utf-8")  # UTF-8, not \\u escapes
    assert [p.name for p in target.parent.iterdir()] == ["pairs.jsonl"]  # no temp left

    def broken_rows():
        yield {"state_id": "new"}
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_jsonl(broken_rows(), target)
    assert list(read_jsonl(target)) == pairs  # the old file is intact
    assert [p.name for p in target.parent.iterdir()] == ["pairs.jsonl"]


def test_normalize_action_and_read_jsonl_errors(tmp_path):
    assert normalize_action("  a\n\tb   c \n") == "a b c"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n\n{broken\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3"):
        list(read_jsonl(bad))
    with pytest.raises(FileNotFoundError):
        list(read_jsonl(tmp_path / "missing.jsonl"))
    assert json.loads('{"a": 1}') == next(read_jsonl(bad))
