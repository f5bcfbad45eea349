"""How a model writes its tool calls: the chat template's own syntax, or the project's text.

Instruct models are trained to call tools in a syntax of their own, and their chat template
knows it: given ``tools=`` (JSON schemas) it shows the tools to the model, and given an
assistant message with ``tool_calls`` it writes the call the way the model learned to. A
:class:`ToolFormat` says how one episode's model is asked for calls and how its replies
are read back:

- :class:`NativeToolFormat`, where the template supports tools: the tools go to the
  template as JSON schemas (``chat_tools``), the system prompt is the task's preamble
  alone, and the call syntax is read off the template itself (:func:`read_native_syntax`:
  a probe call is rendered and the JSON object in it located, giving the text before it,
  the text after it, the key holding the arguments and whether calls come in a list).
  Replies are parsed with that syntax; demonstrations are written by the template.
- :class:`TextToolFormat` elsewhere (and when asked for): the project's format of
  :mod:`.tool_calls` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
  taught by the system prompt (:func:`~.tool_calls.tool_instructions`); the template gets
  no tools.

:func:`tool_format_for` picks one (``mode`` "auto", "native" or "text"). Both parse with
the same checks (:func:`~.tool_calls.call_from_object`) and never raise on model text.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from composer_replication.rollout.tool_calls import (
    STOP_STRINGS,
    ToolCall,
    ToolCallError,
    ToolSpec,
    call_from_object,
    format_tool_call,
    invalid_json,
    parse_tool_call,
    tool_instructions,
)

__all__ = [
    "TOOL_FORMAT_MODES",
    "NativeSyntax",
    "NativeToolFormat",
    "TextToolFormat",
    "ToolFormat",
    "read_native_syntax",
    "tool_format_for",
]

TOOL_FORMAT_MODES = ("auto", "native", "text")
_PROBE_NAME = "cr_probe_tool"
_PROBE_ARG = "cr_probe_argument"
_PROBE_VALUE = "cr-probe-value"
_SENTINEL = "\x1fcr-probe-content\x1f"
_USER = {"role": "user", "content": "."}


class ToolFormat(Protocol):
    """What the agent loop needs to know about how calls are written."""

    #: "native" or "text"
    name: str
    #: the tools' JSON schemas for the chat template's ``tools=`` (None: none given)
    chat_tools: list[dict[str, Any]] | None
    #: strings that end a reply once a call is complete
    stop_strings: tuple[str, ...]

    def system_prompt(self, preamble: str) -> str:
        """The system message of an episode whose task says ``preamble``."""
        ...

    def format_call(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        """The text of a call exactly as the model is asked to write it."""
        ...

    def parse(
        self, text: str, tool_names: Collection[str] | None = None
    ) -> ToolCall | ToolCallError:
        """The first call in a reply, or why there is none (``no_call``: an answer)."""
        ...


@dataclass(frozen=True)
class TextToolFormat:
    """The project's text format, taught by the system prompt (see :mod:`.tool_calls`)."""

    specs: tuple[ToolSpec, ...]
    name: str = "text"
    chat_tools: list[dict[str, Any]] | None = None
    stop_strings: tuple[str, ...] = STOP_STRINGS

    def system_prompt(self, preamble: str) -> str:
        return tool_instructions(self.specs, preamble)

    def format_call(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        raw = [p.name for spec in self.specs if spec.name == name for p in spec.params if p.raw]
        return format_tool_call(name, arguments, raw=raw)

    def parse(
        self, text: str, tool_names: Collection[str] | None = None
    ) -> ToolCall | ToolCallError:
        return parse_tool_call(text, tool_names)


@dataclass(frozen=True)
class NativeSyntax:
    """A chat template's tool-call syntax, as :func:`read_native_syntax` found it.

    Attributes:
        open: the text before the call's JSON object (``"<tool_call>\\n"``; ``""`` for
            templates whose call is the bare object).
        close: the text after it, before the end of the turn (``"\\n</tool_call>"``).
        in_list: the object is the first element of a JSON list.
        arguments_key: the key holding the arguments ("arguments" or "parameters").
        nested: the object is ``{"type": "function", "function": {...}}``.
        string_arguments: the arguments are a JSON string of the object.
    """

    open: str
    close: str
    in_list: bool
    arguments_key: str
    nested: bool
    string_arguments: bool

    @property
    def stop_string(self) -> str | None:
        """The closing tag, when there is one to stop on (bare brackets are not)."""
        tag = self.close.strip()
        return tag if any(c.isalpha() for c in tag) else None


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=prompt
    )


