"""Tool-call formats read off chat templates: the syntax found, calls written and parsed back,
tools given to the template, and whole episodes in each format.

The templates below are written for these tests in three shapes instruct models use: calls
between tags with "arguments" (as in Hermes-style templates), a bare JSON object with
"parameters" (as in Llama-3-style templates) and a list after a marker token. SmolLM2's own
template has no tool support: it falls back to the project's text format.
"""

from __future__ import annotations

import copy
import json

import pytest

from composer_replication.rollout.agent import Episode, ScriptedSampler, run_agent_rollouts
from composer_replication.rollout.tool_calls import ToolCall, ToolCallError, ToolParameter, ToolSpec
from composer_replication.rollout.tool_formats import (
    NativeSyntax,
    NativeToolFormat,
    TextToolFormat,
    read_native_syntax,
    tool_format_for,
)
from composer_replication.samples.generation import SamplingSettings

TAGGED = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "Functions you may call:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}{% if message.content %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BARE_JSON = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if loop.first and tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LISTED = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if loop.last and tools and message.role == 'user' %}[TOOLS]{{ tools | tojson }}"
    "[/TOOLS]{% endif %}"
    "{%- if message.tool_calls %}[CALLS] {{ message.tool_calls | map(attribute='function') "
    "| list | tojson }}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECS = (
    ToolSpec("read_file", "Read a file.", (ToolParameter("path", "the file"),)),
    ToolSpec(
        "run_tests",
        "Run tests.",
        (ToolParameter("tests", "test ids", type="array", required=False),),
    ),
    ToolSpec("finish", "Stop.", ()),
)
NAMES = {"read_file", "run_tests", "finish"}


def with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_tool_schema_is_an_openai_function():
    assert SPECS[1].schema() == {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run tests.",
            "parameters": {
                "type": "object",
                "properties": {
                    "tests": {
                        "type": "array",
                        "description": "test ids",
                        "items": {"type": "string"},
                    }
                },
                "required": [],
            },
        },
    }
    with pytest.raises(ValueError, match="type 'text'"):
        ToolParameter("x", "y", type="text")


def test_a_template_without_tool_support_gets_the_text_format(tokenizer):
    assert isinstance(read_native_syntax(tokenizer), str)
    fmt = tool_format_for(tokenizer, SPECS)
    assert isinstance(fmt, TextToolFormat) and fmt.chat_tools is None
    assert fmt.stop_strings == ("</tool_call>",)
    assert "- run_tests(tests?): Run tests." in fmt.system_prompt("Fix it.")
    with pytest.raises(ValueError, match="tool_format = 'native'"):
        tool_format_for(tokenizer, SPECS, "native")
    with pytest.raises(ValueError, match="tool_format = 'xml'"):
        tool_format_for(tokenizer, SPECS, "xml")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (TAGGED, NativeSyntax("<tool_call>\n", "\n</tool_call>", False, "arguments", False, False)),
        (BARE_JSON, NativeSyntax("", "", False, "parameters", False, False)),
        (LISTED, NativeSyntax("[CALLS] [", "]", True, "arguments", False, False)),
    ],
)
def test_the_call_syntax_is_read_off_the_template(tokenizer, template, expected):
    tok = with_template(tokenizer, template)
    assert read_native_syntax(tok) == expected
    fmt = tool_format_for(tok, SPECS)
    assert isinstance(fmt, NativeToolFormat)
    assert fmt.chat_tools == [s.schema() for s in SPECS]
    assert fmt.system_prompt("  Fix it. ") == "Fix it."  # the template shows the tools
    # a call written in the template's syntax parses back to itself
    arguments = {"path": 'pkg/a "b".py'}
    text = fmt.format_call("read_file", arguments)
    assert fmt.parse(f"{text}", NAMES) == ToolCall("read_file", arguments, raw=fmt.parse(text).raw)
    assert json.loads(fmt.parse(text).raw)[expected.arguments_key] == arguments


def test_tagged_format_writes_and_reads_calls_like_the_template(tokenizer):
    fmt = tool_format_for(with_template(tokenizer, TAGGED), SPECS)
    assert fmt.stop_strings == ("</tool_call>",)
    text = fmt.format_call("run_tests", {"tests": ["t.py::a"]})
    assert (
        text
        == '<tool_call>\n{"name": "run_tests", "arguments": {"tests": ["t.py::a"]}}\n</tool_call>'
    )
    reply = "Let me run them.\n" + text
    assert fmt.parse(reply, NAMES) == ToolCall(
        "run_tests",
        {"tests": ["t.py::a"]},
        raw='{"name": "run_tests", "arguments": {"tests": ["t.py::a"]}}',
    )
    assert fmt.parse("All done, the tests pass.", NAMES).kind == "no_call"
    cut = fmt.parse('<tool_call>\n{"name": "run_tests", "argum', NAMES)
    assert isinstance(cut, ToolCallError) and cut.kind == "json_decode"
    unknown = fmt.parse('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', NAMES)
    assert (unknown.kind, unknown.name) == ("unknown_tool", "rm")


