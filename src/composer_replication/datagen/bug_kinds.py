"""Procedural bug injection: one small bug in one function of a real Python repository.

The kinds follow SWE-smith's procedural modifications (Yang et al., "SWE-smith: Scaling
Data for Software Engineering Agents", arXiv 2504.21798): a working function gets a small
bug by an AST transformation, and the tests it makes fail turn it into a task. The kinds
(`BUG_KINDS`):

- ``flip_operator``: an operator becomes its opposite: ``==``/``!=``, ``<``/``>``,
  ``<=``/``>=``, ``in``/``not in``, ``is``/``is not``, ``and``/``or`` (every ``and`` of one
  chain), ``+``/``-``, ``*``/``/``, ``//``/``%``, ``<<``/``>>``, ``&``/``|``; ``**`` becomes
  ``*``.
- ``change_operator``: ``*``, ``/``, ``//`` or ``%`` becomes another of the four, not its
  flip (the family of ``+`` and ``-`` has no third member, so they have none).
- ``swap_operands``: ``a - b`` becomes ``b - a`` for an operator that does not commute
  (``-``, ``/``, ``//``, ``%``, ``**``, ``<<``, ``>>``, and ``+``: strings and lists
  concatenate); a single ``<``, ``>``, ``<=``, ``>=``, ``in`` or ``not in`` comparison
  ``a < b`` becomes ``b < a``.
- ``change_constant``: an int literal that is an operand, an index or a call argument moves
  by one (``0`` becomes ``1``; any other goes up or down).
- ``off_by_one``: a computed bound (an argument of ``range``, a slice bound, an index) gets
  ``+ 1`` or ``- 1``; ``len(x)`` always becomes ``len(x) - 1``. Literal bounds are left to
  ``change_constant``, and so is ``n - 1`` (the ``1`` moves instead of cancelling).
- ``invert_if_else``: the two bodies of an ``if``/``else`` swap, the condition stays.
- ``remove_conditional``, ``remove_assignment``, ``remove_loop``: an ``if`` without
  ``else``, an assignment, a ``for``/``while`` loop is deleted; a block left empty gets
  ``pass``.
- ``remove_wrapper``: a ``with`` or ``try`` statement is replaced by its body, dedented.
- ``shuffle_lines``: two adjacent simple statements of one block swap.
- ``break_chain``: a chain of binary operations loses one operand (``a + b + c`` becomes
  ``a + c``), or a method chain its last call (``s.strip().lower()`` becomes
  ``s.strip()``).

Edits go into the source text at the exact spans `ast` reports (`source_spans`), never
through ``ast.unparse``: the buggy file differs from the original only where the bug is,
with its comments, formatting and line endings kept. Every bug is checked by parsing the
changed function back: it must read as exactly the intended AST change (an edit that
operator precedence would regroup is written in parentheses, or dropped) and compile.

Candidates are module-level functions and methods of module-level classes (nested classes
too), sync or async; not one-line definitions, stubs (only a docstring, ``pass``, ``...``
or a raise of the stub exception) or abstract methods. A bug changes the statements of
the body only, never the docstring, decorators or signature. `bugs_in_source` lists every
bug of one module, `find_bugs` picks a few per function across a repository, `combine`
joins two bugs of one file.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from composer_replication.datagen.bug_sites import (
    CandidateFunction,
    FunctionScope,
    ModuleSource,
    Patch,
    Place,
    Site,
    expression_site,
    snippet,
    statement_site,
)
from composer_replication.datagen.source_spans import (
    OperatorSpan,
    SourceText,
    operator_between,
    split_lines,
)
from composer_replication.envs.fd_tasks import source_files
from composer_replication.safety.hack_monitor import is_protected

__all__ = ["BUG_KINDS", "Bug", "bugs_in_source", "combine", "find_bugs"]

BUG_KINDS: tuple[str, ...] = (
    "flip_operator",
    "change_operator",
    "swap_operands",
    "change_constant",
    "off_by_one",
    "invert_if_else",
    "remove_conditional",
    "remove_assignment",
    "remove_loop",
    "remove_wrapper",
    "shuffle_lines",
    "break_chain",
)

_BINOP_TEXT: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.MatMult: "@",
}
_CMPOP_TEXT: dict[type[ast.cmpop], str] = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.Gt: ">",
    ast.LtE: "<=",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}
_BOOLOP_TEXT: dict[type[ast.boolop], str] = {ast.And: "and", ast.Or: "or"}
_OPERATOR_TEXT: dict[type[ast.AST], str] = {**_BINOP_TEXT, **_CMPOP_TEXT, **_BOOLOP_TEXT}
_FLIPS: dict[type[ast.AST], type[ast.AST]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mod,
    ast.Mod: ast.FloorDiv,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.Pow: ast.Mult,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.Gt,
    ast.Gt: ast.Lt,
    ast.LtE: ast.GtE,
    ast.GtE: ast.LtE,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.And: ast.Or,
    ast.Or: ast.And,
}
_MULTIPLICATIVE: tuple[type[ast.operator], ...] = (ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)
_NON_COMMUTATIVE: tuple[type[ast.operator], ...] = (
    ast.Sub,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.LShift,
    ast.RShift,
    ast.Add,
)
_ORDERED_COMPARISONS: tuple[type[ast.cmpop], ...] = (
    ast.Lt,
    ast.Gt,
    ast.LtE,
    ast.GtE,
    ast.In,
    ast.NotIn,
)
_ASSIGNMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_TRY_STATEMENTS = (ast.Try, *([ast.TryStar] if hasattr(ast, "TryStar") else []))
_WRAPPERS = (ast.With, ast.AsyncWith, *_TRY_STATEMENTS)
# Statements that fit on their own lines and can trade places: no blocks of their own, and
# not `global`/`nonlocal`/`pass`, whose order means nothing or must stay first.
_SIMPLE_STATEMENTS = (
    ast.Assign,
    ast.AugAssign,
    ast.AnnAssign,
    ast.Expr,
    ast.Return,
    ast.Delete,
    ast.Raise,
    ast.Assert,
    ast.Import,
    ast.ImportFrom,
    ast.Break,
    ast.Continue,
)


@dataclass(frozen=True)
class Bug:
    """One injected bug: the whole file before and after, and where the change is.

    Attributes:
        file: Repository-relative POSIX path of the file.
        qualname: The function's qualified name ("f", "Class.method"); "a+b" for a
            combined bug.
        kind: One of `BUG_KINDS` ("first+second" for a combined bug).
        line: 1-based line of the original where the change starts.
        description: One line saying what changed (for reports; never shown to an agent).
        original: The whole original file text.
        buggy: The whole file text with the bug.
        start_line: First line of the function in the original (first decorator or def).
        end_line: Last line of the function in the original.
        buggy_end_line: Last line of the same function in the buggy text.
    """

    file: str
    qualname: str
    kind: str
    line: int
    description: str
    original: str
    buggy: str
    start_line: int
    end_line: int
    buggy_end_line: int

    @property
    def bug_id(self) -> str:
        """A stable short id: the kind and a digest of where the bug is and what it is."""
        digest = hashlib.sha256("\0".join((self.file, self.qualname, self.buggy)).encode())
        return f"{self.kind}-{digest.hexdigest()[:10]}"


# ---------------------------------------------------------------------------------------
# Helpers the kinds share


def _rewritten(src: SourceText, node: ast.AST, changes: Iterable[tuple[int, int, str]]) -> str:
    """``node``'s text with each change ``(start, end, text)`` (indexes of the file) made."""
    pieces: list[str] = []
    position = src.start(node)
    for start, end, text in sorted(changes, key=lambda change: change[0]):
        pieces += [src.text[position:start], text]
        position = end
    pieces.append(src.text[position : src.end(node)])
    return "".join(pieces)


