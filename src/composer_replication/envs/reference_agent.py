"""The scripted reference agent: a task's gold answer as tool calls, through the real loop.

A repository task's reference is an edit of some files (a deleted body put back, a gold
patch applied). :func:`edits_between` turns the files before and after into ``replace``
edits whose ``old`` text occurs exactly once (grown by neighbouring lines until it does);
:func:`reference_calls` makes the episode a careful agent would run with the editing tools:
read the lines around each change, replace, run the target tests, finish.

Run through the same agent loop, tools, sandbox and grader as the policy, within the
configured turn and token budgets, the script is the solvability gate (every accepted task
is proven solvable by an agent restricted to those tools and budgets; verifiers' "each task
validates its own gold answer") and its episode is the task's demonstration (the warm
start of ``sampling.source = "reference"``). :func:`reply_budget_problem` says why a script
cannot fit before anything runs.

A demonstration that only ever succeeds never shows what to do after a failing test run, so
a warm-started policy that misses once repeats itself. :func:`with_recovery` makes the
episode of a first attempt with a near miss (:func:`near_miss`: a flipped comparison, a
swapped boolean, an off-by-one, as a model errs), the failing test run, and the fix that
replaces the near miss by the right code; the near-miss turn is shown, never imitated
(error-correction demonstrations, in the spirit of DAgger, arXiv:1011.0686).
"""

from __future__ import annotations

import difflib
import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from composer_replication.envs.definitions import definitions, docstring_lines, without_docstring
from composer_replication.envs.fd_tools import occurrences

__all__ = [
    "REFERENCE_EDITS",
    "SHORT_DOCSTRING_LINES",
    "Edit",
    "ReferenceCost",
    "edits_between",
    "near_miss",
    "reference_calls",
    "reference_cost",
    "reference_edits_for",
    "reply_budget_problem",
    "reply_span",
    "stable_share",
    "with_recovery",
    "without_reply",
    "without_text",
]

#: lines shown around a change when the reference agent reads it first
READ_CONTEXT = 3
#: how the reference agent edits: "lines" (``replace`` of the changed lines), "functions"
#: (``replace`` of the whole definition holding a change) or "definitions" (the whole
#: definition written once with ``replace_function``)
REFERENCE_EDITS = ("lines", "functions", "definitions")


#: docstrings of at most this many lines are written with the code they document (read
#: just before the body, a summary steers a small model's rewrite: measured in
#: docs/benchmarks.md); longer ones (doctests, explanations) are left to the tool to keep
SHORT_DOCSTRING_LINES = 3


def reference_edits_for(tools: Sequence[str]) -> str:
    """The reference edits an agent with ``tools`` can make: "definitions" when it has
    ``replace_function`` and no ``replace``, else "lines"."""
    return "definitions" if "replace_function" in tools and "replace" not in tools else "lines"


@dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of ``old`` in ``path`` by ``new``; ``first_line`` and
    ``last_line`` are where ``old`` sits in the file before (1-based)."""

    path: str
    old: str
    new: str
    first_line: int
    last_line: int
    #: the qualified name of the one definition ``old`` is, whole (None: any other text)
    function: str | None = None


def _unique_span(lines: Sequence[str], lo: int, hi: int, text: str) -> tuple[int, int]:
    """Grow the line span [lo, hi) until its text occurs once in ``text``."""
    while True:
        old = "".join(lines[lo:hi])
        if old.strip() and len(occurrences(text, old)) == 1:
            return lo, hi
        if lo == 0 and hi == len(lines):
            return lo, hi
        lo, hi = max(0, lo - 1), min(len(lines), hi + 1)


def edits_between(
    path: str, before: str, after: str, *, whole_functions: bool = False
) -> list[Edit]:
    """The ``replace`` edits that turn ``before`` into ``after``, in file order: one per
    changed region, each ``old`` occurring exactly once in the file as the edits before it
    left it (a pure insertion takes a neighbouring line as its anchor; regions whose spans
    meet, or whose ``old`` an earlier edit made ambiguous, become one edit). Applied in
    order, they give ``after`` exactly.

    ``whole_functions``: a change inside a function (of Python source that parses) takes
    the whole definition as its span, decorators and signature included, so the edit
    writes the function as a whole (the way code is written, and read, top to bottom)."""
    if not before:  # nothing to anchor a replacement on: the file is written whole
        return [Edit(path, "", after, 0, 0)] if after else []
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    functions = _function_spans(before) if whole_functions else {}
    opcodes = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    spans: list[tuple[int, int, set[int]]] = []  # (lo, hi, indices of the changed blocks)
    for k, (tag, i1, i2, _j1, _j2) in enumerate(opcodes):
        if tag == "equal":
            continue
        lo, hi = i1, i2
        if lo == hi:  # an insertion: anchor it on a neighbouring line
            lo, hi = (lo - 1, hi) if lo > 0 else (lo, min(len(a), hi + 1))
        inside = [(f_lo, f_hi) for f_lo, f_hi in functions if f_lo <= lo and hi <= f_hi]
        if inside:  # the innermost definition holding the change
            lo, hi = max(inside, key=lambda span: span[0])
        lo, hi = _unique_span(a, lo, hi, before)
        spans.append((lo, hi, {k}))
        while len(spans) > 1 and spans[-1][0] <= spans[-2][1]:  # spans meet: one edit
            (plo, phi, pb), (lo, hi, blocks) = spans[-2], spans.pop()
            spans[-1] = (min(lo, plo), max(hi, phi), pb | blocks)
    while True:
        edits = [_edit(path, a, b, opcodes, span) for span in spans]
        ambiguous = _first_ambiguous(before, edits)
        if ambiguous is None:
            return [
                replace(e, function=functions.get((e.first_line - 1, e.last_line))) for e in edits
            ]
        if ambiguous == 0:  # (cannot happen: the first edit's old is unique in before)
            return [Edit(path, before, after, 1, len(a))]
        (plo, phi, pb), (lo, hi, blocks) = spans[ambiguous - 1], spans.pop(ambiguous)
        spans[ambiguous - 1] = (min(lo, plo), max(hi, phi), pb | blocks)


def _function_spans(source: str) -> dict[tuple[int, int], str]:
    """0-based [first, end) line spans of every function definition (decorators in) -> its
    qualified name (None where another definition has the same one: a name that cannot say
    which); none for source that does not parse."""
    found = definitions(source)
    names = Counter(d.qualname for d in found)
    return {
        (d.first_line - 1, d.last_line): d.qualname if names[d.qualname] == 1 else None
        for d in found
    }


def _edit(
    path: str, a: list[str], b: list[str], opcodes: list[Any], span: tuple[int, int, set[int]]
) -> Edit:
    lo, hi, blocks = span
    new = []
    for k, (tag, i1, i2, j1, j2) in enumerate(opcodes):
        if tag == "equal":
            new += a[max(i1, lo) : min(i2, hi)]
        elif k in blocks:
            new += b[j1:j2]
    return Edit(path, "".join(a[lo:hi]), "".join(new), lo + 1, max(lo + 1, hi))


def _first_ambiguous(text: str, edits: Sequence[Edit]) -> int | None:
    """The first edit whose ``old`` does not occur exactly once when its turn comes."""
    for k, edit in enumerate(edits):
        found = occurrences(text, edit.old)
        if len(found) != 1:
            return k
        text = text[: found[0]] + edit.new + text[found[0] + len(edit.old) :]
    return None


def _strip_line_end(edit: Edit) -> tuple[str, str]:
    """``old`` / ``new`` without the line end they share (what a person would copy)."""
    old, new = edit.old, edit.new
    if old.endswith("\n") and new.endswith("\n"):
        return old[:-1], new[:-1]
    return old, new


def reference_calls(
    edits: Sequence[Edit],
    target_tests: Sequence[str],
    *,
    line_counts: Callable[[str], int] | None = None,
    read: bool = True,
    rewrite_functions: bool = False,
) -> list[tuple[str, dict[str, Any]]]:
    """The reference agent's episode as ``(tool, arguments)`` calls: per edited file, read
    the lines around its changes (unless ``read`` is False: the task's prompt shows them);
    each ``replace`` (with ``rewrite_functions``, an edit that is one whole definition is
    ``replace_function`` with the new definition: the code written once, not copied
    first; a docstring of more than :data:`SHORT_DOCSTRING_LINES` lines that did not
    change is left out, and the tool keeps it);
    ``run_tests`` on the target tests' files; ``finish``."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for path in dict.fromkeys(e.path for e in edits if e.old and read):
        spans = [e for e in edits if e.path == path]
        start = max(1, spans[0].first_line - READ_CONTEXT)
        end = spans[-1].last_line + READ_CONTEXT
        if line_counts is not None:
            end = min(end, max(1, line_counts(path)))
        calls.append(("read_file", {"path": path, "start_line": start, "end_line": end}))
    for edit in edits:
        if not edit.old:  # a new file
            calls.append(("create_file", {"path": edit.path, "content": edit.new}))
            continue
        old, new = _strip_line_end(edit)
        if rewrite_functions and edit.function is not None:
            kept = docstring_lines(old)
            long_doc = kept is not None and len(kept) > SHORT_DOCSTRING_LINES
            code = without_docstring(new) if long_doc and kept == docstring_lines(new) else new
            calls.append(
                ("replace_function", {"path": edit.path, "name": edit.function, "code": code})
            )
            continue
        calls.append(("replace", {"path": edit.path, "old": old, "new": new}))
    tests = list(dict.fromkeys(t.split("::", 1)[0] for t in target_tests))  # their files
    calls.append(("run_tests", {"tests": tests} if tests else {}))
    calls.append(("finish", {}))
    return calls


#: small mistakes of the kind a model makes, tried in order on each code line
_NEAR_MISSES = (
    (" == ", " != "),
    (" != ", " == "),
    (" <= ", " < "),
    (" >= ", " > "),
    (" < ", " <= "),
    (" > ", " >= "),
    (" and ", " or "),
    (" or ", " and "),
    (" is not ", " is "),
    ("not ", ""),
    ("True", "False"),
    ("False", "True"),
    (" + 1", " - 1"),
    (" - 1", " + 1"),
    ("[0]", "[-1]"),
    ("[-1]", "[0]"),
)


def near_miss(code: str) -> str:
    """``code`` with one small mistake: on the first code line where one applies, the first
    of a few near misses (a comparison flipped, a boolean swapped, an off-by-one, the wrong
    end of a list); code with none becomes ``return None`` at its indentation (``pass``
    when it is that already)."""
    lines = code.split("\n")
    for k, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", '"', "'")):
            continue
        for right, wrong in _NEAR_MISSES:
            if right in line:
                lines[k] = line.replace(right, wrong, 1)
                return "\n".join(lines)
    first = next((line for line in lines if line.strip()), "")
    indent = first[: len(first) - len(first.lstrip())]
    return f"{indent}pass" if code.strip() == "return None" else f"{indent}return None"


def with_recovery(
    calls: Sequence[tuple[str, dict[str, Any]]],
    files: Callable[[str], str],
    *,
    max_turns: int,
) -> tuple[list[tuple[str, dict[str, Any]]], int] | None:
    """:func:`reference_calls`' episode with a failed first attempt: its ``replace`` is made
    with a :func:`near_miss`, the tests run (and fail), the near miss is replaced by the
    right code, the tests run again when ``max_turns`` leaves room, then ``finish``.

    Returns the calls and the index of the near-miss call (a turn to show, never to
    imitate), or None for an episode without exactly one ``replace`` and one ``run_tests``,
    or one whose recovery does not fit ``max_turns``. ``files(path)``: the file's text
    before the episode.
    """
    replaces = [k for k, (name, _) in enumerate(calls) if name == "replace"]
    tests = [(name, args) for name, args in calls if name == "run_tests"]
    if len(replaces) != 1 or len(tests) != 1:
        return None
    k = replaces[0]
    arguments = calls[k][1]
    path, old, new = arguments["path"], arguments["old"], arguments["new"]
    wrong = near_miss(new)
    before = files(path)
    if len(occurrences(before, old)) != 1:
        return None
    fixes = [
        ("replace", {"path": path, "old": o, "new": n})
        for o, n in map(
            _strip_line_end,
            edits_between(path, before.replace(old, wrong, 1), before.replace(old, new, 1)),
        )
    ]
    episode = [*calls[:k], ("replace", {**arguments, "new": wrong}), tests[0], *fixes]
    rest = [c for c in calls[k + 1 :] if c[0] != "run_tests"]
    if len(episode) + len(rest) + 1 <= max_turns:  # room to see the fix pass
        episode.append(tests[0])
    episode += rest
    return (episode, k) if len(episode) <= max_turns else None


def stable_share(task_id: str) -> float:
    """Where ``task_id`` falls in [0, 1), the same in every run and process: tasks below a
    share ``f`` are a fixed ``f`` of them."""
    return int(hashlib.sha256(task_id.encode("utf-8")).hexdigest()[:8], 16) / 2**32


def reply_span(mask: Sequence[int], index: int) -> tuple[int, int] | None:
    """The token range ``[start, end)`` of reply ``index`` (0-based) of a multi-turn
    completion whose ``mask`` is 1 on the model's replies, or None when it has fewer."""
    reply, start = -1, None
    for k, m in enumerate([*mask, 0]):
        if m and (k == 0 or not mask[k - 1]):
            reply += 1
            if reply == index:
                start = k
        if start is not None and not m:
            return start, k
    return None


def without_text(
    mask: Sequence[int],
    token_ids: Sequence[int],
    index: int,
    text: str,
    decode: Callable[[Sequence[int]], str],
) -> list[int]:
    """``mask`` with the tokens of reply ``index`` that write ``text`` set to 0 (the last
    place it occurs in the reply): the rest of the reply is still trained on. A near miss's
    tool call, path and ``old`` text are right; only its code is wrong, so only the code
    is left out. Where the reply does not hold ``text`` as written (a format that escapes
    it) the whole reply is left out (:func:`without_reply`). ``decode``: the tokenizer's
    ``decode``, which maps the tokens back to their characters."""
    span = reply_span(mask, index)
    if span is None:
        return list(mask)
    start, end = span
    where = decode(token_ids[start:end]).rfind(text) if text else -1
    if where < 0:
        return without_reply(mask, index)
    out, last, begin = list(mask), where + len(text), 0
    for k in range(start, end):
        stop = len(decode(token_ids[start : k + 1]))  # the characters up to token k
        if stop > where and begin < last:  # token k writes some of text
            out[k] = 0
        begin = stop
    return out


def without_reply(mask: Sequence[int], index: int) -> list[int]:
    """``mask`` (a multi-turn completion's: 1 on the model's replies) with reply ``index``
    (0-based) set to 0: shown in the context, not trained on."""
    out, reply, inside = list(mask), -1, False
    for k, m in enumerate(out):
        if m and not inside:
            reply += 1
        inside = bool(m)
        if m and reply == index:
            out[k] = 0
    return out


@dataclass(frozen=True)
class ReferenceCost:
    """What a reference episode needed: its turns, its longest reply (tokens) and its
    whole length (prompt and completion tokens)."""

    turns: int
    max_reply_tokens: int
    total_tokens: int

    def problem(self, *, max_turns: int, max_new_tokens: int, max_total_tokens: int) -> str | None:
        """Why these budgets are too small for it, or None."""
        if self.turns > max_turns:
            return f"the reference needs {self.turns} turns; max_turns is {max_turns}"
        if self.max_reply_tokens > max_new_tokens:
            return (
                f"the reference's longest reply has {self.max_reply_tokens} tokens; the turn "
                f"budget (sampling.max_new_tokens) is {max_new_tokens}"
            )
        if self.total_tokens > max_total_tokens:
            return (
                f"the reference episode has {self.total_tokens} tokens; max_total_tokens is "
                f"{max_total_tokens}"
            )
        return None


def reply_budget_problem(
    replies: Sequence[str], tokenizer: Any, *, max_turns: int, max_new_tokens: int
) -> str | None:
    """Why the scripted ``replies`` cannot fit the budgets (too many turns, a reply longer
    than a turn's token budget), or None."""
    if len(replies) > max_turns:
        return f"the reference needs {len(replies)} turns; max_turns is {max_turns}"
    for reply in replies:
        n = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        if n > max_new_tokens:
            name = reply.split('"name": "', 1)[-1].split('"', 1)[0]
            return (
                f"the reference's {name} call has {n} tokens; the turn budget "
                f"(sampling.max_new_tokens) is {max_new_tokens}"
            )
    return None


def reference_cost(rollout: Any) -> ReferenceCost:
    """The :class:`ReferenceCost` of a finished reference episode (a ``Rollout``)."""
    runs, current = [], 0
    for m in rollout.completion_mask or ():
        if m:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return ReferenceCost(
        turns=int(rollout.metadata.get("turns", len(runs))),
        max_reply_tokens=max(runs, default=0),
        total_tokens=len(rollout.prompt_ids) + len(rollout.completion_ids),
    )
