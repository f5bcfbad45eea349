"""The tool-call format of multi-turn rollouts, and its parser.

The format (the system prompt built by :func:`tool_instructions` tells the model exactly
this):

- The model calls a tool by writing one JSON object between tags, e.g.
  ``<tool_call>{"name": "read_file", "arguments": {"path": "pkg/mod.py"}}</tool_call>``.
  ``name`` is a string naming a tool; ``arguments`` is an object (omit it for a tool that
  takes none). Sampling stops at ``</tool_call>`` (:data:`STOP_STRINGS`), so a message holds
  at most one call and nothing after it; a string that must contain the closing tag writes
  it with JSON's ``\\/`` escape (``<\\/tool_call>``), as :func:`format_tool_call` does.
- A text argument (code: an edit's ``old`` and ``new``, a file's ``content``; a
  :class:`ToolParameter` with ``raw``) may instead follow the object as a block of its own
  lines, ``<name>`` / the text exactly as it is / ``</name>``, with no quoting or escaping
  (code in a JSON string is where small models slip), e.g.::

      <tool_call>{"name": "replace", "arguments": {"path": "pkg/mod.py"}}
      <old>
          return "a"
      </old>
      <new>
          return "b"
      </new>
      </tool_call>
- The environment answers with one message holding the tool's output (or an error that
  starts with ``Error:``), rendered through the tokenizer's chat template with the ``tool``
  role; a template without a tool role gets a ``user`` message whose text starts with
  ``[tool result]`` instead (see ``rollout.agent``).
- A message without ``<tool_call>`` is the model's final answer; calling ``finish`` ends the
  episode too.
- The older attribute form ``<tool_call name="read_file">{"path": "pkg/mod.py"}</tool_call>``
  (the arguments object alone; how earlier trace files wrote calls) is read as the same call.

This is the project's text format (:class:`~composer_replication.rollout.tool_formats.
TextToolFormat`); a chat template with tool calls of its own gets
:class:`~composer_replication.rollout.tool_formats.NativeToolFormat` instead, whose parser
shares :func:`call_from_object`.

:func:`parse_tool_call` never raises on model text: a malformed call is data, a
:class:`ToolCallError` whose ``kind`` is one of :data:`ERROR_KINDS` and whose ``message`` is
the text sent back to the model (worded so that ``hint_generator.classify_error`` maps a
JSON error to ``json_decode`` and an unknown tool to ``tool_not_found``). Tools report
agent-visible failures (bad path, missing argument, timeout) by raising :class:`ToolError`.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ERROR_KINDS",
    "FINISH_TOOL",
    "STOP_STRINGS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ToolCall",
    "ToolCallError",
    "ToolError",
    "ToolParameter",
    "ToolResult",
    "ToolSpec",
    "call_from_object",
    "example_text",
    "format_tool_call",
    "parse_tool_call",
    "tool_instructions",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
STOP_STRINGS: tuple[str, ...] = (TOOL_CALL_CLOSE,)
FINISH_TOOL = "finish"
# no_call: the text has no <tool_call> (a final answer, not an error when the model is done).
ERROR_KINDS: tuple[str, ...] = (
    "no_call",
    "json_decode",
    "missing_name",
    "bad_arguments",
    "unknown_tool",
)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's ``name``, its ``arguments`` and the JSON text it came
    from (treat ``arguments`` as read-only)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""


@dataclass(frozen=True)
class ToolCallError:
    """Text that is not a usable call. ``kind`` is one of :data:`ERROR_KINDS`, ``message`` is
    the observation sent back to the model, ``raw`` the text between the tags (if any) and
    ``name`` the tool name when one could be read."""

    kind: str
    message: str
    raw: str = ""
    name: str | None = None


class ToolError(Exception):
    """Raised by a tool for a failure the model should see and can recover from.

    ``kind`` classifies it for the rollout's event log: ``bad_arguments``, ``path_error``,
    ``timeout``, ``no_match`` / ``ambiguous_match`` (an edit), or the generic
    ``tool_error``; ``info`` is logged with it (e.g. a timed-out test run's counts).
    """

    def __init__(
        self, message: str, kind: str = "tool_error", info: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.info = dict(info or {})


@dataclass(frozen=True)
class ToolResult:
    """A tool's successful output: ``text`` (the observation) and ``info`` (facts about the
    call for the rollout's event log, e.g. a test run's counts; never shown to the model)."""

    text: str
    info: Mapping[str, Any] = field(default_factory=dict)


#: JSON-schema types a tool parameter may have.
PARAMETER_TYPES = ("string", "integer", "number", "boolean", "array", "object")


@dataclass(frozen=True)
class ToolParameter:
    """One argument of a tool: its JSON-schema ``type`` (``items``: the element type of an
    ``array``), whether it is ``required``, and what it means. ``raw``: a text argument
    (code) that the project's text format writes as a block after the call's object."""

    name: str
    description: str
    type: str = "string"
    required: bool = True
    items: str | None = None
    raw: bool = False

    def __post_init__(self) -> None:
        if self.type not in PARAMETER_TYPES:
            raise ValueError(
                f"tool parameter {self.name!r}: type {self.type!r} is not one of {PARAMETER_TYPES}"
            )

    def schema(self) -> dict[str, Any]:
        """The JSON schema of this parameter."""
        out: dict[str, Any] = {"type": self.type, "description": self.description}
        if self.type == "array":
            out["items"] = {"type": self.items or "string"}
        return out


@dataclass(frozen=True)
class ToolSpec:
    """How a tool is described to the model.

    ``parameters`` are :class:`ToolParameter` s; a plain ``(name, description)`` pair is a
    required string parameter.
    """

    name: str
    description: str
    parameters: tuple[ToolParameter | tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        params = tuple(
            p if isinstance(p, ToolParameter) else ToolParameter(str(p[0]), str(p[1]))
            for p in self.parameters
        )
        object.__setattr__(self, "parameters", params)

    @property
    def params(self) -> tuple[ToolParameter, ...]:
        """``parameters`` as :class:`ToolParameter` s."""
        return self.parameters  # type: ignore[return-value]

    def schema(self) -> dict[str, Any]:
        """The tool as an OpenAI-style function schema (what a chat template's ``tools=``
        takes)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {p.name: p.schema() for p in self.params},
                    "required": [p.name for p in self.params if p.required],
                },
            },
        }


