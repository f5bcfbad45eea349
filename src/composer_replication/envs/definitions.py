"""Function definitions in Python source, found by name and rewritten whole.

The ``replace_function`` tool, the reference agent that demonstrates it and the bug report
that shows the failing function all need the same three things: where each definition
sits (decorators included, methods by ``Class.method``), the one a name means, and the
source with that definition replaced by new code indented as the old one was. Code written
without a docstring keeps the old definition's (:func:`with_docstring`): documented code
(doctests, long explanations) is rewritten without copying its documentation.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from composer_replication.common.python_source import parse_python

__all__ = [
    "Definition",
    "definitions",
    "docstring_lines",
    "find_definition",
    "source_of",
    "with_definition",
    "with_docstring",
    "without_docstring",
]


@dataclass(frozen=True)
class Definition:
    """A ``def`` in a file: its qualified name (``Class.method``, ``outer.inner``), its
    1-based first line (the first decorator's) and last line, and its indentation."""

    qualname: str
    first_line: int
    last_line: int
    indent: str

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def definitions(source: str) -> list[Definition]:
    """Every function and method of ``source`` in file order; none for source that does not
    parse."""
    try:
        tree = parse_python(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found: list[Definition] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                text = lines[first - 1]
                found.append(
                    Definition(
                        prefix + child.name,
                        first,
                        child.end_lineno or child.lineno,
                        text[: len(text) - len(text.lstrip())],
                    )
                )
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return sorted(found, key=lambda d: d.first_line)


def find_definition(source: str, name: str) -> Definition:
    """The definition ``name`` means in ``source``: its qualified name, or a bare name
    (or a dotted tail such as ``Class.method``) that only one definition has.

    Raises:
        LookupError: no definition, or several, answer to ``name`` (the message says which
            names there are).
    """
    name = name.strip().removesuffix("()").strip()  # "parse()" names parse too
    found = definitions(source)
    exact = [d for d in found if d.qualname == name]
    if len(exact) == 1:
        return exact[0]
    tail = [d for d in found if d.qualname.endswith("." + name) or d.qualname == name]
    if len(tail) == 1:
        return tail[0]
    if tail:
        names = ", ".join(d.qualname for d in tail)
        raise LookupError(f"{name!r} names {len(tail)} definitions ({names}); give one of them")
    close = [d.qualname for d in found if d.name.lower() == name.rsplit(".", 1)[-1].lower()]
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise LookupError(f"no function {name!r} is defined here{hint}")


def _margin(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _dedented(code: str) -> list[str]:
    """``code``'s lines with its first line's indentation taken off every line that has it
    (lines inside a string may sit further left and are kept as they are)."""
    lines = code.strip("\n").splitlines()
    first = next((line for line in lines if line.strip()), "")
    margin = _margin(first)
    return [line[len(margin) :] if line.startswith(margin) else line for line in lines]


def _docstring_span(lines: list[str]) -> tuple[int, int, int] | None:
    """0-based ``[start, end)`` of the docstring of the first definition in ``lines`` (code
    at the left margin) and the 0-based line its body starts on; None when it has no
    docstring on lines of its own or the code does not parse."""
    try:
        tree = parse_python("\n".join(lines))
    except (SyntaxError, ValueError):
        return None
    node = next(
        (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None
    )
    if node is None or not node.body:
        return None
    first = node.body[0]
    start = min([first.lineno, *(d.lineno for d in getattr(first, "decorator_list", ()))]) - 1
    if start < node.lineno:  # the body shares the def line
        return None
    is_docstring = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    if not is_docstring:
        return (start, start, start)
    return (start, first.end_lineno or first.lineno, start)


def docstring_lines(code: str) -> list[str] | None:
    """The source lines of the docstring of the definition ``code`` writes (None: none)."""
    lines = _dedented(code)
    span = _docstring_span(lines)
    if span is None or span[0] == span[1]:
        return None
    return lines[span[0] : span[1]]


def without_docstring(code: str) -> str:
    """``code`` (one definition) with its docstring's lines left out (``replace_function``
    keeps the old docstring of code written without one)."""
    span = _docstring_span(_dedented(code))
    if span is None or span[0] == span[1]:
        return code
    lines = code.strip("\n").splitlines()  # line for line the dedented ones, as written
    return "\n".join(lines[: span[0]] + lines[span[1] :])


def with_docstring(code: str, old: str) -> str:
    """``code`` (one definition), given the docstring of ``old`` (the definition it
    replaces) when it has none of its own and ``old`` has one; re-indented to ``code``'s
    body. Otherwise ``code`` as it is."""
    lines = _dedented(code)
    span = _docstring_span(lines)
    kept = docstring_lines(old)
    if span is None or span[0] != span[1] or kept is None:
        return code
    old_margin, new_margin = _margin(kept[0]), _margin(lines[span[2]])
    moved = [
        new_margin + line[len(old_margin) :] if line.startswith(old_margin) else line
        for line in kept
    ]
    return "\n".join(lines[: span[2]] + moved + lines[span[2] :])


def with_definition(source: str, definition: Definition, code: str) -> str:
    """``source`` with ``definition``'s lines replaced by ``code``, re-indented to the
    definition's indentation (code written at the left margin replaces a method alike);
    the other lines and their endings are kept."""
    body = _dedented(code)
    newline = "\r\n" if "\r\n" in source else "\n"
    placed = [definition.indent + line if line.strip() else "" for line in body]
    lines = source.splitlines(keepends=True)
    before = lines[: definition.first_line - 1]
    after = lines[definition.last_line :]
    ending = newline if after or lines[definition.last_line - 1].endswith(("\n", "\r")) else ""
    return "".join(before) + newline.join(placed) + ending + "".join(after)


def source_of(source: str, definition: Definition) -> str:
    """The text of ``definition`` in ``source`` (its lines, without the last line end)."""
    return "\n".join(source.splitlines()[definition.first_line - 1 : definition.last_line])
