"""Procedural bug injection (`datagen.bug_kinds`): the exact buggy text of each kind on small
sources, formatting kept outside the change, and the repository-level picking."""

from __future__ import annotations

import ast
import textwrap
import warnings
from pathlib import Path

import pytest

from composer_replication.datagen.bug_kinds import (
    BUG_KINDS,
    Bug,
    bugs_in_source,
    combine,
    find_bugs,
)
from composer_replication.datagen.bug_sites import ModuleSource
from composer_replication.datagen.source_spans import SourceText, operator_between, split_lines
from composer_replication.envs.fd_tasks import STUB_EXCEPTION


def _source(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def buggy_texts(source: str, kind: str) -> list[str]:
    return [bug.buggy for bug in bugs_in_source(source, "m.py", kinds=(kind,))]


def only_bug(source: str, kind: str) -> Bug:
    bugs = bugs_in_source(source, "m.py", kinds=(kind,))
    assert len(bugs) == 1, [bug.description for bug in bugs]
    return bugs[0]


def changed_lines(bug: Bug) -> set[int]:
    """Original line numbers whose text is not in the buggy file at the same place."""
    original, buggy = split_lines(bug.original), split_lines(bug.buggy)
    return {n for n, (a, b) in enumerate(zip(original, buggy), 1) if a != b}


# ---------------------------------------------------------------------------------------
# Spans


def test_source_text_converts_utf8_byte_columns_to_string_indexes() -> None:
    text = 's = "héllo" + name\r\nx = 1\ry = 2\n'
    src = SourceText(text)
    tree = ast.parse(text)
    binop = tree.body[0].value
    assert src.segment(binop.right) == "name"
    assert src.segment(binop) == '"héllo" + name'
    assert [src.segment(stmt) for stmt in tree.body] == ['s = "héllo" + name', "x = 1", "y = 2"]
    assert src.lines == ['s = "héllo" + name\r\n', "x = 1\r", "y = 2\n"]


def test_operator_between_skips_parentheses_comments_and_continuations() -> None:
    text = "(a + b)  # sum\\\n  - (c)"
    span = operator_between(text, text.index("b") + 1, text.index("c"))
    assert span is not None
    assert span.text == "-"
    assert text[span.start : span.end] == "-"
    assert text[: span.left_end] == "(a + b)"
    assert text[span.right_start :] == "(c)"
    words = "x not  in y"
    not_in = operator_between(words, 1, words.index("y"))
    assert not_in is not None and not_in.text == "not in"
    assert operator_between("a 'str' b", 1, 8) is None


# ---------------------------------------------------------------------------------------
# Each kind, exactly


def test_flip_operator_comparison() -> None:
    assert buggy_texts("def f(a, b):\n    return a < b\n", "flip_operator") == [
        "def f(a, b):\n    return a > b\n"
    ]


def test_flip_operator_keeps_odd_spacing_and_flips_each_comparison_once() -> None:
    source = "def f(a, b, c):\n    return a  <=b < c\n"
    assert buggy_texts(source, "flip_operator") == [
        "def f(a, b, c):\n    return a  >=b < c\n",
        "def f(a, b, c):\n    return a  <=b > c\n",
    ]


def test_flip_operator_word_operators() -> None:
    source = _source(
        """
        def f(x, items):
            if x not in items and x is not None:
                return x in items or x is None
            return x
        """
    )
    texts = buggy_texts(source, "flip_operator")
    assert source.replace("x not in items and", "x in items and") in texts
    assert source.replace("x is not None:", "x is None:") in texts
    assert source.replace("not in items and x", "not in items or x") in texts
    assert source.replace("return x in items or", "return x not in items or") in texts
    assert source.replace("items or x is None", "items and x is None") in texts
    assert source.replace("or x is None", "or x is not None") in texts
    assert len(texts) == 6


def test_flip_operator_arithmetic_and_power() -> None:
    source = "def f(a, b):\n    return a ** b // 2\n"
    assert buggy_texts(source, "flip_operator") == [
        "def f(a, b):\n    return a ** b % 2\n",
        "def f(a, b):\n    return a * b // 2\n",
    ]


def test_flip_operator_parenthesises_where_precedence_would_regroup() -> None:
    # `-a ** b` is `-(a ** b)`; written `-a * b` it would read `(-a) * b`.
    source = "def f(a, b):\n    return -a ** b\n"
    assert buggy_texts(source, "flip_operator") == ["def f(a, b):\n    return -(a * b)\n"]
    # `a or b and c` flipped at either operator keeps `b and c` one operand.
    source = "def f(a, b, c):\n    return a or b and c\n"
    assert buggy_texts(source, "flip_operator") == [
        "def f(a, b, c):\n    return a and (b and c)\n",
        "def f(a, b, c):\n    return a or (b or c)\n",
    ]


def test_change_operator_stays_in_the_family_and_skips_the_flip() -> None:
    source = "def f(a, b):\n    return a * b\n"
    [text] = buggy_texts(source, "change_operator")
    assert text in {"def f(a, b):\n    return a // b\n", "def f(a, b):\n    return a % b\n"}
    # + and - have no family member but each other (that is flip_operator's).
    assert buggy_texts("def f(a, b):\n    return a + b - 1\n", "change_operator") == []


def test_swap_operands() -> None:
    source = "def f(a, b, c):\n    x = a - b\n    y = a - (b - c)\n    return x * y\n"
    assert buggy_texts(source, "swap_operands") == [
        "def f(a, b, c):\n    x = b - a\n    y = a - (b - c)\n    return x * y\n",
        "def f(a, b, c):\n    x = a - b\n    y = (b - c) - a\n    return x * y\n",
        "def f(a, b, c):\n    x = a - b\n    y = a - (c - b)\n    return x * y\n",
    ]


def test_swap_operands_parenthesises_a_moved_chain() -> None:
    source = "def f(a, b, c):\n    return a - b - c\n"
    assert buggy_texts(source, "swap_operands") == [
        "def f(a, b, c):\n    return c - (a - b)\n",
        "def f(a, b, c):\n    return b - a - c\n",
    ]


def test_swap_operands_comparisons_only_when_order_matters() -> None:
    source = _source(
        """
        def f(a, b, c):
            if a == b or a < b < c:
                return a in c
            return a <= b
        """
    )
    assert buggy_texts(source, "swap_operands") == [
        source.replace("return a in c", "return c in a"),
        source.replace("return a <= b", "return b <= a"),
    ]


def test_change_constant_index_and_arguments() -> None:
    source = _source(
        """
        def f(items, flag=True):
            first = items[0]
            total = 10
            return first + sum(items, start=total), print(True)
        """
    )
    # 0 becomes 1; a default, a plain assignment and a bool are not sites.
    assert buggy_texts(source, "change_constant") == [source.replace("items[0]", "items[1]")]


def test_change_constant_moves_by_one_and_keeps_the_base() -> None:
    source = "def f(x, items):\n    return x & 0xFF, items[-1]\n"
    texts = buggy_texts(source, "change_constant")
    assert len(texts) == 2
    assert texts[0] in {source.replace("0xFF", "0x100"), source.replace("0xFF", "0xFE")}
    assert texts[1] in {source.replace("[-1]", "[0]"), source.replace("[-1]", "[-2]")}


def test_off_by_one_len_bound_loses_one() -> None:
    source = _source(
        """
        def f(items):
            for i in range(len(items)):
                print(i)
        """
    )
    assert buggy_texts(source, "off_by_one") == [
        source.replace("range(len(items))", "range(len(items) - 1)")
    ]


def test_off_by_one_index_and_slice_bounds() -> None:
    source = "def f(items, i, j):\n    return items[i], items[i:j], items[1:]\n"
    texts = buggy_texts(source, "off_by_one")
    assert len(texts) == 3
    assert texts[0] in {source.replace("items[i],", f"items[i {op} 1],") for op in "+-"}
    assert texts[1] in {source.replace("items[i:j]", f"items[i {op} 1:j]") for op in "+-"}
    assert texts[2] in {source.replace("items[i:j]", f"items[i:j {op} 1]") for op in "+-"}


def test_off_by_one_parenthesises_only_where_needed_and_skips_types() -> None:
    source = _source(
        """
        def f(items, a, b, n):
            x: List[int] = cast(List[T], items)
            return items[a or b], items[a * b], items[n - 1]
        """
    )
    texts = buggy_texts(source, "off_by_one")
    assert len(texts) == 2  # `List[T]` is a type, `n - 1` is change_constant's
    assert texts[0] in {source.replace("[a or b]", f"[(a or b) {op} 1]") for op in "+-"}
    assert texts[1] in {source.replace("[a * b]", f"[a * b {op} 1]") for op in "+-"}


def test_invert_if_else_swaps_the_bodies_and_keeps_comments_between() -> None:
    source = _source(
        """
        def f(x):
            if x > 0:
                sign = 1
                kind = "positive"
            # the rest
            else:  # not positive
                sign = -1
            return sign
        """
    )
    expected = _source(
        """
        def f(x):
            if x > 0:
                sign = -1
            # the rest
            else:  # not positive
                sign = 1
                kind = "positive"
            return sign
        """
    )
    assert buggy_texts(source, "invert_if_else") == [expected]


def test_invert_if_else_leaves_elif_chains_and_one_line_else() -> None:
    source = _source(
        """
        def f(x):
            if x > 0:
                return 1
            elif x < 0:
                return -1
            else:
                return 0
        """
    )
    # Only the elif's own else is a real else.
    expected = source.replace(
        "        return -1\n    else:\n        return 0\n",
        "        return 0\n    else:\n        return -1\n",
    )
    assert buggy_texts(source, "invert_if_else") == [expected]
    one_line = "def f(x):\n    if x:\n        y = 1\n    else: y = 2\n    return y\n"
    assert buggy_texts(one_line, "invert_if_else") == []


def test_remove_conditional_deletes_whole_lines_and_fills_an_emptied_block() -> None:
    source = _source(
        """
        def f(items):
            out = []
            for item in items:
                if item is None:  # skip holes
                    continue
            if not out:
                out.append(0)
            return out
        """
    )
    assert buggy_texts(source, "remove_conditional") == [
        source.replace(
            "        if item is None:  # skip holes\n            continue\n", "        pass\n"
        ),
        source.replace("    if not out:\n        out.append(0)\n", ""),
    ]


def test_remove_assignment_skips_shared_lines_and_an_emptied_function() -> None:
    source = _source(
        """
        def f(a):
            x = 1; y = 2
            total: int = a + x
            total += y
            return total


        def g():
            value = compute()
        """
    )
    assert buggy_texts(source, "remove_assignment") == [
        source.replace("    total: int = a + x\n", ""),
        source.replace("    total += y\n", ""),
    ]


def test_remove_loop() -> None:
    source = _source(
        """
        def f(n):
            total = 0
            while n:
                n -= 1
                total += n
            return total
        """
    )
    assert buggy_texts(source, "remove_loop") == ["def f(n):\n    total = 0\n    return total\n"]
    # The function would be left with its docstring only: not a bug worth having.
    lone_loop = 'def g(items):\n    """Doc."""\n    for item in items:\n        print(item)\n'
    assert buggy_texts(lone_loop, "remove_loop") == []


def test_remove_wrapper_dedents_the_body_but_not_string_contents() -> None:
    source = _source(
        '''
        def f(path):
            with open(path) as handle:
                text = handle.read()
                note = """first
                second"""
            try:
                value = int(text)
            except ValueError:
                value = 0
            finally:
                print("done")
            return value, note
        '''
    )
    with_removed = (
        "def f(path):\n"
        "    text = handle.read()\n"
        '    note = """first\n'
        '        second"""\n'  # inside the string: kept as it was
        "    try:\n"
        "        value = int(text)\n"
        "    except ValueError:\n"
        "        value = 0\n"
        "    finally:\n"
        '        print("done")\n'
        "    return value, note\n"
    )
    try_removed = source.replace(
        "    try:\n        value = int(text)\n    except ValueError:\n        value = 0\n"
        '    finally:\n        print("done")\n',
        "    value = int(text)\n",
    )
    assert buggy_texts(source, "remove_wrapper") == [with_removed, try_removed]


def test_shuffle_lines_swaps_adjacent_simple_statements_of_one_block() -> None:
    source = _source(
        """
        def f(a):
            b = a + 1

            c = b * 2
            if c:
                return c
            return b
        """
    )
    assert buggy_texts(source, "shuffle_lines") == [
        source.replace("    b = a + 1\n\n    c = b * 2\n", "    c = b * 2\n\n    b = a + 1\n")
    ]


def test_break_chain_drops_an_operand_or_the_last_call() -> None:
    source = "def f(a, b, c, s):\n    return a + b + c, s.strip().lower()\n"
    assert buggy_texts(source, "break_chain") == [
        "def f(a, b, c, s):\n    return a + b, s.strip().lower()\n",
        "def f(a, b, c, s):\n    return a + c, s.strip().lower()\n",
        "def f(a, b, c, s):\n    return a + b + c, s.strip()\n",
    ]
    lone = "def f(a, b, s):\n    return a + b, s.strip()\n"
    assert buggy_texts(lone, "break_chain") == []


def test_descriptions_and_lines() -> None:
    bug = only_bug("import os\n\n\ndef f(a, b):\n    return a < b\n", "flip_operator")
    assert bug.description == "line 5: `a < b` -> `a > b`"
    assert (bug.line, bug.start_line, bug.end_line, bug.buggy_end_line) == (5, 4, 5, 5)
    assert bug.qualname == "f" and bug.file == "m.py" and bug.kind == "flip_operator"
    assert bug.bug_id.startswith("flip_operator-") and len(bug.bug_id) == len("flip_operator-") + 10
    assert bug.bug_id == only_bug(bug.original, "flip_operator").bug_id
    removal = only_bug("def f(a):\n    b = a\n    return b\n", "remove_assignment")
    assert removal.description == "line 2: removed `b = a`"
    assert removal.buggy_end_line == 2


# ---------------------------------------------------------------------------------------
# Formatting kept


def test_comments_and_formatting_elsewhere_are_kept() -> None:
    source = _source(
        """
        # header comment
        def f( a,b ):   # odd spacing
            '''Doc: a < b.'''
            x = [ 1,2 ,3 ]  # list
            return a<b  # compare


        CONSTANT = {  'k' :1 }
        """
    )
    [bug] = bugs_in_source(source, "m.py", kinds=("flip_operator",))
    assert bug.buggy == source.replace("return a<b", "return a>b")
    assert changed_lines(bug) == {5}


def test_operators_across_lines_comments_and_continuations() -> None:
    source = _source(
        """
        def f(a, b):
            total = (a  # first
                     - b)
            other = a \\
                - b
            return total, other
        """
    )
    assert buggy_texts(source, "flip_operator") == [
        source.replace("# first\n             - b", "# first\n             + b"),
        source.replace("\\\n        - b", "\\\n        + b"),
    ]
    assert buggy_texts(source, "swap_operands") == [
        source.replace("(a  # first\n             - b)", "(b  # first\n             - a)"),
        source.replace("a \\\n        - b", "b \\\n        - a"),
    ]


def test_non_ascii_text_before_the_change_on_the_same_line() -> None:
    source = 'def f(a, b):\n    return "héllo wörld ✓" if a < b else "ñ"\n'
    assert buggy_texts(source, "flip_operator") == [source.replace("a < b", "a > b")]
    assert buggy_texts(source, "swap_operands") == [source.replace("a < b", "b < a")]


def test_crlf_line_endings_are_kept() -> None:
    source = (
        "def f(items):\r\n"
        "    out = 0\r\n"
        "    for x in items:\r\n"
        "        if x > 1:\r\n"
        "            out += x\r\n"
        "        else:\r\n"
        "            out -= x\r\n"
        "    return out"  # no final line ending
    )
    bugs = bugs_in_source(source, "m.py")
    assert bugs
    for bug in bugs:
        assert "\n" not in bug.buggy.replace("\r\n", ""), bug.description
    [invert] = [bug for bug in bugs if bug.kind == "invert_if_else"]
    assert invert.buggy == source.replace("out += x\r\n", "OUT").replace(
        "out -= x\r\n", "out += x\r\n"
    ).replace("OUT", "out -= x\r\n")
    [loop] = [bug for bug in bugs if bug.kind == "remove_loop"]
    assert loop.buggy == "def f(items):\r\n    out = 0\r\n    return out"


def test_removing_the_last_line_of_a_file_without_ending() -> None:
    source = "def f(items):\n    for x in items:\n        print(x)\n    y = 1"
    texts = buggy_texts(source, "remove_assignment")
    assert texts == ["def f(items):\n    for x in items:\n        print(x)\n"]
    swapped = buggy_texts("def f():\n    a = 1\n    b = 2", "shuffle_lines")
    assert swapped == ["def f():\n    b = 2\n    a = 1"]


def test_docstring_decorators_defaults_and_annotations_are_untouched() -> None:
    source = _source(
        '''
        @decorator(1 + 2, flag=a < b)
        def f(x: int = 1 + 2, y: Annotated[int, 3 - 1] = 4 * 5) -> Dict[1 - 0]:
            """a < b and 1 + 2."""
            z: Literal[1 + 1] = x - y
            return z
        '''
    )
    bugs = bugs_in_source(source, "m.py")
    assert bugs
    for bug in bugs:
        assert changed_lines(bug) <= {4, 5}, bug.description
        assert bug.buggy.splitlines()[:3] == source.splitlines()[:3]
    assert any("`x - y` -> `x + y`" in bug.description for bug in bugs)


def test_one_line_defs_stubs_and_abstract_methods_are_not_candidates() -> None:
    source = _source(
        '''
        import abc


        def one(a, b): return a < b


        def documented():
            """Only a docstring with a < b."""


        def passes():
            pass


        def ellipsis():
            ...


        def unfinished(a, b):
            """Doc."""
            raise STUB(a < b)


        class Base(abc.ABC):
            @abc.abstractmethod
            def run(self, a, b):
                return a < b

            def __eq__(self, other):
                return self.key == other.key

            class Inner:
                async def go(self, a, b):
                    return a < b
        '''
    )
    source = source.replace("STUB", STUB_EXCEPTION)
    candidates = ModuleSource(source, "m.py").functions
    assert [function.qualname for function in candidates] == ["Base.__eq__", "Base.Inner.go"]
    bugs = bugs_in_source(source, "m.py", kinds=("flip_operator",))
    assert [bug.qualname for bug in bugs] == ["Base.__eq__", "Base.Inner.go"]


def test_sites_in_nested_functions_belong_to_the_enclosing_function() -> None:
    source = _source(
        """
        def outer(items):
            def key(item):
                return item - 1

            return sorted(items, key=lambda item: item < 0)
        """
    )
    bugs = bugs_in_source(source, "m.py", kinds=("flip_operator",))
    assert [bug.qualname for bug in bugs] == ["outer", "outer"]
    assert [bug.buggy for bug in bugs] == [
        source.replace("item - 1", "item + 1"),
        source.replace("item < 0", "item > 0"),
    ]


def test_a_removal_that_breaks_compilation_is_dropped() -> None:
    source = _source(
        """
        def counter():
            count = 0
            def step():
                nonlocal count
                count += 1
                return count
            return step
        """
    )
    removed = [
        bug.description for bug in bugs_in_source(source, "m.py", kinds=("remove_assignment",))
    ]
    assert removed == ["line 5: removed `count += 1`"]  # not `count = 0`: nonlocal needs it


def test_warnings_of_the_parsed_code_are_not_raised() -> None:
    # An invalid escape warns at every parse; under `-W error` it would be a SyntaxError.
    source = 'def f(s):\n    return s.split("\\d") == 1\n'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        texts = buggy_texts(source, "flip_operator")
    assert texts == [source.replace("==", "!=")]


def test_unknown_kinds_and_unparsable_source() -> None:
    with pytest.raises(ValueError, match="unknown bug kinds"):
        bugs_in_source("def f():\n    return 1\n", "m.py", kinds=("typo",))
    with pytest.raises(SyntaxError):
        bugs_in_source("def f(:\n", "m.py")


# ---------------------------------------------------------------------------------------
# A realistic module, and behaviour


REALISTIC = _source(
    '''
    """Inventory helpers."""

    from __future__ import annotations

    import json
    from pathlib import Path


    class Inventory:
        """Items with counts."""

        def __init__(self, path: Path) -> None:
            self.path = path
            self.counts: dict[str, int] = {}

        def load(self) -> None:
            try:
                with self.path.open(encoding="utf-8") as handle:
                    data = json.load(handle)
            except FileNotFoundError:
                data = {}
            for name, count in data.items():
                if count < 0:
                    raise ValueError(f"negative count for {name}")
                self.counts[name.strip().lower()] = count

        def total(self) -> int:
            total = 0
            for count in self.counts.values():
                total += count
            return total

        def top(self, n: int = 3) -> list[str]:
            names = sorted(self.counts, key=lambda name: -self.counts[name])
            return names[:n]

        def restock(self, name: str, amount: int) -> int:
            if amount <= 0 or name not in self.counts:
                return 0
            current = self.counts[name]
            self.counts[name] = current + amount * 2 - 1
            return self.counts[name]


    def window(values: list[int], size: int) -> list[int]:
        sums = []
        for start in range(len(values) - size + 1):
            chunk = values[start : start + size]
            if len(chunk) == size:
                sums.append(sum(chunk))
            else:
                sums.append(0)
        return sums


    def describe(count: int) -> str:
        if count == 0:
            label = "none"
        elif count == 1:
            label = "one"
        else:
            label = "many"
        return label.upper().strip()


    async def drain(queue, limit: int = 10) -> list[object]:
        taken = []
        while len(taken) < limit and not queue.empty():
            item = await queue.get()
            if item is not None:
                taken.append(item)
        return taken


    def parse_pairs(text: str) -> dict[str, int]:
        pairs = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            pairs[key.strip()] = int(value) % 100
        return pairs
    '''
)


def test_every_bug_of_a_realistic_module_parses_and_changes_only_its_function() -> None:
    assert 75 <= len(REALISTIC.splitlines()) <= 90
    bugs = bugs_in_source(REALISTIC, "inventory.py")
    original_dump = ast.dump(ast.parse(REALISTIC))
    original_lines = split_lines(REALISTIC)
    assert {bug.kind for bug in bugs} == set(BUG_KINDS)
    assert len({bug.buggy for bug in bugs}) == len(bugs)
    for bug in bugs:
        assert ast.dump(ast.parse(bug.buggy)) != original_dump, bug.description
        lines = split_lines(bug.buggy)
        assert lines[: bug.start_line - 1] == original_lines[: bug.start_line - 1]
        assert lines[bug.buggy_end_line :] == original_lines[bug.end_line :]
        assert bug.start_line <= bug.line <= bug.end_line
        assert bug.description.startswith(f"line {bug.line}: ")
    positions = [(bug.line, BUG_KINDS.index(bug.kind)) for bug in bugs]
    assert [line for line, _ in positions] == sorted(line for line, _ in positions)


def _run(source: str, call: str) -> object:
    namespace: dict[str, object] = {}
    exec(compile(source, "<module>", "exec"), namespace)
    return eval(call, namespace)


def test_a_flip_changes_behaviour() -> None:
    source = "def is_adult(age):\n    return age >= 18\n"
    bug = only_bug(source, "flip_operator")
    assert bug.buggy == "def is_adult(age):\n    return age <= 18\n"
    assert [_run(source, f"is_adult({age})") for age in (10, 18, 30)] == [False, True, True]
    assert [_run(bug.buggy, f"is_adult({age})") for age in (10, 18, 30)] == [True, True, False]


def test_each_bug_of_a_small_function_changes_some_output() -> None:
    source = _source(
        """
        def clipped_sum(values, limit):
            total = 0
            for value in values[1:]:
                if value > limit:
                    value = limit
                total += value
            return total
        """
    )
    calls = ["clipped_sum([5, 1, 9, 3], 4)", "clipped_sum([0, 2, 7], 5)", "clipped_sum([], 1)"]
    expected = [_run(source, call) for call in calls]
    for bug in bugs_in_source(source, "m.py"):
        outputs = []
        for call in calls:
            try:
                outputs.append(_run(bug.buggy, call))
            except Exception as error:
                outputs.append(type(error))
        assert outputs != expected, bug.description


# ---------------------------------------------------------------------------------------
# A repository


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


FUNCTION = "def f(a, b):\n    c = a + b\n    if c > 1:\n        c -= 1\n    return c < b\n"


def test_find_bugs_is_deterministic_and_respects_per_function(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/a.py": FUNCTION + "\n\n" + FUNCTION.replace("def f", "def g")})
    first = find_bugs(tmp_path, seed=3)
    assert first == find_bugs(tmp_path, seed=3)
    assert [(bug.qualname) for bug in first].count("f") == 2
    assert [(bug.qualname) for bug in first].count("g") == 2
    for name in ("f", "g"):
        kinds = [bug.kind for bug in first if bug.qualname == name]
        assert len(set(kinds)) == 2  # different kinds first
    assert [(bug.file, bug.line) for bug in first] == sorted((bug.file, bug.line) for bug in first)
    assert len(find_bugs(tmp_path, per_function=1)) == 2
    assert len(find_bugs(tmp_path, per_function=100)) == 2 * len(bugs_in_source(FUNCTION, "x"))
    seeds = {tuple(bug.bug_id for bug in find_bugs(tmp_path, seed=seed)) for seed in range(6)}
    assert len(seeds) > 1
    only_flips = find_bugs(tmp_path, kinds=("flip_operator",))
    assert {bug.kind for bug in only_flips} == {"flip_operator"}


def test_find_bugs_skips_tests_config_excluded_hidden_and_unparsable_files(
    tmp_path: Path,
) -> None:
    _write(
        tmp_path,
        {
            "src/pkg/core.py": FUNCTION,
            "src/pkg/extra.py": FUNCTION,
            "src/pkg/broken.py": "def f(:\n" + FUNCTION,
            "src/pkg/latin.py": "# caf\xe9\n" + FUNCTION,
            "tests/test_core.py": FUNCTION,
            "test_top.py": FUNCTION,
            "src/pkg/conftest.py": FUNCTION,
            "setup.py": FUNCTION,
            ".hidden/mod.py": FUNCTION,
            "build/lib/mod.py": FUNCTION,
            "venv/lib/mod.py": FUNCTION,
            "pkg.egg-info/mod.py": FUNCTION,
        },
    )
    (tmp_path / "src/pkg/latin.py").write_bytes(b"# caf\xe9\n" + FUNCTION.encode())
    files = {bug.file for bug in find_bugs(tmp_path, exclude=["src/pkg/extra.py"])}
    assert files == {"src/pkg/core.py"}


def test_combine_applies_both_changes(tmp_path: Path) -> None:
    source = "import os\n\n\n" + FUNCTION + "\n\n" + FUNCTION.replace("def f", "def g")
    bugs = bugs_in_source(source, "m.py")
    first = next(bug for bug in bugs if bug.qualname == "f" and bug.kind == "remove_conditional")
    second = next(bug for bug in bugs if bug.qualname == "g" and bug.kind == "flip_operator")
    both = combine(first, second)
    assert both.kind == "remove_conditional+flip_operator"
    assert both.qualname == "f+g"
    assert (both.start_line, both.end_line) == (first.start_line, second.end_line)
    assert both.buggy_end_line == second.end_line - 2  # f lost two lines
    assert both.line == first.line
    ast.parse(both.buggy)
    f_part = split_lines(first.buggy)[: first.buggy_end_line]
    g_part = split_lines(second.buggy)[second.start_line - 1 :]
    middle = split_lines(source)[first.end_line : second.start_line - 1]
    assert both.buggy == "".join(f_part + middle + g_part)
    assert combine(second, first).buggy == both.buggy


def test_combine_refuses_overlapping_functions_and_other_files() -> None:
    bugs = bugs_in_source(FUNCTION, "m.py")
    with pytest.raises(ValueError, match="overlap"):
        combine(bugs[0], bugs[1])
    other = bugs_in_source(FUNCTION, "other.py")[0]
    with pytest.raises(ValueError, match="cannot combine"):
        combine(bugs[0], other)