def _respelling(span: OperatorSpan, spelling: str) -> tuple[int, int, str]:
    return span.start, span.end, spelling


def _lines(src: SourceText, first: int, last: int) -> list[str]:
    return src.lines[first - 1 : last]


def _first_line(src: SourceText, node: ast.AST) -> str:
    return snippet(src.lines[node.lineno - 1])  # type: ignore[attr-defined]


def _operand_pairs(node: ast.Compare) -> Iterator[tuple[int, ast.expr, ast.expr]]:
    operands = [node.left, *node.comparators]
    for index in range(len(node.ops)):
        yield index, operands[index], operands[index + 1]


def _int_literal(node: ast.AST) -> int | None:
    """The value of an int literal (``-3`` included), bools excluded."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    ):
        return -node.operand.value
    return None


def _int_node(value: int) -> ast.expr:
    if value < 0:
        return ast.UnaryOp(op=ast.USub(), operand=ast.Constant(value=-value))
    return ast.Constant(value=value)


def _int_text(written: str, value: int) -> str:
    """``value`` in the base ``written`` (an int literal as the source spells it) uses."""
    sign, magnitude = ("-" if value < 0 else ""), abs(value)
    prefix = written[:2]
    base = {"0x": "x", "0o": "o", "0b": "b"}.get(prefix.lower())
    if base is None:
        return f"{sign}{magnitude}"
    digits = format(magnitude, base)
    if any(char.isupper() for char in written[2:]):
        digits = digits.upper()
    return f"{sign}{prefix}{digits}"


def _is_len_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"


def _looks_like_type(node: ast.AST) -> bool:
    """``List[T]``, ``typing.Dict[K, V]``: subscripts of capitalised names are types."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name[:1].isupper()