def format_tool_call(
    name: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    sort_keys: bool = False,
    raw: Collection[str] = (),
) -> str:
    """The canonical text of a call, exactly as the model is asked to write it (non-ASCII
    text as it is; ``sort_keys``: the arguments' keys sorted, as trace renderings want).
    String arguments named in ``raw`` follow the object as blocks (see the module
    docstring), unless their text could not end its block."""
    arguments = dict(arguments or {})
    blocks = {
        key: value
        for key, value in arguments.items()
        if key in raw and isinstance(value, str) and _fits_block(key, value)
    }
    inline = {k: v for k, v in arguments.items() if k not in blocks}
    if sort_keys:
        inline = dict(sorted(inline.items()))
    body = json.dumps({"name": name, "arguments": inline}, ensure_ascii=False)
    if sort_keys:  # nested objects sorted too
        inner = json.dumps(inline, ensure_ascii=False, sort_keys=True)
        body = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {inner}}}'
    body = body.replace("</", "<\\/")  # JSON's "\/" escape: a closing tag in a string stays data
    if not blocks:
        return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"
    text = "".join(f"\n<{key}>\n{value}\n</{key}>" for key, value in blocks.items())
    return f"{TOOL_CALL_OPEN}{body}{text}\n{TOOL_CALL_CLOSE}"


def _fits_block(key: str, value: str) -> bool:
    return f"\n</{key}>" not in f"\n{value}" and TOOL_CALL_CLOSE not in value


_BLOCK = re.compile(r"\s*<([A-Za-z_][A-Za-z0-9_]*)>\n(.*?)\n</\1>", re.DOTALL)


def tool_instructions(tools: Sequence[ToolSpec], preamble: str = "") -> str:
    """The system prompt: ``preamble``, the call format, and one line per tool."""
    lines = [preamble.strip(), ""] if preamble.strip() else []
    lines += [
        "You act by calling tools. To call a tool, write exactly one JSON object between "
        f"{TOOL_CALL_OPEN} and {TOOL_CALL_CLOSE}, with the tool's name and an object of "
        "arguments, and stop; for example:",
        format_tool_call("read_file", {"path": "package/module.py"}),
    ]
    with_text = next((spec for spec in tools if any(p.raw for p in spec.params)), None)
    if with_text is not None:
        raw = [p.name for p in with_text.params if p.raw]
        example = {
            p.name: example_text(p.name) if p.raw else "package/module.py"
            for p in with_text.params
            if p.required
        }
        lines += [
            "A (text) argument, such as code, goes after the object instead, between <name> "
            "and </name> lines, written exactly as it is (no quotes, no escapes); for example:",
            format_tool_call(with_text.name, example, raw=raw),
        ]
    lines += [
        "The tool's output comes back in the next message (errors start with 'Error:'). "
        "Call one tool per message. When you are done, call finish.",
        "",
        "Tools:",
    ]
    for spec in tools:
        signature = ", ".join(p.name if p.required else f"{p.name}?" for p in spec.params)
        params = (
            "; ".join(f"{p.name}{' (text)' if p.raw else ''}: {p.description}" for p in spec.params)
            or "none"
        )
        lines.append(f"- {spec.name}({signature}): {spec.description} Arguments: {params}.")
    return "\n".join(lines)


def example_text(name: str) -> str:
    """What the system prompt's example writes in text argument ``name``: a placeholder
    that reads as one, not code. A small model copies an example's code into its own edit
    (``return "a"`` for ``old`` on held-out tasks); a placeholder it does not take for
    code."""
    return f"...the {name} text, line for line..."