def _call_message(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    call = {
        "type": "function",
        "id": "call_0",
        "function": {"name": name, "arguments": dict(arguments)},
    }
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _assistant_frame(tokenizer: Any, tools: Any) -> tuple[str, str]:
    """(the rendering before an assistant message's content, the text closing its turn)."""
    text = _render(tokenizer, [_USER, {"role": "assistant", "content": _SENTINEL}], tools, False)
    at = text.find(_SENTINEL)
    if at < 0:
        raise ValueError("the chat template drops assistant messages")
    return text[:at], text[at + len(_SENTINEL) :]


def _find_probe(body: str) -> tuple[int, int, Any] | None:
    """(start, end, decoded object) of the JSON object in ``body`` that holds the probe
    call, searching back from the probe's name."""
    at = body.find(f'"{_PROBE_NAME}"')
    decoder = json.JSONDecoder()
    while at > 0:
        start = body.rfind("{", 0, at)
        if start < 0:
            return None
        try:
            obj, end = decoder.raw_decode(body, start)
        except json.JSONDecodeError:
            at = start
            continue
        inner = obj.get("function") if isinstance(obj, dict) else None
        if isinstance(obj, dict) and (
            obj.get("name") == _PROBE_NAME
            or (isinstance(inner, dict) and inner.get("name") == _PROBE_NAME)
        ):
            return start, end, obj
        at = start
    return None


def read_native_syntax(tokenizer: Any) -> NativeSyntax | str:
    """The tool-call syntax of ``tokenizer``'s chat template, or why it has none usable.

    A probe tool is given to the template (it must show it), then an assistant message
    calling it is rendered; the JSON object holding the call is found in that rendering.
    """
    probe = ToolSpec(_PROBE_NAME, "probe", ((_PROBE_ARG, "probe"),)).schema()
    try:
        shown = _render(tokenizer, [_USER], [probe], True)
        if _PROBE_NAME not in shown:
            return "its chat template does not show the tools it is given"
        head, close_turn = _assistant_frame(tokenizer, [probe])
        text = _render(
            tokenizer,
            [_USER, _call_message(_PROBE_NAME, {_PROBE_ARG: _PROBE_VALUE})],
            [probe],
            False,
        )
    except Exception as err:  # templates without tool support raise on tools / tool_calls
        return f"its chat template cannot render tool calls ({type(err).__name__}: {err})"
    if not text.startswith(head):
        return "its chat template renders a tool call in a turn of another shape"
    body = text[len(head) :]
    if close_turn and body.endswith(close_turn):
        body = body[: -len(close_turn)]
    found = _find_probe(body)
    if found is None:
        return "its chat template renders no JSON object for a tool call"
    start, end, obj = found
    nested = obj.get("name") != _PROBE_NAME
    call = obj["function"] if nested else obj
    arguments_key = next(
        (k for k, v in call.items() if k != "name" and _is_probe_arguments(v)), None
    )
    if arguments_key is None:
        return "its chat template writes a tool call's arguments in a form not understood"
    open_text = body[:start]
    in_list = open_text.rstrip().endswith("[")
    return NativeSyntax(
        open=open_text,
        close=body[end:],
        in_list=in_list,
        arguments_key=arguments_key,
        nested=nested,
        string_arguments=isinstance(call[arguments_key], str),
    )


def _is_probe_arguments(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return False
    return value == {_PROBE_ARG: _PROBE_VALUE}


@dataclass(frozen=True)
class NativeToolFormat:
    """The chat template's own tool calls (see the module docstring)."""

    specs: tuple[ToolSpec, ...]
    syntax: NativeSyntax
    tokenizer: Any
    name: str = "native"

    @property
    def chat_tools(self) -> list[dict[str, Any]] | None:
        return [spec.schema() for spec in self.specs]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        stop = self.syntax.stop_string
        return (stop,) if stop else ()

    def system_prompt(self, preamble: str) -> str:
        return preamble.strip()

    def format_call(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        """The call as the template writes it (special tokens at its end dropped: the
        turn's end is the sampler's)."""
        tools = self.chat_tools
        head, close_turn = _assistant_frame(self.tokenizer, tools)
        text = _render(self.tokenizer, [_USER, _call_message(name, arguments or {})], tools, False)
        body = text[len(head) :]
        if close_turn and body.endswith(close_turn):
            body = body[: -len(close_turn)]
        specials = [t for t in getattr(self.tokenizer, "all_special_tokens", ()) if t]
        stripped = True
        while stripped:
            stripped = False
            for token in specials:
                if body.rstrip().endswith(token):
                    body, stripped = body.rstrip()[: -len(token)], True
        return body

    def parse(
        self, text: str, tool_names: Collection[str] | None = None
    ) -> ToolCall | ToolCallError:
        syntax = self.syntax
        marker = syntax.open.strip().rstrip("[").strip()
        if marker:
            at = text.find(marker)
            if at < 0:
                return ToolCallError(
                    "no_call", f"Error: no tool call found; start one with {marker}"
                )
            at += len(marker)
        else:  # the call is the reply itself: a JSON object
            at = len(text) - len(text.lstrip())
            if not text[at:].startswith(("{", "[")):
                return ToolCallError(
                    "no_call", "Error: no tool call found; write the call's JSON object"
                )
        rest = text[at:].lstrip()
        if syntax.in_list and rest.startswith("["):
            rest = rest[1:].lstrip()
        try:
            obj, end = json.JSONDecoder().raw_decode(rest)
        except json.JSONDecodeError as err:
            return invalid_json(rest, err)
        raw = rest[:end]
        if syntax.nested and isinstance(obj, dict) and isinstance(obj.get("function"), dict):
            obj = obj["function"]
        return call_from_object(
            obj,
            raw,
            tool_names,
            arguments_key=syntax.arguments_key,
            string_arguments=syntax.string_arguments,
        )


def tool_format_for(tokenizer: Any, specs: Sequence[ToolSpec], mode: str = "auto") -> ToolFormat:
    """The tool format of an episode with ``tokenizer``'s model and the tools ``specs``.

    ``mode``: "auto" (the template's own calls where it supports tools, else the text
    format), "native" (an error where it does not), "text".

    Raises:
        ValueError: an unknown mode; "native" for a template without tool calls.
    """
    if mode not in TOOL_FORMAT_MODES:
        raise ValueError(f"tool_format = {mode!r}; use one of {', '.join(TOOL_FORMAT_MODES)}")
    specs = tuple(specs)
    if mode == "text":
        return TextToolFormat(specs)
    syntax = read_native_syntax(tokenizer)
    if isinstance(syntax, str):
        if mode == "native":
            raise ValueError(
                f"tool_format = 'native', but this model's {syntax}; use tool_format = 'text' "
                "(the project's format, taught by the system prompt) or 'auto'"
            )
        return TextToolFormat(specs)
    return NativeToolFormat(specs, syntax, tokenizer)