def _block_after_removal(
    function: CandidateFunction, place: Place, block: Sequence[ast.stmt]
) -> list[ast.stmt] | None:
    """The block without the statement at ``place``; None when that would leave the
    function's own body with nothing but its docstring."""
    assert place.index is not None
    rest = [*block[: place.index], *block[place.index + 1 :]]
    own_body = place.owner is function.node and place.field == "body"
    if own_body and len(rest) <= function.first_statement:
        return None
    return rest


# ---------------------------------------------------------------------------------------
# One function per kind: each yields the sites of its kind in one candidate function


def _flip_operator(scope: FunctionScope) -> Iterator[Site]:
    src = scope.src
    for node in scope.nodes:
        site = None
        if isinstance(node, ast.BinOp) and type(node.op) in _FLIPS:
            span = scope.operator(node.left, node.right, _BINOP_TEXT[type(node.op)])
            if span is not None:
                flipped = _FLIPS[type(node.op)]()
                replacement = ast.BinOp(left=node.left, op=flipped, right=node.right)
                text = _rewritten(src, node, [_respelling(span, _OPERATOR_TEXT[type(flipped)])])
                site = expression_site(scope, "flip_operator", node, replacement, [text])
        elif isinstance(node, ast.Compare):
            for index, left, right in _operand_pairs(node):
                op = node.ops[index]
                span = scope.operator(left, right, _CMPOP_TEXT[type(op)])
                if span is None:
                    continue
                flipped = _FLIPS[type(op)]()
                ops = [*node.ops[:index], flipped, *node.ops[index + 1 :]]
                replacement = ast.Compare(left=node.left, ops=ops, comparators=node.comparators)
                text = _rewritten(src, node, [_respelling(span, _OPERATOR_TEXT[type(flipped)])])
                compare_site = expression_site(scope, "flip_operator", node, replacement, [text])
                if compare_site is not None:
                    yield compare_site
        elif isinstance(node, ast.BoolOp):
            site = _flip_bool_op(scope, node)
        if site is not None:
            yield site


def _flip_bool_op(scope: FunctionScope, node: ast.BoolOp) -> Site | None:
    """Every ``and`` of one BoolOp flips together (flipping one would regroup the rest);
    a value that is an ``or`` written bare then needs parentheses: ``a or b and c``
    flipped is ``a and (b and c)``."""
    src = scope.src
    spelling = _BOOLOP_TEXT[type(node.op)]
    pairs = zip(node.values, node.values[1:])
    spans = [scope.operator(left, right, spelling) for left, right in pairs]
    found = [span for span in spans if span is not None]
    if len(found) != len(spans):
        return None
    flipped = _FLIPS[type(node.op)]()
    respellings = [_respelling(span, _OPERATOR_TEXT[type(flipped)]) for span in found]
    value_starts = [src.start(node), *(span.right_start for span in found)]
    value_ends = [*(span.left_end for span in found), src.end(node)]
    parentheses = [
        change
        for value, start, end in zip(node.values, value_starts, value_ends)
        if isinstance(value, ast.BoolOp) and (src.start(value), src.end(value)) == (start, end)
        for change in ((start, start, "("), (end, end, ")"))
    ]
    texts = [_rewritten(src, node, respellings), _rewritten(src, node, respellings + parentheses)]
    replacement = ast.BoolOp(op=flipped, values=node.values)
    return expression_site(scope, "flip_operator", node, replacement, texts)


