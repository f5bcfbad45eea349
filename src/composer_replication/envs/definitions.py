"""Function definitions in Python source, found by name and rewritten whole.

The ``replace_function`` tool, the reference agent that demonstrates it and the bug report
that shows the failing function all need the same three things: where each definition
sits (decorators included, methods by ``Class.method``), the one a name means, and the
source with that definition replaced by new code indented as the old one was.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass

__all__ = ["Definition", "definitions", "find_definition", "with_definition"]


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
        tree = ast.parse(source)
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


def with_definition(source: str, definition: Definition, code: str) -> str:
    """``source`` with ``definition``'s lines replaced by ``code``, re-indented to the
    definition's indentation (code written at the left margin replaces a method alike);
    the other lines and their endings are kept."""
    body = textwrap.dedent(code.strip("\n")).splitlines()
    newline = "\r\n" if "\r\n" in source else "\n"
    placed = [definition.indent + line if line.strip() else "" for line in body]
    lines = source.splitlines(keepends=True)
    before = lines[: definition.first_line - 1]
    after = lines[definition.last_line :]
    ending = newline if after or lines[definition.last_line - 1].endswith(("\n", "\r")) else ""
    return "".join(before) + newline.join(placed) + ending + "".join(after)
