"""Tests for `composer_replication.hint_generator`: templates, registry and `classify_error`.

Error texts come from real exceptions (formatted with `traceback`) or are verbatim pytest
output, so the classifier is checked on what the training loop will actually see.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Iterator

import pytest

from composer_replication import hint_generator as hg
from composer_replication.hint_generator import (
    HINT_TEMPLATES,
    HintContext,
    classify_error,
    dispatch,
    hint_json_decode,
    hint_repeated_failure,
    hint_runtime_error,
    hint_tool_not_found,
    hint_type_error,
    register,
)

KINDS = ["tool_not_found", "json_decode", "type_error", "runtime_error", "repeated_failure"]

READ_FILE_SCHEMA = {
    "type": "function",
    "function": {
        "name": "read_file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "max_lines": {"type": "integer"}},
            "required": ["path"],
        },
    },
}

ZERO_DIV_TRACEBACK = """\
Traceback (most recent call last):
  File "/work/solution.py", line 12, in <module>
    main()
  File "/work/solution.py", line 9, in main
    print(mean([]))
  File "/work/solution.py", line 4, in mean
    return sum(xs) / len(xs)
ZeroDivisionError: division by zero"""

PYTEST_ASSERTION_FAILURE = """\
============================= test session starts ==============================
collected 2 items

tests/test_add.py .F                                                     [100%]

=================================== FAILURES ===================================
_________________________________ test_add_neg _________________________________

    def test_add_neg():
>       assert add(-1, -2) == -3
E       assert -1 == -3
E        +  where -1 = add(-1, -2)

tests/test_add.py:7: AssertionError
=========================== short test summary info ============================
FAILED tests/test_add.py::test_add_neg - assert -1 == -3
========================= 1 failed, 1 passed in 0.03s =========================="""

PYTEST_TYPE_ERROR = """\
=================================== FAILURES ===================================
__________________________________ test_area ___________________________________

    def test_area():
>       assert area(3) == 9
E       TypeError: area() missing 1 required positional argument: 'height'

tests/test_shapes.py:4: TypeError
=========================== short test summary info ============================
FAILED tests/test_shapes.py::test_area - TypeError: area() missing 1 required positional argument: 'height'
============================== 1 failed in 0.02s ==============================="""

PYTEST_SHORT_TB = """\
tests/test_stats.py:5: in test_median
    assert median([3, 1, 2]) == 2