def _change_operator(scope: FunctionScope) -> Iterator[Site]:
    for node in scope.nodes:
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, _MULTIPLICATIVE)):
            continue
        current = type(node.op)
        others = [op for op in _MULTIPLICATIVE if op not in (current, _FLIPS[current])]
        span = scope.operator(node.left, node.right, _BINOP_TEXT[current])
        if span is None:
            continue
        new_op = scope.choose(node, "change_operator", others)()
        replacement = ast.BinOp(left=node.left, op=new_op, right=node.right)
        text = _rewritten(scope.src, node, [_respelling(span, _BINOP_TEXT[type(new_op)])])
        site = expression_site(scope, "change_operator", node, replacement, [text])
        if site is not None:
            yield site


def _swapped_texts(src: SourceText, node: ast.AST, span: OperatorSpan) -> list[str]:
    """``right op left`` as written, then with one or both moved operands in parentheses
    (``a - (b - c)`` swapped must not read ``b - c - a``)."""
    left = src.text[src.start(node) : span.left_end]
    middle = src.text[span.left_end : span.right_start]
    right = src.text[span.right_start : src.end(node)]
    return [
        f"{new_left}{middle}{new_right}"
        for new_left in (right, f"({right})")
        for new_right in (left, f"({left})")
    ]


def _swap_operands(scope: FunctionScope) -> Iterator[Site]:
    src = scope.src
    for node in scope.nodes:
        site = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, _NON_COMMUTATIVE):
            span = scope.operator(node.left, node.right, _BINOP_TEXT[type(node.op)])
            if span is not None:
                replacement = ast.BinOp(left=node.right, op=node.op, right=node.left)
                texts = _swapped_texts(src, node, span)
                site = expression_site(scope, "swap_operands", node, replacement, texts)
        elif (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], _ORDERED_COMPARISONS)
        ):
            right = node.comparators[0]
            span = scope.operator(node.left, right, _CMPOP_TEXT[type(node.ops[0])])
            if span is not None:
                replacement = ast.Compare(left=right, ops=node.ops, comparators=[node.left])
                texts = _swapped_texts(src, node, span)
                site = expression_site(scope, "swap_operands", node, replacement, texts)
        if site is not None:
            yield site


def _literal_context(scope: FunctionScope, node: ast.AST) -> ast.AST | None:
    """The BinOp, Compare, Subscript or Call an int literal is an operand, index or
    argument of; None elsewhere (a default, a plain assignment, a return value)."""
    place = scope.places[id(node)]
    owner = place.owner
    if isinstance(owner, (ast.BinOp, ast.Compare)):
        return owner
    if isinstance(owner, ast.Call):
        return owner if place.field == "args" else None
    if isinstance(owner, ast.keyword):
        call = scope.parent(owner)
        return call if isinstance(call, ast.Call) else None
    # An index (`a[1]`), a slice bound (`a[1:]`), an item of a tuple index (`a[1, 2:]`).
    subscript: ast.AST | None = node
    for _ in range(3):
        place = scope.places.get(id(subscript))
        if place is None:
            return None
        if isinstance(place.owner, ast.Subscript):
            return place.owner if place.field == "slice" else None
        if not isinstance(place.owner, (ast.Slice, ast.Tuple)):
            return None
        subscript = place.owner
    return None


