"""Definitions found by name and rewritten whole: methods by ``Class.method``, decorators
in, the new code indented as the old definition was, every other line kept."""

from __future__ import annotations

import pytest

from composer_replication.envs.definitions import (
    definitions,
    docstring_lines,
    find_definition,
    with_definition,
    with_docstring,
    without_docstring,
)

SOURCE = """\
import functools


@functools.cache
def area(w, h):
    return w * h


class Shape:
    def area(self):
        def inner():
            return 1

        return inner()

    @property
    def sides(self):
        return 4
"""


def test_definitions_are_qualified_and_span_their_decorators() -> None:
    found = [(d.qualname, d.first_line, d.last_line, d.indent) for d in definitions(SOURCE)]
    assert found == [
        ("area", 4, 6, ""),
        ("Shape.area", 10, 14, "    "),
        ("Shape.area.inner", 11, 12, "        "),
        ("Shape.sides", 16, 18, "    "),
    ]
    assert definitions("def broken(:\n") == []


def test_a_name_means_one_definition_or_says_which_there_are() -> None:
    assert find_definition(SOURCE, "sides").qualname == "Shape.sides"
    assert find_definition(SOURCE, "area").qualname == "area"  # the exact name wins
    assert find_definition(SOURCE, "Shape.area").first_line == 10
    assert find_definition(SOURCE, " sides() ").qualname == "Shape.sides"  # as a call
    with pytest.raises(LookupError, match="no function 'Sides' is defined here; did you mean"):
        find_definition(SOURCE, "Sides")
    two = "class A:\n    def f(self): pass\nclass B:\n    def f(self): pass\n"
    with pytest.raises(LookupError, match=r"'f' names 2 definitions \(A.f, B.f\)"):
        find_definition(two, "f")


def test_new_code_takes_the_old_definitions_place_and_indentation() -> None:
    method = find_definition(SOURCE, "Shape.sides")
    updated = with_definition(SOURCE, method, "@property\ndef sides(self):\n    return 3\n")
    assert updated == SOURCE.replace("return 4", "return 3")
    top = find_definition(SOURCE, "area")
    rewritten = with_definition(SOURCE, top, "    def area(w, h):\n        return h * w")
    assert rewritten.splitlines()[3:6] == ["def area(w, h):", "    return h * w", ""]
    assert rewritten.splitlines()[:3] == SOURCE.splitlines()[:3]
    assert rewritten.endswith(SOURCE[SOURCE.index("class Shape") :])
    crlf = "def f():\r\n    return 1\r\nx = 1\r\n"
    assert with_definition(crlf, find_definition(crlf, "f"), "def f():\n    return 2") == (
        "def f():\r\n    return 2\r\nx = 1\r\n"
    )
    last = "def f():\n    return 1"  # no line end at the end of the file
    assert with_definition(last, find_definition(last, "f"), "def f():\n    return 2\n") == (
        "def f():\n    return 2"
    )


DOCUMENTED = '''\
    def f(self, x):
        """Add one.

    >>> f(1)
        2
        """
        return x + 1'''


def test_code_written_without_a_docstring_keeps_the_old_one() -> None:
    assert docstring_lines(DOCUMENTED) == ['    """Add one.', "", ">>> f(1)", "    2", '    """']
    assert without_docstring(DOCUMENTED) == "    def f(self, x):\n        return x + 1"
    # the old docstring goes where the new body starts, at the new body's indentation
    assert with_docstring("def f(self, x):\n  # why\n  return x + 2", DOCUMENTED) == (
        'def f(self, x):\n  # why\n  """Add one.\n\n>>> f(1)\n  2\n  """\n  return x + 2'
    )
    mine = 'def f(self, x):\n    """Mine."""\n    return 0'
    assert with_docstring(mine, DOCUMENTED) == mine  # its own docstring wins
    assert with_docstring("def f(self, x): return 0", DOCUMENTED) == "def f(self, x): return 0"
    assert with_docstring("def f(x):\n    return 0", "def f(x):\n    return 1") == (
        "def f(x):\n    return 0"
    )  # nothing to keep
    assert docstring_lines("def (:") is None and without_docstring("x = 1") == "x = 1"
