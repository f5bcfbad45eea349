"""FeatureDeletion building blocks without a sandbox: candidates, stubs, references, files."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from composer_replication.envs.fd_tasks import (
    STUB_EXCEPTION,
    FDTask,
    TaskReference,
    apply_reference,
    find_candidates,
    make_stub,
    make_task_id,
    read_jsonl_records,
    slug,
    write_heldout_tasks,
    write_references,
    write_tasks,
)
from composer_replication.safety.holdout import HeldoutLeakError, HeldoutSplit

FD_REPO = Path(__file__).resolve().parents[1] / "fixtures" / "fd_repo"

MODULE = textwrap.dedent(
    '''\
    """A module."""


    def one_liner(): return 1


    def documented(x):
        """Doc stays."""
        # a comment inside the body goes with it
        y = x + 1
        return y


    def commented(a,
                  b):
        # leading comment belongs to the body

        return a + b


    def already_stub():
        """Nothing to delete."""
        ...


    def raises_stub():
        raise NotImplemented'''
    + '''Error("later")


    def docstring_only():
        """Only a docstring."""


    async def fetch(n):
        await something()
        return n


    def outer():
        def inner():
            return 2
        return inner()


    class Thing:
        def __init__(self):
            self.x = 1

        @property
        def value(self):
            return self.x

        class Nested:
            def deep(self):
                return "deep"
    '''
)


def test_find_candidates_in_the_fixture_repo() -> None:
    found = [(c.file, c.qualname) for c in find_candidates(FD_REPO)]
    assert found == [
        ("textkit/formatters.py", "register"),
        ("textkit/formatters.py", "shout"),
        ("textkit/formatters.py", "whisper"),
        ("textkit/formatters.py", "render"),
        ("textkit/stats.py", "mean"),
        ("textkit/stats.py", "median"),
        ("textkit/stats.py", "variance"),
        ("textkit/words.py", "word_count"),
        ("textkit/words.py", "normalize_whitespace"),
        ("textkit/words.py", "is_palindrome"),
        ("textkit/words.py", "reverse_words"),
        ("textkit/words.py", "WordCounter.add"),
        ("textkit/words.py", "WordCounter.most_common"),
    ]


def test_candidate_spans_and_skips(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(MODULE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text("def helper():\n    return 1\n")
    found = {c.qualname: c for c in find_candidates(tmp_path)}
    assert sorted(found) == [
        "Thing.Nested.deep",
        "Thing.value",
        "commented",
        "documented",
        "fetch",
        "outer",
    ]
    lines = MODULE.splitlines()
    doc = found["documented"]
    assert lines[doc.body_start - 1].strip() == "# a comment inside the body goes with it"
    assert lines[doc.body_end - 1].strip() == "return y"
    com = found["commented"]
    assert lines[com.body_start - 1].strip() == "# leading comment belongs to the body"
    assert lines[com.header_start - 1].startswith("def commented(a,")
    assert lines[found["Thing.value"].header_start - 1].strip() == "@property"
    assert found["Thing.value"].indent == " " * 8


def test_stub_then_reference_restores_the_file_byte_for_byte(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(MODULE)
    cand = next(c for c in find_candidates(tmp_path) if c.qualname == "documented")
    ref = make_stub(tmp_path, cand)
    stubbed = (tmp_path / "mod.py").read_text()
    assert ref.stub == f"    raise {STUB_EXCEPTION}('documented was removed; restore it')\n"
    assert '"""Doc stays."""' in stubbed and "y = x + 1" not in stubbed
    assert ref.body == "    # a comment inside the body goes with it\n    y = x + 1\n    return y\n"
    assert (ref.start_line, ref.end_line) == (cand.body_start, cand.body_start)
    apply_reference(tmp_path, ref)
    assert (tmp_path / "mod.py").read_text() == MODULE


def test_apply_reference_refuses_a_moved_stub(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(MODULE)
    cand = next(c for c in find_candidates(tmp_path) if c.qualname == "fetch")
    ref = make_stub(tmp_path, cand)
    shifted = TaskReference(**{**ref.to_json(), "start_line": 1, "end_line": 1})
    with pytest.raises(ValueError, match="not the task stub"):
        apply_reference(tmp_path, shifted)


def _task(task_id: str, split: str = "train") -> FDTask:
    return FDTask(
        task_id=task_id,
        repo="r",
        file="a.py",
        qualname="f",
        target_tests=("t::a",),
        passing_tests=("t::a", "t::b"),
        prompt="p",
        files=("a.py",),
        workdir="/w",
        test_command="python -m pytest -q",
        split=split,
    )


def test_task_and_reference_json_roundtrip() -> None:
    task = _task("fd:r:a.py:f")
    assert FDTask.from_json(json.loads(json.dumps(task.to_json()))) == task
    ref = TaskReference("fd:r:a.py:f", "a.py", 3, 3, "stub\n", "body\n")
    assert TaskReference.from_json(ref.to_json()) == ref
    assert ref.to_json()["hidden"] is True


def test_training_file_rejects_held_out_ids(tmp_path: Path) -> None:
    split = HeldoutSplit(heldout_fraction=0.5, salt="fd-unit")
    ids = [make_task_id("r", "a.py", f"f{i}") for i in range(20)]
    held = next(t for t in ids if split.is_heldout(t))
    train = [t for t in ids if not split.is_heldout(t)]
    with pytest.raises(HeldoutLeakError, match="held-out task id"):
        write_tasks(tmp_path / "tasks.jsonl", [_task(held)], split=split)
    assert not (tmp_path / "tasks.jsonl").exists()
    write_tasks(tmp_path / "tasks.jsonl", [_task(t) for t in train], split=split)
    assert [r["task_id"] for r in read_jsonl_records(tmp_path / "tasks.jsonl")] == train
    with pytest.raises(ValueError, match="not marked heldout"):
        write_heldout_tasks(tmp_path / "h.jsonl", [_task(held)])


def test_reference_file_is_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "tasks.reference.jsonl"
    write_references(path, [TaskReference("id", "a.py", 1, 1, "s\n", "b\n")])
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_jsonl_records(path)[0]["hidden"] is True


def test_slug_is_filesystem_safe_and_distinct() -> None:
    a, b = slug("fd:r:a/b.py:f"), slug("fd:r:a-b.py:f")
    assert a != b
    assert "/" not in a and ":" not in a