def _change_constant(scope: FunctionScope) -> Iterator[Site]:
    for node in scope.nodes:
        value = _int_literal(node)
        if value is None or not isinstance(node, ast.expr):
            continue
        context = _literal_context(scope, node)
        if context is None:
            continue
        step = 1 if value == 0 else scope.choose(node, "change_constant", (1, -1))
        literal = node.operand if isinstance(node, ast.UnaryOp) else node
        text = _int_text(scope.src.segment(literal), value + step)
        replacement = _int_node(value + step)
        site = expression_site(scope, "change_constant", node, replacement, [text], context)
        if site is not None:
            yield site


def _bounds(scope: FunctionScope) -> Iterator[tuple[ast.expr, ast.AST]]:
    """Computed bounds with the call or subscript they bound: ``range`` arguments (start,
    stop), slice bounds, and indexes of subscripts that are not types."""
    for node in scope.nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "range" and not any(
                isinstance(arg, ast.Starred) for arg in node.args
            ):
                for arg in node.args[:2]:
                    yield arg, node
        elif isinstance(node, ast.Subscript) and not _looks_like_type(node.value):
            index = node.slice
            if isinstance(index, ast.Slice):
                for bound in (index.lower, index.upper):
                    if bound is not None:
                        yield bound, node
            elif not isinstance(index, ast.Tuple):
                yield index, node


def _off_by_one(scope: FunctionScope) -> Iterator[Site]:
    for bound, context in _bounds(scope):
        # Literal bounds (`2`, `-1`, `"key"`) are change_constant's, and so is `n - 1`:
        # another `+ 1` would cancel it.
        moves_constant = (
            isinstance(bound, ast.BinOp)
            and isinstance(bound.op, (ast.Add, ast.Sub))
            and _int_literal(bound.right) is not None
        )
        is_literal = isinstance(bound, ast.Constant) or _int_literal(bound) is not None
        if is_literal or moves_constant or isinstance(bound, ast.Starred):
            continue
        if _is_len_call(bound):
            op: ast.operator = ast.Sub()
        else:
            op = scope.choose(bound, "off_by_one", (ast.Add, ast.Sub))()
        written = scope.src.segment(bound)
        spelling = _BINOP_TEXT[type(op)]
        texts = [f"{written} {spelling} 1", f"({written}) {spelling} 1"]
        replacement = ast.BinOp(left=bound, op=op, right=ast.Constant(value=1))
        site = expression_site(scope, "off_by_one", bound, replacement, texts, context)
        if site is not None:
            yield site


def _has_else_line(src: SourceText, node: ast.If) -> bool:
    """A real ``else:`` line sits between the bodies (not an ``elif``, not ``else: x``)."""
    body_last = node.body[-1].end_lineno or node.body[-1].lineno
    for lineno in range(body_last + 1, node.orelse[0].lineno):
        code = src.lines[lineno - 1].split("#", 1)[0].strip()
        if code.startswith("else") and code[4:].strip() == ":":
            return True
    return False


def _invert_if_else(scope: FunctionScope) -> Iterator[Site]:
    src = scope.src
    for node in scope.nodes:
        if not (isinstance(node, ast.If) and node.orelse and _has_else_line(src, node)):
            continue
        body, orelse = node.body, node.orelse
        if not (src.starts_line(body[0]) and src.starts_line(orelse[0])):
            continue
        body_first, body_last = body[0].lineno, body[-1].end_lineno or body[-1].lineno
        else_first, else_last = orelse[0].lineno, orelse[-1].end_lineno or orelse[-1].lineno
        lines = [
            *_lines(src, else_first, else_last),
            *_lines(src, body_last + 1, else_first - 1),  # the `else:` line, comments
            *_lines(src, body_first, body_last),
        ]
        patches = (Patch(node, "body", orelse), Patch(node, "orelse", body))
        summary = f"swapped the bodies of `{snippet(src.segment(node.test))}` and its else"
        lines_replaced = (body_first, else_last)
        yield statement_site(scope, "invert_if_else", lines_replaced, lines, patches, summary)


