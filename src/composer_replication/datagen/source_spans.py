"""Exact source spans of `ast` nodes, for editing Python text in place.

`ast` reports a node's position as 1-based lines and UTF-8 *byte* columns; `SourceText`
turns those into `str` indices of the file's text (a line holding `é` before the node has
fewer characters than bytes), splits lines the way the tokenizer does (``\\r\\n``, ``\\r``
or ``\\n``, and nothing else: ``str.splitlines`` would also split on form feeds and
``\\u2028``), and knows each line's ending so that an edit can keep it.

`operator_between` finds the operator written between two operands (the gap between a
`BinOp`'s ``left`` and ``right``, between consecutive operands of a `Compare` or a `BoolOp`,
between a call's receiver and the ``.`` of its method) by scanning that gap: whitespace,
comments, line continuations and grouping parentheses are skipped, so ``(a + b)  # sum\\n
- c`` gives the ``-`` with the ``)`` before it and nothing after. The bug injector in
`bug_kinds` builds on these.
"""

from __future__ import annotations

import ast
import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "GapToken",
    "OperatorSpan",
    "SourceText",
    "gap_tokens",
    "join_lines",
    "line_ending",
    "operator_between",
    "split_lines",
    "string_interior_lines",
]

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")
# Between two operands there is only trivia (whitespace, a comment, a backslash
# continuation), grouping parentheses, and the operator: symbols, a keyword (`and`, `not
# in`, ...) or, for a method chain, the `.` and the method's name.
_TRIVIA = re.compile(r"[ \t\f\r\n]+|\\(?:\r\n|\r|\n)|\#[^\r\n]*")
_TOKEN = re.compile(r"\*\*|//|<<|>>|<=|>=|==|!=|[-+*/%&|^@<>().~]|[^\W\d]\w*")


def split_lines(text: str) -> list[str]:
    """The lines of ``text`` with their endings, as Python numbers them."""
    return _LINE.findall(text)


def line_ending(line: str) -> str:
    """The ending of one line from `split_lines` ("" for a last line without one)."""
    if line.endswith("\r\n"):
        return "\r\n"
    if line.endswith(("\n", "\r")):
        return line[-1]
    return ""


@dataclass(frozen=True)
class GapToken:
    """A code token in the gap between two operands; ``start``/``end`` index the text."""

    start: int
    end: int
    text: str


def gap_tokens(text: str, start: int, end: int) -> list[GapToken] | None:
    """The tokens of ``text[start:end]``, trivia skipped; None when the gap holds anything
    that is neither trivia nor an operator, a parenthesis or a name (a string, a number)."""
    tokens: list[GapToken] = []
    position = start
    while position < end:
        trivia = _TRIVIA.match(text, position, end)
        if trivia is not None:
            position = trivia.end()
            continue
        token = _TOKEN.match(text, position, end)
        if token is None:
            return None
        tokens.append(GapToken(token.start(), token.end(), token.group()))
        position = token.end()
    return tokens


@dataclass(frozen=True)
class OperatorSpan:
    """Where an operator sits between two operands.

    Attributes:
        start: Index of the operator's first character.
        end: Index just past its last character (``not in`` spans both words).
        text: The operator as written, words joined by one space (``not in``).
        left_end: Index just past the left operand, its closing parentheses included.
        right_start: Index of the right operand, its opening parentheses included.
    """

    start: int
    end: int
    text: str
    left_end: int
    right_start: int


def operator_between(text: str, left_end: int, right_start: int) -> OperatorSpan | None:
    """The operator in ``text[left_end:right_start]``: closing parentheses, the operator's
    tokens, opening parentheses (a method chain's ``.name`` counts as one operator)."""
    tokens = gap_tokens(text, left_end, right_start)
    if not tokens:
        return None
    first = 0
    while first < len(tokens) and tokens[first].text == ")":
        first += 1
    last = len(tokens)
    while last > first and tokens[last - 1].text == "(":
        last -= 1
    middle = tokens[first:last]
    if not middle or any(token.text in "()" for token in middle):
        return None
    return OperatorSpan(
        start=middle[0].start,
        end=middle[-1].end,
        text=" ".join(token.text for token in middle),
        left_end=tokens[first - 1].end if first else left_end,
        right_start=tokens[last].start if last < len(tokens) else right_start,
    )


