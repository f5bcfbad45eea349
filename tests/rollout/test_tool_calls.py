"""The tool-call format: parsing valid and malformed calls, the canonical writer, the prompt."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from composer_replication.hint_generator import classify_error
from composer_replication.rollout.tool_calls import (
    ERROR_KINDS,
    STOP_STRINGS,
    ToolCall,
    ToolCallError,
    ToolParameter,
    ToolSpec,
    format_tool_call,
    parse_tool_call,
    tool_instructions,
)

TOOLS = {"read_file", "write_file", "run_tests", "finish"}


def test_valid_call_with_text_around_it():
    text = 'I will look first. <tool_call> {"name": "read_file", "arguments": {"path": "a.py"}} </tool_call>'
    call = parse_tool_call(text, TOOLS)
    assert call == ToolCall("read_file", {"path": "a.py"}, raw=text[text.index("> {") + 1 : -12])
    assert STOP_STRINGS == ("</tool_call>",)


def test_only_the_first_call_counts_and_arguments_may_be_omitted():
    text = '<tool_call>{"name": "finish"}</tool_call><tool_call>{"name": "run_tests"}</tool_call>'
    assert parse_tool_call(text, TOOLS) == ToolCall("finish", {}, raw='{"name": "finish"}')
    null_args = parse_tool_call('<tool_call>{"name": "finish", "arguments": null}</tool_call>')
    assert isinstance(null_args, ToolCall) and null_args.arguments == {}


def test_text_without_a_call_is_no_call():
    result = parse_tool_call("The answer is 42.", TOOLS)
    assert isinstance(result, ToolCallError)
    assert (result.kind, result.raw, result.name) == ("no_call", "", None)


@pytest.mark.parametrize(
    "body",
    ['{"name": "read_file", "arguments": {"path": "a.py"}', "{'name': 'x'}", "", "read_file"],
)
def test_malformed_json_is_json_decode(body):
    result = parse_tool_call(f"<tool_call>{body}</tool_call>", TOOLS)
    assert isinstance(result, ToolCallError)
    assert (result.kind, result.raw) == ("json_decode", body)
    assert result.message.startswith("Error: the tool call is not valid JSON")
    assert classify_error(result.message) == "json_decode"  # the SDPO hint kind


def test_unterminated_call_is_json_decode():
    result = parse_tool_call('<tool_call>{"name": "read_file", "argu', TOOLS)
    assert isinstance(result, ToolCallError)
    assert (result.kind, result.raw) == ("json_decode", '{"name": "read_file", "argu')
    assert "never closed" in result.message


@pytest.mark.parametrize(
    "body", ['{"arguments": {}}', '{"name": ""}', '{"name": 3}', "[1, 2]", '"read_file"']
)
def test_missing_name(body):
    result = parse_tool_call(f"<tool_call>{body}</tool_call>", TOOLS)
    assert isinstance(result, ToolCallError) and result.kind == "missing_name"
    assert result.message.startswith("Error: the tool call")


@pytest.mark.parametrize("arguments", ["[1]", '"a.py"', "3"])
def test_non_object_arguments_are_bad_arguments(arguments):
    text = f'<tool_call>{{"name": "read_file", "arguments": {arguments}}}</tool_call>'
    result = parse_tool_call(text, TOOLS)
    assert isinstance(result, ToolCallError)
    assert (result.kind, result.name) == ("bad_arguments", "read_file")


def test_unknown_tool_names_the_available_ones():
    result = parse_tool_call('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', TOOLS)
    assert isinstance(result, ToolCallError)
    assert (result.kind, result.name) == ("unknown_tool", "rm_rf")
    assert result.message == (
        "Error: unknown tool 'rm_rf'; available tools: finish, read_file, run_tests, write_file"
    )
    assert classify_error(result.message) == "tool_not_found"
    # without a tool list any name is accepted
    assert parse_tool_call('<tool_call>{"name": "rm_rf"}</tool_call>') == ToolCall(
        "rm_rf", {}, raw='{"name": "rm_rf"}'
    )


def test_records_are_frozen_and_kinds_are_the_documented_ones():
    assert ERROR_KINDS == (
        "no_call",
        "json_decode",
        "missing_name",
        "bad_arguments",
        "unknown_tool",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        ToolCall("a").name = "b"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ToolCallError("no_call", "m").kind = "x"  # type: ignore[misc]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@example(name="</tool_call>", arguments={"content": "x = '</tool_call>'\n"})
@given(
    name=st.text(min_size=1, max_size=20).filter(str.strip),
    arguments=st.dictionaries(st.text(max_size=8), _json, max_size=4),
)
def test_format_then_parse_round_trips(name, arguments):
    text = format_tool_call(name, arguments)
    assert text.startswith("<tool_call>{") and text.endswith("}</tool_call>")
    call = parse_tool_call(f"Thinking first.\n{text}", None)
    assert isinstance(call, ToolCall)
    assert (call.name, call.arguments) == (name, arguments)
    assert json.loads(call.raw) == {"name": name, "arguments": arguments}


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from('<>/tool_call{}":, []nameargs\\x0'), max_size=60))
def test_parser_never_raises_on_model_text(text):
    result = parse_tool_call(text, TOOLS)
    assert isinstance(result, ToolCall) or result.kind in ERROR_KINDS


def test_tool_instructions_document_the_format_and_each_tool():
    specs = [
        ToolSpec("read_file", "Return a file.", (("path", "the file's path"),)),
        ToolSpec("finish", "Stop.", ()),
    ]
    text = tool_instructions(specs, "You fix bugs.")
    lines = text.splitlines()
    assert lines[0] == "You fix bugs."
    assert (
        '<tool_call>{"name": "read_file", "arguments": {"path": "package/module.py"}}</tool_call>'
        in lines
    )
    assert lines[-2:] == [
        "- read_file(path): Return a file. Arguments: path: the file's path.",
        "- finish(): Stop. Arguments: none.",
    ]


def test_one_format_for_traces_and_agents():
    from composer_replication.traces.ingestion.render import render_tool_call

    # an ingested trace's call (what replay teachers answer in, what DPO pairs hold) is
    # a call to the agent's parser, arguments' keys sorted and text kept as it is
    text = render_tool_call("Edit", {"new": "é</x>", "file_path": "a.py"})
    assert text == (
        '<tool_call>{"name": "Edit", "arguments": {"file_path": "a.py", "new": "é<\\/x>"}}'
        "</tool_call>"
    )
    assert parse_tool_call(f"Renaming.\n\n{text}") == ToolCall(
        "Edit", {"file_path": "a.py", "new": "é</x>"}, raw=text[11:-12]
    )
    # older trace files wrote <tool_call name="X">{arguments}</tool_call>: read the same
    legacy = '<tool_call name="Edit">\n{"file_path": "a.py"}\n</tool_call>'
    assert parse_tool_call(legacy, {"Edit"}) == ToolCall(
        "Edit", {"file_path": "a.py"}, raw='{"file_path": "a.py"}'
    )
    assert parse_tool_call('<tool_call name="Edit">{"x": </tool_call>').kind == "json_decode"


@settings(max_examples=80, deadline=None)
@example(text='x = "1"\n  \\n</new>')  # a value that cannot end its block goes inline
@example(text="")
@given(text=st.text(alphabet=st.sampled_from('ab "\\\n</>tolcan_ew'), max_size=40))
def test_text_arguments_in_blocks_round_trip(text):
    call = format_tool_call(
        "replace", {"path": "a.py", "old": "x", "new": text}, raw=["old", "new"]
    )
    parsed = parse_tool_call(f"I'll fix it.\n{call}", {"replace"})
    assert isinstance(parsed, ToolCall)
    assert parsed.arguments == {"path": "a.py", "old": "x", "new": text}


def test_blocks_follow_the_object_exactly_as_written():
    text = (
        '<tool_call>{"name": "replace", "arguments": {"path": "m.py"}}\n'
        '<old>\n    return 1\n</old>\n<new>\n    s = "it\'s\\n"\n    return s\n</new>\n'
        "</tool_call>"
    )
    call = parse_tool_call(text, {"replace"})
    assert call.arguments == {
        "path": "m.py",
        "old": "    return 1",
        "new": '    s = "it\'s\\n"\n    return s',
    }
    stray = parse_tool_call('<tool_call>{"name": "replace"} junk</tool_call>', {"replace"})
    assert stray.kind == "json_decode" and "not an argument block" in stray.message
    unclosed = parse_tool_call('<tool_call>{"name": "replace"}\n<new>\nx\n</tool_call>')
    assert unclosed.kind == "json_decode"


def test_instructions_show_text_arguments_as_blocks():
    spec = ToolSpec(
        "replace",
        "Replace old by new.",
        (
            ToolParameter("path", "the file"),
            ToolParameter("old", "the text", raw=True),
            ToolParameter("new", "its replacement", raw=True),
        ),
    )
    lines = tool_instructions([spec]).splitlines()
    start = lines.index(
        '<tool_call>{"name": "replace", "arguments": {"path": "package/module.py"}}'
    )
    assert lines[start + 1 : start + 8] == [
        "<old>", "...the old text, line for line...", "</old>",
        "<new>", "...the new text, line for line...", "</new>", "</tool_call>",
    ]  # fmt: skip
    assert lines[-1] == (
        "- replace(path, old, new): Replace old by new. Arguments: path: the file; old (text): "
        "the text; new (text): its replacement."
    )