def test_bare_json_format_needs_the_reply_to_be_the_call(tokenizer):
    fmt = tool_format_for(with_template(tokenizer, BARE_JSON), SPECS)
    assert fmt.stop_strings == ()  # the call ends with the turn
    assert fmt.format_call("finish") == '{"name": "finish", "parameters": {}}'
    assert fmt.parse(' {"name": "finish", "parameters": {}}', NAMES) == ToolCall(
        "finish", {}, raw='{"name": "finish", "parameters": {}}'
    )
    assert fmt.parse("I think we are done.", NAMES).kind == "no_call"
    bad = fmt.parse('{"name": "read_file", "parameters": [1]}', NAMES)
    assert (bad.kind, bad.name) == ("bad_arguments", "read_file")


def test_listed_format_reads_the_first_call_of_the_list(tokenizer):
    fmt = tool_format_for(with_template(tokenizer, LISTED), SPECS)
    assert fmt.stop_strings == ()  # "]" is no tag to stop on
    reply = '[CALLS] [{"name": "finish", "arguments": {}}, {"name": "read_file"}]'
    assert fmt.parse(reply, NAMES) == ToolCall(
        "finish", {}, raw='{"name": "finish", "arguments": {}}'
    )


def test_an_episode_in_the_native_format_gives_the_template_its_tools(tokenizer):
    tok = with_template(tokenizer, TAGGED)
    fmt = tool_format_for(tok, SPECS)
    seen = []

    def read_file(state, arguments):
        seen.append(arguments["path"])
        return "x = 1\n"

    tools = {"read_file": read_file, "finish": lambda s, a: "bye"}
    messages = [
        {"role": "system", "content": fmt.system_prompt("You fix code.")},
        {"role": "user", "content": "Look at a.py."},
    ]
    script = [fmt.format_call("read_file", {"path": "a.py"}), fmt.format_call("finish")]
    (rollout,) = run_agent_rollouts(
        None,
        tok,
        [Episode("t", messages)],
        sampling=SamplingSettings(max_new_tokens=64),
        max_turns=4,
        tools=tools,
        sample_fn=ScriptedSampler(tok, [script]),
        tool_format=fmt,
    )
    assert seen == ["a.py"] and rollout.metadata["end_reason"] == "finish"
    assert rollout.prompt_tools == fmt.chat_tools
    prompt = tok.decode(rollout.prompt_ids)
    assert '"name": "read_file"' in prompt and "You fix code." in prompt
    # the whole stream is the template's rendering of the conversation, tools included
    conversation = rollout.metadata["conversation"]
    rendered = tok.apply_chat_template(
        conversation, tools=fmt.chat_tools, tokenize=False, add_generation_prompt=False
    )
    # (an episode ends on its last sampled token: the template's end of turn is not added)
    assert tok.decode(rollout.input_ids) + "<|im_end|>" == rendered
    assert "<tool_response>\nx = 1\n\n</tool_response>" in rendered
    # the observation tokens are the user message the template made of the tool result
    observed = [t for t, r in zip(rollout.completion_ids, rollout.token_roles) if r == "tool"]
    assert (
        tok.decode(observed)
        == "<|im_start|>user\n<tool_response>\nx = 1\n\n</tool_response><|im_end|>"
    )
    assert not any(e["type"] == "render_fallback" for e in rollout.metadata["events"])


def test_a_reply_cut_off_mid_call_is_truncated_not_an_answer(tokenizer):
    fmt = tool_format_for(tokenizer, SPECS)
    call = fmt.format_call("read_file", {"path": "a/very/long/path/to/some/module.py"})
    (rollout,) = run_agent_rollouts(
        None,
        tokenizer,
        [Episode("t", [{"role": "user", "content": "go"}])],
        sampling=SamplingSettings(max_new_tokens=6),
        max_turns=3,
        tools={"read_file": lambda s, a: "ok"},
        sample_fn=ScriptedSampler(tokenizer, [[call]]),
        tool_format=fmt,
    )
    assert rollout.metadata["end_reason"] == "truncated"
    assert rollout.metadata["finish_reasons"] == ["length"]
    assert rollout.metadata["events"][-1] == {
        "turn": 1,
        "type": "truncated",
        "kind": "json_decode",
        "tokens": 6,
    }
