"""The editing tools: pages instead of cuts, exact replacement with errors that say why, search,
file creation, the compact test run and the bounded shell."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_replication.envs.fd_tasks import FDTask
from composer_replication.envs.fd_tools import (
    FDAttempt,
    create_file,
    numbered,
    occurrences,
    read_file,
    replace,
    replace_function,
    run_tests,
    search,
    shell,
    tool_specs,
)
from composer_replication.rollout.tool_calls import ToolError, ToolResult
from composer_replication.safety.hack_monitor import Manifest
from composer_replication.sandbox.local import LocalSubprocessSandbox

pytestmark = pytest.mark.integration

MODULE = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(60))


def attempt(root: Path, **kwargs) -> FDAttempt:
    return FDAttempt(task=None, workdir=root, sandbox=None, manifest=Manifest(), **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(MODULE)
    (root / "pkg" / "small.py").write_text("A = 1\nB = 1\nA = 1\n")
    (root / "notes.txt").write_text("call f7 first\n")
    return root


def test_read_file_pages_a_long_file_and_says_how_to_go_on(repo: Path):
    state = attempt(repo, page_lines=50, page_chars=100_000)
    first = read_file(state, {"path": "pkg/mod.py"})
    lines = MODULE.splitlines()
    assert first.splitlines()[0] == "pkg/mod.py (lines 1-50 of 240)"
    assert first.splitlines()[1:51] == [f"{n:>4}| {line}" for n, line in enumerate(lines[:50], 1)]
    assert first.splitlines()[-1] == "[lines 51-240 not shown: call read_file with start_line=51]"
    window = read_file(state, {"path": "pkg/mod.py", "start_line": 118, "end_line": 121})
    assert window == "pkg/mod.py (lines 118-121 of 240)\n" + numbered(lines[117:121], 118)
    # the character budget pages too, at line boundaries (never inside a line)
    narrow = read_file(attempt(repo, page_chars=60), {"path": "pkg/mod.py", "start_line": 5})
    assert narrow.splitlines()[1:] == [
        "   5| def f1(x):",
        "   6|     return x + 1",
        "   7| ",
        "   8| ",
        "[lines 9-240 not shown: call read_file with start_line=9]",
    ]
    for arguments, message in [
        ({"path": "pkg/mod.py", "start_line": 241}, "start_line 241 is outside pkg/mod.py"),
        ({"path": "pkg/mod.py", "start_line": 9, "end_line": 3}, "end_line 3 is before"),
        ({"path": "pkg/mod.py", "start_line": "two"}, "start_line must be a line number"),
    ]:
        with pytest.raises(ToolError, match=message) as info:
            read_file(state, arguments)
        assert info.value.kind == "bad_arguments"


def test_search_finds_lines_and_pages_them(repo: Path):
    state = attempt(repo, page_lines=3)
    found = search(state, {"pattern": "return x + 1"})
    assert found.splitlines() == [
        "11 lines contain 'return x + 1':",
        "pkg/mod.py:6: return x + 1",
        "pkg/mod.py:42: return x + 10",
        "pkg/mod.py:46: return x + 11",
        "[8 more not shown: search a narrower path]",
    ]
    assert search(state, {"pattern": "f7", "path": "notes.txt"}) == (
        "1 lines contain 'f7':\nnotes.txt:1: call f7 first"
    )
    assert search(state, {"pattern": "nowhere"}) == "no line contains 'nowhere' under ."
    with pytest.raises(ToolError, match="pattern must not be empty"):
        search(state, {"pattern": ""})
    with pytest.raises(ToolError, match="outside the repository"):
        search(state, {"pattern": "x", "path": "../"})


def test_replace_needs_exactly_one_occurrence_and_says_why_not(repo: Path):
    state = attempt(repo)
    out = replace(
        state,
        {
            "path": "pkg/mod.py",
            "old": "def f3(x):\n    return x + 3",
            "new": "def f3(x):\n    return 3 + x",
        },
    )
    assert out.splitlines()[0] == "replaced in pkg/mod.py; lines 12-15 now read:"
    assert "  14|     return 3 + x" in out.splitlines()
    assert "return 3 + x" in (repo / "pkg" / "mod.py").read_text()
    with pytest.raises(ToolError) as info:
        replace(state, {"path": "pkg/small.py", "old": "A = 1", "new": "A = 2"})
    assert info.value.kind == "ambiguous_match"
    assert str(info.value) == (
        "old occurs 2 times in pkg/small.py (at lines 1, 3); include more of the surrounding "
        "lines so that it occurs once"
    )
    # overlapping occurrences count: "aXa" in "aXaXa" is there twice
    (repo / "o.txt").write_text("aXaXa")
    assert occurrences("aXaXa", "aXa") == [0, 2]
    with pytest.raises(ToolError, match="occurs 2 times"):
        replace(state, {"path": "o.txt", "old": "aXa", "new": "b"})
    with pytest.raises(ToolError) as info:
        replace(state, {"path": "pkg/mod.py", "old": "def f4(x):\n  return x + 4", "new": ""})
    assert info.value.kind == "no_match"
    assert str(info.value) == (
        "old does not occur in pkg/mod.py; the closest line is 17: 'def f4(x):' (copy it "
        "exactly, indentation included)"
    )
    assert (repo / "pkg" / "small.py").read_text() == "A = 1\nB = 1\nA = 1\n"  # untouched
    with pytest.raises(ToolError, match="old must not be empty"):
        replace(state, {"path": "pkg/small.py", "old": "", "new": "x"})
    with pytest.raises(ToolError, match="missing \\['new'\\]"):
        replace(state, {"path": "pkg/small.py", "old": "B"})
    # every edit that reached the file is logged for the hack monitor, refused ones too
    assert [a["type"] for a in state.actions] == ["replace"] * 4


def test_replace_function_rewrites_one_definition_and_refuses_code_that_breaks_the_file(
    repo: Path,
):
    state = attempt(repo)
    out = replace_function(
        state, {"path": "pkg/mod.py", "name": "f3", "code": "def f3(x):\n    return 3 + x\n"}
    )
    assert out.splitlines() == [
        "replaced f3 in pkg/mod.py; lines 13-14 now read:",
        "  13| def f3(x):",
        "  14|     return 3 + x",
    ]
    assert (repo / "pkg" / "mod.py").read_text() == MODULE.replace("x + 3\n", "3 + x\n")
    with pytest.raises(ToolError) as info:
        replace_function(state, {"path": "pkg/mod.py", "name": "f", "code": "def f(): pass"})
    assert info.value.kind == "no_match"
    assert str(info.value) == "no function 'f' is defined here in pkg/mod.py"
    with pytest.raises(ToolError, match=r"the new code does not compile .*; nothing changed"):
        replace_function(state, {"path": "pkg/mod.py", "name": "f4", "code": "def f4(x:\n"})
    assert "return x + 4\n" in (repo / "pkg" / "mod.py").read_text()  # untouched
    with pytest.raises(ToolError, match="missing \\['code'\\]"):
        replace_function(state, {"path": "pkg/mod.py", "name": "f4"})
    assert [a["type"] for a in state.actions] == ["replace"] * 3  # seen by the hack monitor
    # code that parses but cannot compile (a return outside the function) is refused too
    with pytest.raises(ToolError, match="'return' outside function"):
        replace_function(
            state, {"path": "pkg/mod.py", "name": "f5", "code": "def f5(x):\n    pass\nreturn 1"}
        )
    # written without a docstring, a definition keeps the old one
    (repo / "doc.py").write_text(
        'def g(x):\n    """Twice x.\n\n    >>> g(2)\n    4\n    """\n    return x\n'
    )
    out = replace_function(
        state, {"path": "doc.py", "name": "g()", "code": "def g(x):\n    return 2 * x"}
    )
    assert out.startswith("replaced g in doc.py (its docstring kept); lines 1-7 now read:")
    assert (repo / "doc.py").read_text() == (
        'def g(x):\n    """Twice x.\n\n    >>> g(2)\n    4\n    """\n    return 2 * x\n'
    )


def test_create_file_refuses_an_existing_file(repo: Path):
    state = attempt(repo)
    assert create_file(state, {"path": "pkg/new/util.py", "content": "X = 1\nY = 2\n"}) == (
        "created pkg/new/util.py (2 lines)"
    )
    assert (repo / "pkg" / "new" / "util.py").read_text() == "X = 1\nY = 2\n"
    with pytest.raises(ToolError, match="already exists; change it with replace"):
        create_file(state, {"path": "pkg/small.py", "content": ""})


def test_tool_specs_check_names():
    assert [s.name for s in tool_specs(["read_file", "finish"])] == ["read_file", "finish"]
    with pytest.raises(ValueError, match="unknown tools \\['delete'\\]"):
        tool_specs(["delete", "finish"])
    with pytest.raises(ValueError, match="have no finish"):
        tool_specs(["read_file"])


def test_run_tests_reports_counts_failures_and_the_end_of_the_output(shared_dir: Path):
    root = shared_dir / "proj"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_a.py").write_text(
        "def test_ok():\n    assert 1\n\n\ndef test_bad():\n    assert 1 + 1 == 3, 'arith'\n"
    )
    task = FDTask(
        task_id="t", repo="proj", file="x.py", qualname="x", target_tests=("tests/test_a.py::test_bad",),
        passing_tests=(), prompt="", files=(), workdir=str(root), test_command="python -m pytest -q",
    )  # fmt: skip
    sandbox = LocalSubprocessSandbox(root, exec_timeout_s=60)
    state = FDAttempt(task=task, workdir=root, sandbox=sandbox, manifest=Manifest(), page_chars=600)
    result = run_tests(state, {})
    assert isinstance(result, ToolResult)
    lines = result.text.splitlines()
    assert lines[:2] == ["1 passed, 1 failed, 0 errors", "failing: tests/test_a.py::test_bad"]
    assert "AssertionError: arith" in result.text and len(result.text) < 700
    assert result.info == {
        "passed": 1, "failed": 1, "errors": 0, "target_passed": 0, "n_targets": 1,
    }  # fmt: skip
    only = run_tests(state, {"tests": ["tests/test_a.py::test_ok"]})
    assert only.text.splitlines()[0] == "1 passed, 0 failed, 0 errors"
    with pytest.raises(ToolError, match="is an option"):
        run_tests(state, {"tests": ["--co"]})
    # the optional shell runs in the same sandbox, bounded by its limits and denylist
    assert shell(state, {"command": "echo $((6 * 7)) && ls tests"}).split() == ["42", "test_a.py"]
    with pytest.raises(ToolError, match="not allowed here"):
        shell(state, {"command": "sudo ls"})
    sandbox.close()