src/stats.py:3: in median
    return xs[len(xs) // 2 + 1]
E   IndexError: list index out of range
=========================== short test summary info ============================
FAILED tests/test_stats.py::test_median - IndexError: list index out of range"""


@pytest.fixture
def restore_registry() -> Iterator[None]:
    saved = dict(HINT_TEMPLATES)
    yield
    HINT_TEMPLATES.clear()
    HINT_TEMPLATES.update(saved)


def _real_traceback(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception:
        return traceback.format_exc()
    raise AssertionError("expected an exception")


def _json_error_message(text: str) -> str:
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return str(e)
    raise AssertionError("expected a JSONDecodeError")


# ------------------------------------------------------------------ registry


def test_registry_has_the_five_builtin_kinds() -> None:
    assert sorted(HINT_TEMPLATES) == sorted(KINDS)
    assert HINT_TEMPLATES["tool_not_found"] is hint_tool_not_found
    assert HINT_TEMPLATES["json_decode"] is hint_json_decode
    assert HINT_TEMPLATES["type_error"] is hint_type_error
    assert HINT_TEMPLATES["runtime_error"] is hint_runtime_error
    assert HINT_TEMPLATES["repeated_failure"] is hint_repeated_failure


@pytest.mark.parametrize("kind", KINDS)
def test_dispatch_with_no_or_empty_ctx_never_raises(kind: str) -> None:
    for ctx in (None, {}, {"error_message": None, "available_tools": None, "tool_schema": None}):
        hint = dispatch(kind, ctx)  # type: ignore[arg-type]
        assert isinstance(hint, str)
        assert len(hint) > 40


def test_dispatch_unknown_kind_returns_none() -> None:
    assert dispatch("no_such_kind", {"error_message": "x"}) is None
    assert dispatch("") is None
    assert dispatch(None) is None  # type: ignore[arg-type]
    assert dispatch(["runtime_error"]) is None  # type: ignore[arg-type]


def test_dispatch_routes_to_the_template() -> None:
    ctx: HintContext = {"tool_name": "reed_file", "available_tools": ["read_file"]}
    assert dispatch("tool_not_found", ctx) == hint_tool_not_found(ctx)


def test_register_new_kind_and_replace(restore_registry: None) -> None:
    def timeout_hint(ctx: HintContext) -> str:
        return f"timed out: {ctx.get('tool_name', '?')}"

    assert register("timeout", timeout_hint) is timeout_hint
    assert dispatch("timeout", {"tool_name": "run_tests"}) == "timed out: run_tests"
    assert dispatch("timeout") == "timed out: ?"
    register("timeout", lambda ctx: "second")
    assert dispatch("timeout") == "second"
    register("runtime_error", lambda ctx: "custom runtime")  # built-ins can be replaced too
    assert dispatch("runtime_error", {"error_message": "boom"}) == "custom runtime"


def test_register_validates_arguments(restore_registry: None) -> None:
    with pytest.raises(ValueError, match="error_kind must be a non-empty str, got ''"):
        register("", hint_runtime_error)
    with pytest.raises(ValueError, match="non-empty"):
        register("   ", hint_runtime_error)
    with pytest.raises(TypeError, match="error_kind must be a str, got 3"):
        register(3, hint_runtime_error)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fn must be callable"):
        register("x", "not a function")  # type: ignore[arg-type]
    assert sorted(HINT_TEMPLATES) == sorted(KINDS)


# ------------------------------------------------------------------ templates


def test_hint_tool_not_found_names_closest_tool() -> None:
    ctx: HintContext = {
        "tool_name": "reed_file",
        "available_tools": ["read_file", "write_file", "run_tests"],
    }
    assert hint_tool_not_found(ctx) == (
        "The tool 'reed_file' does not exist. Did you mean 'read_file'? "
        "Available tools: read_file, write_file, run_tests. Call one of them by its exact name."
    )


def test_hint_tool_not_found_without_close_match_or_tool_list() -> None:
    ctx: HintContext = {"tool_name": "deploy", "available_tools": ["read_file", "run_tests"]}
    assert hint_tool_not_found(ctx) == (
        "The tool 'deploy' does not exist. "
        "Available tools: read_file, run_tests. Call one of them by its exact name."
    )
    assert hint_tool_not_found({"error_message": "Error: unknown tool 'grep_repo'"}) == (
        "The tool 'grep_repo' does not exist. "
        "Check the tool list you were given and call a tool by its exact name."
    )


def test_hint_tool_not_found_accepts_tool_schemas_as_available_tools() -> None:
    ctx: HintContext = {
        "tool_name": "readfile",
        "available_tools": [READ_FILE_SCHEMA, {"name": "bash"}],  # type: ignore[list-item]
    }
    assert "Did you mean 'read_file'? Available tools: read_file, bash." in hint_tool_not_found(ctx)


def test_hint_json_decode_points_at_the_position() -> None:
    message = _json_error_message('{"path": "a.py" "max_lines": 10}')
    assert message == "Expecting ',' delimiter: line 1 column 17 (char 16)"
    assert hint_json_decode({"error_message": message, "tool_name": "read_file"}) == (
        "The arguments for 'read_file' are not valid JSON: Expecting ',' delimiter: line 1 "
        "column 17 (char 16). Look at line 1, column 17 (character 16) and just before it. "
        "Common causes: single quotes instead of double quotes, unquoted keys, a trailing "
        "comma, an unescaped quote or raw newline inside a string, or text around the object. "
        "Send exactly one JSON object."
    )


def test_hint_json_decode_reads_the_final_line_of_a_traceback() -> None:
    tb = _real_traceback(lambda: json.loads("{'path': 'a.py'}"))
    hint = hint_json_decode({"error_message": tb})
    assert hint.startswith(
        "The JSON is not valid: Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1). Look at line 1, column 2 (character 1) and just before it."
    )


def test_hint_type_error_names_missing_argument_and_schema() -> None:
    ctx: HintContext = {
        "error_message": "TypeError: read_file() missing 1 required positional argument: 'path'",
        "tool_schema": READ_FILE_SCHEMA,
    }
    assert hint_type_error(ctx) == (
        "The call to 'read_file' has the wrong arguments: read_file() missing 1 required "
        "positional argument: 'path'. Pass the missing argument(s): path (string). "
        "Required arguments: path (string). Optional: max_lines (integer). "
        "Use exactly these names and types."
    )


def test_hint_type_error_suggests_the_right_keyword() -> None:
    ctx: HintContext = {
        "tool_name": "read_file",
        "error_message": "read_file() got an unexpected keyword argument 'paths'",
        "tool_schema": READ_FILE_SCHEMA["function"]["parameters"],  # bare object schema
    }
    assert hint_type_error(ctx) == (
        "The call to 'read_file' has the wrong arguments: read_file() got an unexpected "
        "keyword argument 'paths'. 'paths' is not a parameter of 'read_file'. Did you mean "
        "'path'? Required arguments: path (string). Optional: max_lines (integer). "
        "Use exactly these names and types."
    )


def test_hint_type_error_accepts_anthropic_input_schema() -> None:
    schema = {
        "name": "write_file",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    }
    hint = hint_type_error({"tool_schema": schema})
    assert hint == (
        "The call to 'write_file' has the wrong arguments. "
        "Required arguments: path (string), content (string). Use exactly these names and types."
    )


def test_hint_type_error_without_schema() -> None:
    def area(width: int, height: int) -> int:
        return width * height

    tb = _real_traceback(lambda: area(3))  # type: ignore[call-arg]
    hint = hint_type_error({"error_message": tb})
    assert "missing 1 required positional argument: 'height'" in hint
    assert "Pass the missing argument(s): height." in hint
    assert hint.endswith("Check the signature: argument names, count and types.")


def test_hint_runtime_error_quotes_traceback_and_location() -> None:
    ctx: HintContext = {"error_message": ZERO_DIV_TRACEBACK, "tool_name": "run_python"}
    assert hint_runtime_error(ctx) == (
        "'run_python' failed with:\n"
        + ZERO_DIV_TRACEBACK
        + "\nThe error is ZeroDivisionError: division by zero. It was raised at "
        "/work/solution.py, line 4, in mean. Read that line and the values it uses; check "
        "your assumptions about them. Fix the cause, not the symptom."
    )


def test_hint_runtime_error_understands_pytest_locations() -> None:
    hint = hint_runtime_error({"error_message": PYTEST_SHORT_TB})
    assert "The error is IndexError: list index out of range." in hint
    assert "It was raised at src/stats.py, line 3, in median." in hint


def test_hint_runtime_error_truncates_long_output_keeping_the_tail() -> None:
    lines = [f"log line {i}: " + "x" * 50 for i in range(300)]
    message = "\n".join([*lines, "RuntimeError: the final line"])
    hint = hint_runtime_error({"error_message": message})
    assert "log line 0:" not in hint
    assert "log line 299:" in hint
    assert "The run failed with:\n...\n" in hint
    assert "RuntimeError: the final line\nThe error is RuntimeError: the final line." in hint
    assert len(hint) < 1200


def test_hint_runtime_error_truncates_one_huge_line() -> None:
    message = "A" * 5000 + " ValueError tail"
    quoted = hint_runtime_error({"error_message": message}).split("\n")[2]
    assert quoted == message[-800:]


def test_hint_repeated_failure_names_intent_and_last_error() -> None:
    ctx: HintContext = {
        "error_message": ZERO_DIV_TRACEBACK,
        "intent": "make test_mean pass",
        "tool_name": "run_python",
    }
    assert hint_repeated_failure(ctx) == (
        "The same approach has failed several times; repeating it will fail again. "
        "Last error: ZeroDivisionError: division by zero. Your goal is still: make test_mean "
        "pass. Stop calling 'run_python' the same way. Step back: re-read the task and the "
        "relevant code, question the assumption behind your attempts, and try a different "
        "approach (another tool, a smaller step, or inspecting the state first)."
    )


def test_hints_do_not_quote_source_that_is_not_in_the_error() -> None:
    # The hint may only describe the error: with a bare message it adds no code at all.
    for kind in KINDS:
        hint = dispatch(kind, {"error_message": "ValueError: bad input"})
        assert hint is not None
        assert "def " not in hint
        assert "return " not in hint


# ------------------------------------------------------------------ classify_error


def test_classify_real_tracebacks() -> None:
    def area(width: int, height: int) -> int:
        return width * height

    assert classify_error(_real_traceback(lambda: 1 / 0)) == "runtime_error"
    assert classify_error(_real_traceback(lambda: area(3))) == "type_error"  # type: ignore[call-arg]
    assert classify_error(_real_traceback(lambda: json.loads("{'a': 1}"))) == "json_decode"
    assert classify_error(_real_traceback(lambda: {}["k"])) == "runtime_error"
    assert classify_error(_real_traceback(lambda: __import__("no_such_module_xyz"))) == (
        "runtime_error"
    )


def test_classify_chained_exception_uses_the_final_one() -> None:
    def parse() -> None:
        try:
            len(5)  # type: ignore[arg-type]
        except TypeError as e:
            raise ValueError("could not parse config") from e

    tb = _real_traceback(parse)
    assert "TypeError" in tb
    assert classify_error(tb) == "runtime_error"


def test_classify_pytest_output() -> None:
    assert classify_error(PYTEST_ASSERTION_FAILURE) == "runtime_error"
    assert classify_error(PYTEST_TYPE_ERROR) == "type_error"
    assert classify_error(PYTEST_SHORT_TB) == "runtime_error"
    assert classify_error("========= 3 passed in 0.01s =========") is None


def test_classify_json_messages() -> None:
    assert classify_error(_json_error_message("")) == "json_decode"
    assert classify_error(_json_error_message('{"a": 1,}')) == "json_decode"
    assert classify_error(_json_error_message('{"a": "b')) == "json_decode"
    assert classify_error(_json_error_message('{"a": 1} extra')) == "json_decode"
    assert classify_error("json.decoder.JSONDecodeError: Expecting value: line 1 column 1") == (
        "json_decode"
    )
    assert classify_error("ValueError: Expecting value: line 1 column 1 (char 0)") == (
        "json_decode"
    )


@pytest.mark.parametrize(
    "text",
    [
        "Error: Unknown tool 'reed_file'. Available tools: read_file, write_file",
        "Tool 'search_web' not found",
        "tool `deploy` does not exist",
        "No such tool: grep_repo",
        "ToolNotFoundError: bash2",
        "Invalid tool name 'run-tests'",
    ],
)
def test_classify_unknown_tool_messages(text: str) -> None:
    assert classify_error(text) == "tool_not_found"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("TypeError: unsupported operand type(s) for +: 'int' and 'str'", "type_error"),
        ("bash: pytset: command not found", "runtime_error"),
        ("subprocess.TimeoutExpired: Command 'pytest' timed out after 60 seconds", "runtime_error"),
        ("Exception: something broke", "runtime_error"),
        ("FileNotFoundError: [Errno 2] No such file or directory: 'tool.py'", "runtime_error"),
        ("error: could not compile", "runtime_error"),
        ("", None),
        ("   \n", None),
        ("All good, wrote 3 files.", None),
        ("No errors found.", None),
        ("ran 12 checks: 0 failed, 0 errors", None),
        ("==== 2 failed, 3 passed in 0.10s ====", "runtime_error"),
        ("Fatal: not a git repository", "runtime_error"),
    ],
)
def test_classify_other_texts(text: str, kind: str | None) -> None:
    assert classify_error(text) == kind


def test_classify_then_dispatch_round_trip() -> None:
    tb = _real_traceback(lambda: 1 / 0)
    kind = classify_error(tb)
    assert kind == "runtime_error"
    hint = dispatch(kind, {"error_message": tb})
    assert hint is not None
    assert "The error is ZeroDivisionError: division by zero." in hint


def test_classify_non_string_returns_none() -> None:
    assert classify_error(None) is None  # type: ignore[arg-type]
    assert hg.classify_error(b"TypeError: x") is None  # type: ignore[arg-type]