def _available(tool_names: Collection[str]) -> str:
    return ", ".join(sorted(tool_names)) or "none"


_LEGACY_OPEN = re.compile(r'<tool_call\s+name\s*=\s*"([^"]*)"\s*>')


def parse_tool_call(
    text: str, tool_names: Collection[str] | None = None
) -> ToolCall | ToolCallError:
    """The first call in ``text``, or why there is none. Never raises on model output.

    Args:
        text: One assistant message.
        tool_names: The tools that exist; a call to another name is ``unknown_tool``
            (None accepts any name).
    """
    start = text.find(TOOL_CALL_OPEN)
    legacy = _LEGACY_OPEN.search(text)
    if legacy is not None and (start < 0 or legacy.start() < start):
        return _parse_legacy(text, legacy, tool_names)
    if start < 0:
        return ToolCallError(
            "no_call", f"Error: no tool call found; write {TOOL_CALL_OPEN}{{...}}{TOOL_CALL_CLOSE}"
        )
    body_start = start + len(TOOL_CALL_OPEN)
    end = text.find(TOOL_CALL_CLOSE, body_start)
    if end < 0:
        return unclosed_call(text[body_start:])
    raw = text[body_start:end]
    return _parse_body(raw, tool_names)


def _parse_body(raw: str, tool_names: Collection[str] | None) -> ToolCall | ToolCallError:
    """The call between the tags: a JSON object, then any argument blocks."""
    body = raw.lstrip()
    try:
        data, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as err:
        return invalid_json(raw, err)
    rest, blocks = body[end:], {}
    while rest.strip():
        match = _BLOCK.match(rest)
        if match is None:
            return ToolCallError(
                "json_decode",
                "Error: the tool call is not valid JSON: after its object comes text that is not "
                "an argument block (<name>, the text on lines of its own, </name>)",
                raw=raw,
            )
        blocks[match.group(1)] = match.group(2)
        rest = rest[match.end() :]
    if blocks and isinstance(data, dict):
        arguments = data.get("arguments")
        arguments = dict(arguments) if isinstance(arguments, dict) else {}
        data = {**data, "arguments": {**arguments, **blocks}}
    return call_from_object(data, raw, tool_names)


def unclosed_call(raw: str) -> ToolCallError:
    """A call whose closing tag never came (the reply may have been cut off)."""
    return ToolCallError(
        "json_decode",
        f"Error: the {TOOL_CALL_OPEN} is never closed with {TOOL_CALL_CLOSE} (the JSON "
        "may be cut off); write the whole call again",
        raw=raw,
    )


def invalid_json(raw: str, err: json.JSONDecodeError) -> ToolCallError:
    """A call whose body is not JSON."""
    return ToolCallError(
        "json_decode",
        f"Error: the tool call is not valid JSON.\njson.decoder.JSONDecodeError: {err}",
        raw=raw,
    )


def _parse_legacy(
    text: str, match: re.Match[str], tool_names: Collection[str] | None
) -> ToolCall | ToolCallError:
    """``<tool_call name="X">{arguments}</tool_call>``: the arguments object alone."""
    end = text.find(TOOL_CALL_CLOSE, match.end())
    if end < 0:
        return unclosed_call(text[match.end() :])
    raw = text[match.end() : end].strip()
    try:
        arguments = json.loads(raw) if raw else {}
    except json.JSONDecodeError as err:
        return invalid_json(raw, err)
    return call_from_object({"name": match.group(1), "arguments": arguments}, raw, tool_names)


def call_from_object(
    data: Any,
    raw: str,
    tool_names: Collection[str] | None,
    *,
    arguments_key: str = "arguments",
    string_arguments: bool = False,
) -> ToolCall | ToolCallError:
    """A decoded call object (``{"name": ..., arguments_key: {...}}``) checked: an object,
    a non-empty name, an object of arguments, a known tool. ``string_arguments``: the
    format carries the arguments as a JSON string of that object (decoded here)."""
    if not isinstance(data, dict):
        return ToolCallError(
            "missing_name",
            f'Error: the tool call must be a JSON object with a "name", got {type(data).__name__}',
            raw=raw,
        )
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(
            "missing_name",
            'Error: the tool call has no "name" (a non-empty string naming the tool)',
            raw=raw,
        )
    arguments = data.get(arguments_key, {})
    if arguments is None:
        arguments = {}
    if string_arguments and isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else left a string: refused below
            arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return ToolCallError(
            "bad_arguments",
            f'Error: "{arguments_key}" of {name!r} must be a JSON object, got '
            f"{type(arguments).__name__}",
            raw=raw,
            name=name,
        )
    if tool_names is not None and name not in tool_names:
        return ToolCallError(
            "unknown_tool",
            f"Error: unknown tool '{name}'; available tools: {_available(tool_names)}",
            raw=raw,
            name=name,
        )
    return ToolCall(name=name, arguments=arguments, raw=raw)
