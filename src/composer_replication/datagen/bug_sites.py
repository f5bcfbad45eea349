"""Where a bug can go in a module, and the check that an edit writes exactly that bug.

The machinery under `bug_kinds`: a `ModuleSource` is one module's text, parsed, with its
candidate functions (`candidate_functions`: module-level functions and methods of
module-level classes; not one-line definitions, stubs or abstract methods). A
`FunctionScope` walks one candidate's body (its docstring, annotations and f-string
internals aside) and records where each node sits, so that a bug kind can describe a
`Site`: the intended change as `Patch`es of the original tree, and the text `Edit`s that
may write it, in order of preference.

`ModuleSource.check` applies a site's edits to the text one at a time and parses the
changed function back (a method's lines under an ``if``, so they parse on their own): the
first edit whose function is the patched tree, and compiles, wins. So an edit that
operator precedence would regroup, or that leaves a ``nonlocal`` without its binding, is
never emitted, and a file is never parsed whole per bug.
"""

from __future__ import annotations

import ast
import hashlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from composer_replication.common.python_source import parse_python
from composer_replication.datagen.source_spans import (
    OperatorSpan,
    SourceText,
    join_lines,
    operator_between,
    split_lines,
    string_interior_lines,
)
from composer_replication.envs.fd_tasks import STUB_EXCEPTION

__all__ = [
    "CandidateFunction",
    "CheckedEdit",
    "Edit",
    "FunctionScope",
    "ModuleSource",
    "Patch",
    "Place",
    "Site",
    "candidate_functions",
    "expression_site",
    "same_tree",
    "snippet",
    "statement_site",
]

# Never walked into: annotations (changing one changes no behaviour), and nodes without a
# span of their own (operators and contexts are shared singletons in CPython's trees).
_SKIPPED_FIELDS = frozenset({"annotation", "returns", "type_params", "type_comment"})
_UNWALKED = (ast.expr_context, ast.operator, ast.boolop, ast.cmpop, ast.unaryop, ast.pattern)
_SNIPPET_CHARS = 72

_T = TypeVar("_T")


@dataclass(frozen=True, eq=False)
class CandidateFunction:
    """A function bugs may go into; lines are 1-based, ``start_line`` is the first
    decorator's, ``first_statement`` indexes the body past the docstring."""

    node: ast.FunctionDef | ast.AsyncFunctionDef
    qualname: str
    start_line: int
    end_line: int
    first_statement: int


@dataclass(frozen=True, eq=False)
class Place:
    """Where a node sits: ``getattr(owner, field)`` is it, or holds it at ``index``."""

    owner: ast.AST
    field: str
    index: int | None


@dataclass(frozen=True, eq=False)
class Patch:
    """One attribute of the original tree set to a new value: a bug as an AST change."""

    owner: ast.AST
    field: str
    value: object


@dataclass(frozen=True)
class Edit:
    """``text[start:end]`` of the original replaced by ``text``; ``summary`` says how."""

    start: int
    end: int
    text: str
    summary: str


@dataclass(frozen=True, eq=False)
class Site:
    """One bug before it is checked: the intended AST change and the text edits that may
    write it, tried in order. ``position`` (where it starts in the text) orders sites."""

    kind: str
    function: CandidateFunction
    position: int
    patches: tuple[Patch, ...]
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class CheckedEdit:
    """A site's edit that passed the check: the buggy text, the 1-based original line
    where it starts to differ, its one-line description, and the function's last line
    in the buggy text."""

    buggy: str
    line: int
    description: str
    buggy_end_line: int


# ---------------------------------------------------------------------------------------
# Candidate functions


def _docstring_count(body: Sequence[ast.stmt]) -> int:
    first = body[0] if body else None
    is_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    return 1 if is_doc else 0


def _is_stub(statements: Sequence[ast.stmt]) -> bool:
    """Nothing (a docstring only), ``pass``, ``...`` or a raise of ``STUB_EXCEPTION``."""
    if len(statements) != 1:
        return not statements
    only = statements[0]
    if isinstance(only, ast.Pass):
        return True
    if isinstance(only, ast.Expr) and isinstance(only.value, ast.Constant):
        return only.value.value is Ellipsis
    if isinstance(only, ast.Raise) and only.exc is not None:
        exc = only.exc.func if isinstance(only.exc, ast.Call) else only.exc
        return isinstance(exc, ast.Name) and exc.id == STUB_EXCEPTION
    return False