class SourceText:
    """A module's text with the offsets `ast` positions need.

    Attributes:
        text: The whole text, line endings as they are.
        lines: Its lines, each with its ending (`split_lines`).
        newline: The first line's ending (what a new line gets), "\\n" when there is none.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = split_lines(text)
        self.newline = next((line_ending(line) for line in self.lines if line_ending(line)), "\n")
        self._line_starts: list[int] = []
        position = 0
        for line in self.lines:
            self._line_starts.append(position)
            position += len(line)

    def line_start(self, lineno: int) -> int:
        """Index of the first character of line ``lineno`` (1-based)."""
        if lineno > len(self.lines):
            return len(self.text)
        return self._line_starts[lineno - 1]

    def line_end(self, lineno: int) -> int:
        """Index just past line ``lineno``, its ending included."""
        return self.line_start(lineno + 1)

    def line_of(self, index: int) -> int:
        """The 1-based line holding the character at ``index``."""
        return bisect.bisect_right(self._line_starts, index)

    def offset(self, lineno: int, byte_col: int) -> int:
        """Index of the UTF-8 byte column ``byte_col`` of line ``lineno``."""
        line = self.lines[lineno - 1] if lineno <= len(self.lines) else ""
        if line.isascii():
            return self.line_start(lineno) + byte_col
        return self.line_start(lineno) + len(line.encode("utf-8")[:byte_col].decode("utf-8"))

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def segment(self, node: ast.AST) -> str:
        """The node's text, without the grouping parentheses around it."""
        return self.text[self.start(node) : self.end(node)]

    def indent(self, lineno: int) -> str:
        """The leading whitespace of line ``lineno``."""
        line = self.lines[lineno - 1]
        return line[: len(line) - len(line.lstrip(" \t\f"))]

    def ending(self, lineno: int) -> str:
        return line_ending(self.lines[lineno - 1])

    def starts_line(self, node: ast.AST) -> bool:
        """Only whitespace precedes the node on its first line."""
        before = self.text[self.line_start(node.lineno) : self.start(node)]  # type: ignore[attr-defined]
        return not before.strip(" \t\f")

    def ends_line(self, node: ast.AST) -> bool:
        """Only whitespace or a comment follows the node on its last line."""
        after = self.text[self.end(node) : self.line_end(node.end_lineno)]  # type: ignore[attr-defined]
        after = after.strip(" \t\f\r\n")
        return not after or after.startswith("#")

    def owns_lines(self, node: ast.AST) -> bool:
        """The node's lines hold nothing else: it starts its first line and ends its last."""
        return self.starts_line(node) and self.ends_line(node)


def string_interior_lines(tree: ast.AST) -> frozenset[int]:
    """Lines that continue a string literal begun on an earlier line: their leading
    whitespace is the string's content, so re-indenting them would change a value."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        is_string = isinstance(node, ast.JoinedStr) or (
            isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes))
        )
        if is_string and node.end_lineno is not None and node.end_lineno > node.lineno:
            lines.update(range(node.lineno + 1, node.end_lineno + 1))
    return frozenset(lines)


def join_lines(lines: Iterable[str], newline: str, last_ending: str) -> str:
    """Lines moved around as one text: every line but the last ends with its own ending
    (``newline`` where it had none: it was the file's last), the last with
    ``last_ending`` (the ending of the last line of the span they replace)."""
    bodies = [line[: len(line) - len(line_ending(line))] for line in lines]
    endings = [line_ending(line) or newline for line in lines]
    if not bodies:
        return ""
    endings[-1] = last_ending
    return "".join(body + ending for body, ending in zip(bodies, endings))