def _removals(
    scope: FunctionScope, kind: str, wanted: Callable[[ast.stmt], bool]
) -> Iterator[Site]:
    """Whole-line deletions of the statements ``wanted`` picks (``pass`` in an emptied
    block)."""
    src = scope.src
    for stmt, place, block in scope.statements():
        if not wanted(stmt) or not src.owns_lines(stmt):
            continue
        rest = _block_after_removal(scope.function, place, block)
        if rest is None:
            continue
        last = stmt.end_lineno or stmt.lineno
        lines: list[str] = []
        if not rest:
            rest = [ast.Pass()]
            lines = [f"{src.indent(stmt.lineno)}pass{src.ending(last)}"]
        patch = Patch(place.owner, place.field, rest)
        summary = f"removed `{_first_line(src, stmt)}`"
        yield statement_site(scope, kind, (stmt.lineno, last), lines, (patch,), summary)


def _remove_conditional(scope: FunctionScope) -> Iterator[Site]:
    src = scope.src

    def wanted(stmt: ast.stmt) -> bool:
        is_elif = src.text.startswith("elif", src.start(stmt))
        return isinstance(stmt, ast.If) and not stmt.orelse and not is_elif

    yield from _removals(scope, "remove_conditional", wanted)


def _remove_assignment(scope: FunctionScope) -> Iterator[Site]:
    def wanted(stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.AnnAssign):
            return stmt.value is not None
        return isinstance(stmt, _ASSIGNMENTS)

    yield from _removals(scope, "remove_assignment", wanted)


def _remove_loop(scope: FunctionScope) -> Iterator[Site]:
    yield from _removals(scope, "remove_loop", lambda stmt: isinstance(stmt, _LOOPS))


def _remove_wrapper(scope: FunctionScope) -> Iterator[Site]:
    src = scope.src
    for stmt, place, block in scope.statements():
        if not isinstance(stmt, _WRAPPERS) or not src.owns_lines(stmt):
            continue
        body = stmt.body
        if not src.starts_line(body[0]):
            continue
        outer, inner = src.indent(stmt.lineno), src.indent(body[0].lineno)
        if not (inner.startswith(outer) and len(inner) > len(outer)):
            continue
        body_last = body[-1].end_lineno or body[-1].lineno
        lines = [
            # A line inside a multi-line string keeps its indent: that is the string's text.
            outer + line[len(inner) :]
            if line.startswith(inner) and lineno not in scope.string_lines
            else line
            for lineno, line in enumerate(_lines(src, body[0].lineno, body_last), body[0].lineno)
        ]
        assert place.index is not None
        spliced = [*block[: place.index], *body, *block[place.index + 1 :]]
        patch = Patch(place.owner, place.field, spliced)
        summary = f"`{_first_line(src, stmt)}` replaced by its body"
        last = stmt.end_lineno or stmt.lineno
        lines_replaced = (stmt.lineno, last)
        yield statement_site(scope, "remove_wrapper", lines_replaced, lines, (patch,), summary)


def _shuffle_lines(scope: FunctionScope) -> Iterator[Site]:
    src = scope.src

    def movable(stmt: ast.stmt) -> bool:
        is_string = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        return isinstance(stmt, _SIMPLE_STATEMENTS) and not is_string and src.owns_lines(stmt)

    for first, place, block in scope.statements():
        assert place.index is not None
        if place.index + 1 >= len(block):
            continue
        second = block[place.index + 1]
        first_last = first.end_lineno or first.lineno
        if not (movable(first) and movable(second) and second.lineno > first_last):
            continue
        second_last = second.end_lineno or second.lineno
        lines = [
            *_lines(src, second.lineno, second_last),
            *_lines(src, first_last + 1, second.lineno - 1),  # blank or comment lines
            *_lines(src, first.lineno, first_last),
        ]
        swapped = list(block)
        swapped[place.index : place.index + 2] = [second, first]
        patch = Patch(place.owner, place.field, swapped)
        summary = f"swapped `{_first_line(src, first)}` and `{_first_line(src, second)}`"
        lines_replaced = (first.lineno, second_last)
        yield statement_site(scope, "shuffle_lines", lines_replaced, lines, (patch,), summary)


def _chain_root(scope: FunctionScope, node: ast.AST) -> ast.AST:
    while isinstance(scope.parent(node), ast.BinOp):
        node = scope.parent(node)  # type: ignore[assignment]
    return node