def _is_abstract(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``abstractmethod`` (or ``abc.abstractproperty``, ...)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name.startswith("abstract"):
            return True
    return False


def candidate_functions(tree: ast.Module, src: SourceText) -> list[CandidateFunction]:
    """Module-level functions and methods of module-level classes (nested classes too),
    in source order; not one-line definitions, stubs or abstract methods."""
    found: list[CandidateFunction] = []

    def visit(body: Sequence[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = _docstring_count(node.body)
                if (
                    _is_stub(node.body[first:])
                    or _is_abstract(node)
                    or not src.starts_line(node.body[0])  # `def f(): return 1`
                ):
                    continue
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                end = node.end_lineno or node.lineno
                found.append(CandidateFunction(node, prefix + node.name, start, end, first))

    visit(tree.body, "")
    return found


# ---------------------------------------------------------------------------------------
# One function's body, walked


class FunctionScope:
    """One candidate function while its bug sites are found: ``nodes`` is every node of
    its body in source order (docstring, annotations and f-string internals aside)."""

    def __init__(
        self,
        src: SourceText,
        function: CandidateFunction,
        file: str,
        string_lines: frozenset[int],
    ) -> None:
        self.src = src
        self.function = function
        self.file = file
        self.string_lines = string_lines  # lines inside multi-line strings
        self.nodes: list[ast.AST] = []
        self.places: dict[int, Place] = {}
        body = function.node.body
        pending = [
            (stmt, Place(function.node, "body", index))
            for index, stmt in enumerate(body)
            if index >= function.first_statement
        ]
        pending.reverse()
        while pending:
            node, place = pending.pop()
            self.nodes.append(node)
            self.places[id(node)] = place
            # f-string internals have no reliable spans before Python 3.12.
            if isinstance(node, ast.JoinedStr):
                continue
            children: list[tuple[ast.AST, Place]] = []
            for field, value in ast.iter_fields(node):
                if field in _SKIPPED_FIELDS:
                    continue
                items = value if isinstance(value, list) else [value]
                for index, child in enumerate(items):
                    if isinstance(child, ast.AST) and not isinstance(child, _UNWALKED):
                        where = index if isinstance(value, list) else None
                        children.append((child, Place(node, field, where)))
            pending.extend(reversed(children))

    def parent(self, node: ast.AST) -> ast.AST | None:
        place = self.places.get(id(node))
        return place.owner if place is not None else None

    def replace(self, node: ast.AST, new: ast.AST) -> Patch:
        """The patch that puts ``new`` where ``node`` is."""
        place = self.places[id(node)]
        if place.index is None:
            return Patch(place.owner, place.field, new)
        items = list(getattr(place.owner, place.field))
        items[place.index] = new
        return Patch(place.owner, place.field, items)

    def statements(self) -> Iterator[tuple[ast.stmt, Place, list[ast.stmt]]]:
        """Each statement with its place and the block (statement list) holding it."""
        for node in self.nodes:
            if isinstance(node, ast.stmt):
                place = self.places[id(node)]
                yield node, place, getattr(place.owner, place.field)

    def operator(self, left: ast.AST, right: ast.AST, spelling: str) -> OperatorSpan | None:
        """The operator between two operands, when it is written as ``spelling``."""
        span = operator_between(self.src.text, self.src.end(left), self.src.start(right))
        return span if span is not None and span.text == spelling else None

    def choose(self, node: ast.AST, kind: str, options: Sequence[_T]) -> _T:
        """One of ``options``, the same every time for this node (a digest, no RNG)."""
        where = f"{node.lineno}:{node.col_offset}"  # type: ignore[attr-defined]
        key = f"{self.file}:{self.function.qualname}:{where}:{kind}"
        digest = hashlib.sha256(key.encode()).digest()
        return options[int.from_bytes(digest[:4], "big") % len(options)]


# ---------------------------------------------------------------------------------------
# Sites


def snippet(text: str) -> str:
    """``text`` on one line, whitespace runs as one space, cut to a readable length."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _SNIPPET_CHARS else flat[: _SNIPPET_CHARS - 3] + "..."


def same_tree(first: object, second: object) -> bool:
    """The same AST, positions aside (what `ast.dump` prints alike, without printing)."""
    pending = [(first, second)]
    while pending:
        a, b = pending.pop()
        if type(a) is not type(b):
            return False
        if isinstance(a, ast.AST):
            pending.extend((getattr(a, f, None), getattr(b, f, None)) for f in a._fields)
        elif isinstance(a, list):
            if len(a) != len(b):  # type: ignore[arg-type]
                return False
            pending.extend(zip(a, b))  # type: ignore[call-overload]
        elif a != b:
            return False
    return True


def _parse(source: str, mode: str = "exec", *, compiles: bool = False) -> ast.AST:
    """``ast.parse`` without the warnings of the code parsed (an invalid escape in a
    string would be reported once per site, or be an error under ``-W error``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = parse_python(source, mode)
        if compiles:
            compile(tree, "<bug>", mode, dont_inherit=True)
    return tree


def _reads_as(text: str, expected: ast.expr) -> bool:
    """``text`` parses, on its own, as the expression ``expected``."""
    try:
        tree = _parse(f"(\n{text}\n)", mode="eval")
    except (SyntaxError, ValueError):
        return False
    return isinstance(tree, ast.Expression) and same_tree(tree.body, expected)


def expression_site(
    scope: FunctionScope,
    kind: str,
    node: ast.expr,
    replacement: ast.expr,
    texts: Sequence[str],
    context: ast.AST | None = None,
) -> Site | None:
    """The site that rewrites ``node``'s span as the first of ``texts`` that reads as
    ``replacement`` on its own; the same in parentheses is the fallback for a context
    that binds tighter than the new operator. ``context`` (an enclosing node) is what
    the summary quotes."""
    text = next((candidate for candidate in texts if _reads_as(candidate, replacement)), None)
    if text is None:
        return None
    src = scope.src
    start, end = src.start(node), src.end(node)
    context_start, context_end = start, end
    if context is not None and src.start(context) <= start and end <= src.end(context):
        context_start, context_end = src.start(context), src.end(context)
    before = src.text[context_start:context_end]

    def edit(new: str) -> Edit:
        after = before[: start - context_start] + new + before[end - context_start :]
        return Edit(start, end, new, f"`{snippet(before)}` -> `{snippet(after)}`")

    patch = scope.replace(node, replacement)
    return Site(kind, scope.function, start, (patch,), (edit(text), edit(f"({text})")))


def statement_site(
    scope: FunctionScope,
    kind: str,
    lines_replaced: tuple[int, int],
    lines: Sequence[str],
    patches: Sequence[Patch],
    summary: str,
) -> Site:
    """The site that replaces whole lines (``lines_replaced``: first and last, 1-based)
    by ``lines``; the last keeps the ending of the last line replaced."""
    src = scope.src
    first, last = lines_replaced
    start, end = src.line_start(first), src.line_end(last)
    text = join_lines(lines, src.newline, src.ending(last))
    return Site(kind, scope.function, start, tuple(patches), (Edit(start, end, text, summary),))


# ---------------------------------------------------------------------------------------
# The check


def _matches_patched(parsed: ast.AST, original: ast.AST, patches: Sequence[Patch]) -> bool:
    """``parsed`` is ``original`` with ``patches`` applied; the tree is left as it was."""
    saved = [(patch.owner, patch.field, getattr(patch.owner, patch.field)) for patch in patches]
    try:
        for patch in patches:
            setattr(patch.owner, patch.field, patch.value)
        return same_tree(parsed, original)
    finally:
        for owner, field, value in reversed(saved):
            setattr(owner, field, value)


def _parsed_function(region: str, indented: bool) -> ast.AST | None:
    """The one function definition ``region`` holds (a method's lines parse under an
    ``if``), when it parses and compiles (``nonlocal`` of a removed binding does not)."""
    source = f"if 1:\n{region}" if indented else region
    try:
        tree = _parse(source, compiles=True)
    except (SyntaxError, ValueError, RecursionError):
        return None
    assert isinstance(tree, ast.Module)
    body = tree.body[0].body if indented and isinstance(tree.body[0], ast.If) else tree.body
    return body[0] if len(body) == 1 else None


def _common_prefix(first: str, second: str) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


class ModuleSource:
    """One module's text, parsed (SyntaxError when it does not), with its candidates."""

    def __init__(self, text: str, file: str) -> None:
        self.src = SourceText(text)
        self.file = file
        tree = _parse(text)
        assert isinstance(tree, ast.Module)
        self.tree = tree
        self.functions = candidate_functions(self.tree, self.src)
        self.string_lines = string_interior_lines(self.tree)

    def scope(self, function: CandidateFunction) -> FunctionScope:
        return FunctionScope(self.src, function, self.file, self.string_lines)

    def check(self, site: Site) -> CheckedEdit | None:
        """The first of the site's edits whose function parses back as the patched tree
        and compiles; None when there is none, or the patches change nothing (``a - a``
        swapped)."""
        if all(same_tree(getattr(p.owner, p.field), p.value) for p in site.patches):
            return None
        function, src = site.function, self.src
        region_start = src.line_start(function.start_line)
        region_end = src.line_end(function.end_line)
        for edit in site.edits:
            shift = len(edit.text) - (edit.end - edit.start)
            buggy = src.text[: edit.start] + edit.text + src.text[edit.end :]
            region = buggy[region_start : region_end + shift]
            parsed = _parsed_function(region, function.node.col_offset > 0)
            if parsed is None or not _matches_patched(parsed, function.node, site.patches):
                continue
            changed_at = edit.start + _common_prefix(src.text[edit.start : edit.end], edit.text)
            line = src.line_of(min(changed_at, len(src.text) - 1))
            return CheckedEdit(
                buggy=buggy,
                line=line,
                description=f"line {line}: {edit.summary}",
                buggy_end_line=function.start_line + len(split_lines(region)) - 1,
            )
        return None
