"""Short corrective hints for a coding agent at an error site (SDPO channel 2).

At an error site in a rollout (a tool error, failing tests) the data collator inserts a hint
into the context; the policy conditioned on that hint is the teacher for self-distillation.
A hint therefore has to be specific enough to help and must never leak a reference
solution: it describes the error and says what to check, nothing more.

Pieces:
- `HintContext`: what the caller knows about the error site (all keys optional).
- `HINT_TEMPLATES`: registry `error_kind -> fn(ctx) -> str`, with the five built-in kinds
  `tool_not_found`, `json_decode`, `type_error`, `runtime_error`, `repeated_failure`.
- `dispatch(kind, ctx)`: the hint text, or None for an unknown kind.
- `register(kind, fn)`: add or replace a template.
- `classify_error(text)`: map raw error output (tracebacks, pytest output, JSON decode
  errors, "unknown tool" messages) to a kind, so the training loop can call it on the
  output of a failing tool call or test run.

Every template tolerates missing or None fields: a hint is built from whatever is known.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

__all__ = [
    "HINT_TEMPLATES",
    "HintContext",
    "HintFn",
    "classify_error",
    "dispatch",
    "hint_json_decode",
    "hint_repeated_failure",
    "hint_runtime_error",
    "hint_tool_not_found",
    "hint_type_error",
    "register",
]


class HintContext(TypedDict, total=False):
    """What is known about an error site. Every key is optional.

    Keys:
        error_kind: One of the `HINT_TEMPLATES` keys (see `classify_error`).
        error_message: Raw error text: exception message, traceback or test output.
        available_tools: Names of the tools the agent may call.
        tool_name: The tool the agent called.
        tool_schema: JSON schema of that tool: OpenAI style (`{"type": "function",
            "function": {"name", "parameters"}}`), `{"name", "parameters" | "input_schema"}`,
            or a bare object schema (`{"properties", "required"}`).
        intent: What the agent was trying to do, in a few words.
    """

    error_kind: str
    error_message: str
    available_tools: Sequence[str]
    tool_name: str
    tool_schema: Mapping[str, Any]
    intent: str


HintFn = Callable[[HintContext], str]

# Hints quote at most this much of an error message; the tail is kept because a traceback's
# final line (exception type and message) and pytest's short summary come last.
_MAX_QUOTE_LINES = 8
_MAX_QUOTE_CHARS = 800

# An exception name at the start of a line (optionally after pytest's "E   " prefix or a
# "FAILED path::test - " summary), followed by ":" or the end of the line.
_EXC_NAME = (
    r"(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Timeout|Expired)|Exception)"
)
_EXC_LINE_RE = re.compile(
    rf"^(?:E\s+|(?:FAILED|ERROR)\s+\S+\s+-\s+)?(?P<name>{_EXC_NAME})(?::(?P<msg>.*))?\s*$",
    re.MULTILINE,
)
# A location in a Python traceback (`File "x.py", line 3, in f`) or in pytest's output
# (`x.py:3: in f` or `x.py:3: ZeroDivisionError`).
_LOCATION_RE = re.compile(
    r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)'
    r"|^(?P<pfile>[^\s:\"]+\.py):(?P<pline>\d+): (?:in (?P<pfn>\S+)|\S+)",
    re.MULTILINE,
)
_JSON_POS_RE = re.compile(r"line (?P<line>\d+) column (?P<col>\d+) \(char (?P<char>\d+)\)")
_JSON_MSG_RE = re.compile(
    r"JSONDecodeError"
    r"|Expecting (?:value|property name enclosed in double quotes|',' delimiter|':' delimiter)"
    r"|Unterminated string starting at|Extra data: line \d+|Invalid control character at"
    r"|Invalid \\escape"
)
_TOOL_NOT_FOUND_RE = re.compile(
    r"\b(?:unknown|unrecognized|unrecognised|invalid|unsupported|undefined) tool\b"
    r"|\bno such tool\b|\bno tool named\b|ToolNotFound"
    r"|\btool\b[^\n]{0,80}?\b(?:not found|does not exist|doesn't exist|is not available|"
    r"not available|is not registered|not registered)\b",
    re.IGNORECASE,
)
_TOOL_NAME_IN_MSG_RE = re.compile(
    r"""(?:tool(?: named)?|function)\s*[:=]?\s*['"`](?P<name>[^'"`\s]+)['"`]""", re.IGNORECASE
)
_FAILURE_MARKERS_RE = re.compile(
    r"Traceback \(most recent call last\)"
    r"|^(?:FAILED|ERROR) \S"
    r"|^E\s{2,}\S"
    r"|^=+ (?:FAILURES|ERRORS) =+"
    r"|\b[1-9]\d* (?:failed|errors?)\b"  # pytest summary; "0 failed" is not a failure
    r"|^(?i:error|fatal)\b\s*:"
    r"|command not found|Segmentation fault|\btimed out\b|^Killed\b",
    re.MULTILINE,
)
_MISSING_ARG_RE = re.compile(
    r"missing \d+ required (?:positional |keyword-only )?arguments?: (?P<args>.+)"
)
_UNEXPECTED_KW_RE = re.compile(r"unexpected keyword argument '(?P<arg>[^']+)'")
_QUOTED_RE = re.compile(r"'([^']+)'")


# ------------------------------------------------------------------------------ helpers


def _text(ctx: Mapping[str, Any], key: str) -> str:
    """ctx[key] as a stripped str; "" when missing or None."""
    value = ctx.get(key)
    return "" if value is None else str(value).strip()


def _tool_names(ctx: Mapping[str, Any]) -> list[str]:
    """`available_tools` as names; accepts names or tool schemas with a "name"."""
    tools = ctx.get("available_tools")
    if not tools or isinstance(tools, str):
        return [tools] if isinstance(tools, str) and tools else []
    names = []
    for t in tools:
        if isinstance(t, Mapping):
            t = t.get("name") or (t.get("function") or {}).get("name")
        if t:
            names.append(str(t))
    return names


def _tail(
    message: str, max_lines: int = _MAX_QUOTE_LINES, max_chars: int = _MAX_QUOTE_CHARS
) -> str:
    """The last lines of `message`, "..."-prefixed when cut."""
    lines = message.rstrip().splitlines()
    cut = len(lines) > max_lines
    text = "\n".join(lines[-max_lines:])
    if len(text) > max_chars:
        text = text[-max_chars:]
        # Drop the partial first line unless the whole tail is one line.
        text = text.split("\n", 1)[1] if "\n" in text else text
        cut = True
    return f"...\n{text}" if cut else text


def _final_exception(message: str) -> tuple[str, str] | None:
    """(exception name, message) of the last exception line in `message`, if any."""
    matches = list(_EXC_LINE_RE.finditer(message))
    if not matches:
        return None
    m = matches[-1]
    return m.group("name"), (m.group("msg") or "").strip()


def _schema_parts(schema: Mapping[str, Any] | None) -> tuple[str, dict[str, str], list[str]]:
    """(tool name, {param: type}, required params) from a tool schema; empty when unknown."""
    if not isinstance(schema, Mapping):
        return "", {}, []
    if isinstance(schema.get("function"), Mapping):  # OpenAI {"type": "function", ...}
        schema = schema["function"]
    name = str(schema.get("name") or "")
    params: Any = schema
    for key in ("parameters", "input_schema", "inputSchema"):
        if isinstance(schema.get(key), Mapping):
            params = schema[key]
            break
    props = params.get("properties") if isinstance(params, Mapping) else None
    types: dict[str, str] = {}
    if isinstance(props, Mapping):
        for p, spec in props.items():
            t = spec.get("type") if isinstance(spec, Mapping) else None
            types[str(p)] = "|".join(map(str, t)) if isinstance(t, list) else str(t or "any")
    required = params.get("required") if isinstance(params, Mapping) else None
    req = [str(r) for r in required] if isinstance(required, list | tuple) else []
    return name, types, req


def _fmt_params(names: Sequence[str], types: Mapping[str, str]) -> str:
    return ", ".join(f"{n} ({types[n]})" if n in types else n for n in names)


# ------------------------------------------------------------------------------ templates


def hint_tool_not_found(ctx: HintContext) -> str:
    """The called tool does not exist: name the closest real tool and list them all."""
    tool = _text(ctx, "tool_name")
    if not tool:
        m = _TOOL_NAME_IN_MSG_RE.search(_text(ctx, "error_message"))
        tool = m.group("name") if m else ""
    tools = _tool_names(ctx)
    parts = [
        f"The tool '{tool}' does not exist." if tool else "The tool you called does not exist."
    ]
    if tools:
        close = difflib.get_close_matches(tool, tools, n=1, cutoff=0.6) if tool else []
        if close:
            parts.append(f"Did you mean '{close[0]}'?")
        parts.append(f"Available tools: {', '.join(tools)}.")
        parts.append("Call one of them by its exact name.")
    else:
        parts.append("Check the tool list you were given and call a tool by its exact name.")
    return " ".join(parts)


def hint_json_decode(ctx: HintContext) -> str:
    """The arguments were not valid JSON: point at the reported position and common causes."""
    message = _text(ctx, "error_message")
    tool = _text(ctx, "tool_name")
    subject = f"The arguments for '{tool}' are not valid JSON" if tool else "The JSON is not valid"
    parts = []
    if message:
        final = _final_exception(message)
        detail = final[1] if final and final[1] else message.splitlines()[-1].strip()
        parts.append(f"{subject}: {detail}.")
    else:
        parts.append(f"{subject}.")
    pos = _JSON_POS_RE.search(message)
    if pos:
        parts.append(
            f"Look at line {pos['line']}, column {pos['col']} (character {pos['char']}) and "
            "just before it."
        )
    parts.append(
        "Common causes: single quotes instead of double quotes, unquoted keys, a trailing "
        "comma, an unescaped quote or raw newline inside a string, or text around the object. "
        "Send exactly one JSON object."
    )
    return " ".join(parts)


def hint_type_error(ctx: HintContext) -> str:
    """Wrong arguments for a call: name the missing / unexpected ones and the schema's args."""
    message = _text(ctx, "error_message")
    schema_name, types, required = _schema_parts(ctx.get("tool_schema"))
    tool = _text(ctx, "tool_name") or schema_name
    final = _final_exception(message) if message else None
    detail = final[1] if final and final[0] == "TypeError" and final[1] else ""
    if not detail and message:
        detail = message.splitlines()[-1].strip()
    target = f"'{tool}'" if tool else "the function"
    parts = [f"The call to {target} has the wrong arguments" + (f": {detail}." if detail else ".")]
    missing = _MISSING_ARG_RE.search(detail)
    if missing:
        names = _QUOTED_RE.findall(missing["args"])
        if names:
            parts.append(f"Pass the missing argument(s): {_fmt_params(names, types)}.")
    unexpected = _UNEXPECTED_KW_RE.search(detail)
    if unexpected:
        bad = unexpected["arg"]
        close = difflib.get_close_matches(bad, list(types), n=1, cutoff=0.5)
        suggestion = f" Did you mean '{close[0]}'?" if close else ""
        parts.append(f"'{bad}' is not a parameter of {target}.{suggestion}")
    if types or required:
        if required:
            parts.append(f"Required arguments: {_fmt_params(required, types)}.")
        optional = [p for p in types if p not in required]
        if optional:
            parts.append(f"Optional: {_fmt_params(optional, types)}.")
        parts.append("Use exactly these names and types.")
    else:
        parts.append("Check the signature: argument names, count and types.")
    return " ".join(parts)


def hint_runtime_error(ctx: HintContext) -> str:
    """The code or command failed: quote the tail of the error and say where to look."""
    message = _text(ctx, "error_message")
    tool = _text(ctx, "tool_name")
    head = f"'{tool}' failed" if tool else "The run failed"
    if not message:
        return f"{head}. Read the error output, find the failing line, and fix the cause."
    parts = []
    final = _final_exception(message)
    if final:
        parts.append(f"The error is {final[0]}" + (f": {final[1]}." if final[1] else "."))
    locations = list(_LOCATION_RE.finditer(message))
    if locations:
        loc = locations[-1]
        file, line = loc["file"] or loc["pfile"], loc["line"] or loc["pline"]
        fn = loc["fn"] or loc["pfn"]
        parts.append(f"It was raised at {file}, line {line}" + (f", in {fn}." if fn else "."))
        parts.append("Read that line and the values it uses; check your assumptions about them.")
    else:
        parts.append("Find where it is raised and check your assumptions about the values there.")
    parts.append("Fix the cause, not the symptom.")
    return f"{head} with:\n{_tail(message)}\n" + " ".join(parts)


def hint_repeated_failure(ctx: HintContext) -> str:
    """The same attempt keeps failing: tell the agent to change approach, not to retry."""
    intent = _text(ctx, "intent")
    tool = _text(ctx, "tool_name")
    message = _text(ctx, "error_message")
    parts = ["The same approach has failed several times; repeating it will fail again."]
    if message:
        final = _final_exception(message)
        last = f"{final[0]}: {final[1]}" if final and final[1] else message.splitlines()[-1]
        parts.append(f"Last error: {last.strip()}.")
    if intent:
        parts.append(f"Your goal is still: {intent}.")
    if tool:
        parts.append(f"Stop calling '{tool}' the same way.")
    parts.append(
        "Step back: re-read the task and the relevant code, question the assumption behind "
        "your attempts, and try a different approach (another tool, a smaller step, or "
        "inspecting the state first)."
    )
    return " ".join(parts)


HINT_TEMPLATES: dict[str, HintFn] = {
    "tool_not_found": hint_tool_not_found,
    "json_decode": hint_json_decode,
    "type_error": hint_type_error,
    "runtime_error": hint_runtime_error,
    "repeated_failure": hint_repeated_failure,
}


# ------------------------------------------------------------------------------ registry


def dispatch(error_kind: str, ctx: HintContext | None = None) -> str | None:
    """The hint for `error_kind` built from `ctx`, or None when the kind has no template."""
    if not isinstance(error_kind, str):
        return None
    fn = HINT_TEMPLATES.get(error_kind)
    if fn is None:
        return None
    return fn(ctx if ctx is not None else HintContext())


def register(error_kind: str, fn: HintFn) -> HintFn:
    """Add a template for `error_kind`, replacing any existing one; returns `fn`."""
    if not isinstance(error_kind, str):
        raise TypeError(f"error_kind must be a str, got {error_kind!r}")
    if not error_kind.strip():
        raise ValueError(f"error_kind must be a non-empty str, got {error_kind!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(ctx) -> str, got {fn!r}")
    HINT_TEMPLATES[error_kind] = fn
    return fn


def classify_error(text: str) -> str | None:
    """Map raw error output to a `HINT_TEMPLATES` kind, or None when it shows no error.

    Rules, first match wins: an "unknown tool" message -> "tool_not_found"; the final
    exception is a JSONDecodeError -> "json_decode"; it is a TypeError -> "type_error"; any
    other final exception -> "runtime_error" (a ValueError carrying a JSON decode message
    counts as "json_decode"); with no exception line, a JSON decode message -> "json_decode"
    and test-failure / shell-error markers -> "runtime_error". Never returns
    "repeated_failure": that needs the rollout's history, not one message.
    """
    if not isinstance(text, str) or not text.strip():
        return None
    if _TOOL_NOT_FOUND_RE.search(text):
        return "tool_not_found"
    final = _final_exception(text)
    if final is not None:
        name = final[0].rsplit(".", 1)[-1]
        if name == "JSONDecodeError":
            return "json_decode"
        if name == "TypeError":
            return "type_error"
        if name == "ValueError" and _JSON_MSG_RE.search(final[1]):
            return "json_decode"
        return "runtime_error"
    if _JSON_MSG_RE.search(text):
        return "json_decode"
    if _FAILURE_MARKERS_RE.search(text):
        return "runtime_error"
    return None