def _break_chain(scope: FunctionScope) -> Iterator[Site]:
    src = scope.src
    for node in scope.nodes:
        site = None
        if isinstance(node, ast.BinOp):
            in_chain = isinstance(scope.parent(node), ast.BinOp) or any(
                isinstance(operand, ast.BinOp) for operand in (node.left, node.right)
            )
            span = scope.operator(node.left, node.right, _BINOP_TEXT[type(node.op)])
            if not in_chain or span is None:
                continue
            # Drop an operand that is a single term, with the operator next to it.
            if not isinstance(node.right, ast.BinOp):
                kept, text = node.left, src.text[src.start(node) : span.left_end]
            elif not isinstance(node.left, ast.BinOp):
                kept, text = node.right, src.text[span.right_start : src.end(node)]
            else:
                continue
            root = _chain_root(scope, node)
            site = expression_site(scope, "break_chain", node, kept, [text], root)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Call)
        ):
            place = scope.places[id(node)]
            if isinstance(place.owner, ast.Attribute) and place.field == "value":
                continue  # not the chain's last call
            receiver = node.func.value
            span = operator_between(src.text, src.end(receiver), src.end(node.func))
            if span is None or not span.text.startswith(". "):
                continue
            text = src.text[src.start(node) : span.left_end]
            site = expression_site(scope, "break_chain", node, receiver, [text])
        if site is not None:
            yield site


_FINDERS: dict[str, Callable[[FunctionScope], Iterator[Site]]] = {
    "flip_operator": _flip_operator,
    "change_operator": _change_operator,
    "swap_operands": _swap_operands,
    "change_constant": _change_constant,
    "off_by_one": _off_by_one,
    "invert_if_else": _invert_if_else,
    "remove_conditional": _remove_conditional,
    "remove_assignment": _remove_assignment,
    "remove_loop": _remove_loop,
    "remove_wrapper": _remove_wrapper,
    "shuffle_lines": _shuffle_lines,
    "break_chain": _break_chain,
}


def _checked_kinds(kinds: Collection[str]) -> tuple[str, ...]:
    unknown = sorted(set(kinds) - set(BUG_KINDS))
    if unknown:
        raise ValueError(f"unknown bug kinds {unknown}; known: {', '.join(BUG_KINDS)}")
    return tuple(kind for kind in BUG_KINDS if kind in set(kinds))


def _sites(module: ModuleSource, function: CandidateFunction, kinds: Sequence[str]) -> list[Site]:
    """The function's sites of ``kinds``, in source order."""
    scope = module.scope(function)
    sites = [site for kind in kinds for site in _FINDERS[kind](scope)]
    sites.sort(key=lambda site: (site.position, BUG_KINDS.index(site.kind)))
    return sites


def _bug(module: ModuleSource, site: Site) -> Bug | None:
    checked = module.check(site)
    if checked is None:
        return None
    function = site.function
    return Bug(
        file=module.file,
        qualname=function.qualname,
        kind=site.kind,
        line=checked.line,
        description=checked.description,
        original=module.src.text,
        buggy=checked.buggy,
        start_line=function.start_line,
        end_line=function.end_line,
        buggy_end_line=checked.buggy_end_line,
    )


# ---------------------------------------------------------------------------------------
# Public API


def bugs_in_source(source: str, file: str, *, kinds: Collection[str] = BUG_KINDS) -> list[Bug]:
    """Every single-site bug of the given kinds in every candidate function of one module's
    source, in source order (each site once per kind; a buggy text met twice is kept once).

    Raises SyntaxError when ``source`` does not parse, ValueError for an unknown kind.
    """
    wanted = _checked_kinds(kinds)
    module = ModuleSource(source, file)
    bugs: list[Bug] = []
    seen: set[str] = set()
    for function in module.functions:
        for site in _sites(module, function, wanted):
            bug = _bug(module, site)
            if bug is not None and bug.buggy not in seen:
                seen.add(bug.buggy)
                bugs.append(bug)
    return bugs


def _pick(module: ModuleSource, sites: Sequence[Site], count: int, rng: random.Random) -> list[Bug]:
    """Up to ``count`` bugs from one function's sites: a shuffled order in which every
    kind's first site comes before any kind's second, checked lazily."""
    order = list(sites)
    rng.shuffle(order)
    seen_of_kind: Counter[str] = Counter()
    ranked: list[tuple[int, Site]] = []
    for site in order:
        ranked.append((seen_of_kind[site.kind], site))
        seen_of_kind[site.kind] += 1
    ranked.sort(key=lambda item: item[0])
    picked: list[Bug] = []
    for _, site in ranked:
        if len(picked) >= count:
            break
        bug = _bug(module, site)
        if bug is not None and all(bug.buggy != other.buggy for other in picked):
            picked.append(bug)
    return picked


def find_bugs(
    root: str | os.PathLike[str],
    *,
    exclude: Collection[str] = (),
    kinds: Collection[str] = BUG_KINDS,
    per_function: int = 2,
    seed: int = 0,
) -> list[Bug]:
    """Candidate bugs in a repository: at most ``per_function`` per candidate function,
    different kinds first, chosen by ``seed`` (the same seed, the same bugs).

    Skipped: hidden folders, build, dist, site-packages, node_modules, venv, env,
    __pycache__ and *.egg-info; test and configuration files (``is_protected``) and the
    root-relative files ``exclude`` names; files that are not UTF-8 or do not parse.
    Ordered by (file, line).
    """
    wanted = _checked_kinds(kinds)
    root_path = Path(root)
    excluded = {Path(name).as_posix() for name in exclude}
    bugs: list[Bug] = []
    for path in source_files(root_path):
        rel = path.relative_to(root_path).as_posix()
        if is_protected(rel) or rel in excluded:
            continue
        try:
            module = ModuleSource(path.read_bytes().decode("utf-8"), rel)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
            continue
        for function in module.functions:
            rng = random.Random(f"{seed}:{rel}:{function.qualname}")
            sites = _sites(module, function, wanted)
            bugs.extend(_pick(module, sites, per_function, rng))
    return sorted(bugs, key=lambda bug: (bug.file, bug.line))


def _function_lines(bug: Bug, original: list[str]) -> list[str]:
    """The buggy lines of ``bug``'s function, after checking the rest is the original."""
    buggy = split_lines(bug.buggy)
    head, tail = buggy[: bug.start_line - 1], buggy[bug.buggy_end_line :]
    if head != original[: bug.start_line - 1] or tail != original[bug.end_line :]:
        raise ValueError(
            f"{bug.bug_id} changes {bug.file} outside lines {bug.start_line}-{bug.end_line}"
        )
    return buggy[bug.start_line - 1 : bug.buggy_end_line]


def combine(first: Bug, second: Bug) -> Bug:
    """Two bugs of one file, in different functions, as one bug with both changes.

    The kind is ``"first+second"``, the span covers both functions. Raises ValueError when
    the bugs are in different files (or versions of one) or their functions overlap.
    """
    if first.file != second.file or first.original != second.original:
        raise ValueError(f"cannot combine bugs of {first.file} and {second.file}")
    earlier, later = sorted((first, second), key=lambda bug: bug.start_line)
    if later.start_line <= earlier.end_line:
        raise ValueError(
            f"{first.qualname} (lines {first.start_line}-{first.end_line}) and "
            f"{second.qualname} (lines {second.start_line}-{second.end_line}) overlap"
        )
    original = split_lines(first.original)
    lines = [
        *original[: earlier.start_line - 1],
        *_function_lines(earlier, original),
        *original[earlier.end_line : later.start_line - 1],
        *_function_lines(later, original),
        *original[later.end_line :],
    ]
    shift = earlier.buggy_end_line - earlier.end_line
    return Bug(
        file=first.file,
        qualname=f"{first.qualname}+{second.qualname}",
        kind=f"{first.kind}+{second.kind}",
        line=min(first.line, second.line),
        description=f"{first.description}; {second.description}",
        original=first.original,
        buggy="".join(lines),
        start_line=earlier.start_line,
        end_line=later.end_line,
        buggy_end_line=later.buggy_end_line + shift,
    )
