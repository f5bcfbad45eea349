"""The shipped python_functions task bank: shape, self-consistency, grading helpers."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import json
import os
import re
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

from composer_replication.envs.task_bank import (
    SOLUTION_FILE,
    TEST_FILE,
    TEST_HEADER,
    PythonTask,
    extract_code,
    load_tasks,
    task_files,
    validate_reference,
)

EXPECTED_MIX = {"easy": 160, "medium": 112, "hard": 48}
ID_RE = re.compile(r"^pf-(\d{3})-[a-z0-9]+(?:-[a-z0-9]+)*$")


@pytest.fixture(scope="module")
def tasks() -> list[PythonTask]:
    return load_tasks()


# ---------------------------------------------------------------------------------------
# The shipped set


def test_shipped_set_size_ids_and_entry_points(tasks):
    assert len(tasks) >= 300
    ids = [t.task_id for t in tasks]
    assert len(set(ids)) == len(ids)
    numbers = []
    for t in tasks:
        m = ID_RE.match(t.task_id)
        assert m, t.task_id
        numbers.append(int(m.group(1)))
    assert sorted(numbers) == list(range(1, len(tasks) + 1))
    entry_points = [t.entry_point for t in tasks]
    assert len(set(entry_points)) == len(entry_points)


def test_difficulty_mix(tasks):
    counts = Counter(t.difficulty for t in tasks)
    assert counts == EXPECTED_MIX
    n = len(tasks)
    assert abs(counts["easy"] / n - 0.50) <= 0.05
    assert abs(counts["medium"] / n - 0.35) <= 0.05
    assert abs(counts["hard"] / n - 0.15) <= 0.05


def test_prompt_is_signature_and_docstring(tasks):
    for t in tasks:
        assert t.prompt.startswith(t.signature + "\n"), t.task_id
        fn = ast.parse(t.prompt).body[0]
        assert isinstance(fn, ast.FunctionDef) and fn.name == t.entry_point, t.task_id
        assert ast.get_docstring(fn) == t.docstring, t.task_id
        assert len(fn.body) == 1, t.task_id  # docstring only
        assert t.docstring.count(">>> ") == 1, t.task_id
        assert t.signature in t.reference.splitlines(), t.task_id
        assert t.tags and all(tag == tag.lower() for tag in t.tags), t.task_id


def test_docstring_example_agrees_with_reference(tasks):
    for t in tasks:
        namespace: dict = {}
        exec(compile(t.reference, f"<{t.task_id}>", "exec"), namespace)
        parser = doctest.DocTestParser()
        test = parser.get_doctest(t.docstring, namespace, t.task_id, None, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        result = runner.run(test, out=lambda _s: None)
        assert result.attempted == 1 and result.failed == 0, t.task_id


def test_tests_and_references_are_self_contained(tasks):
    allowed_ref_imports = {"bisect", "math", "collections", "itertools", "functools", "string"}
    for t in tasks:
        tree = ast.parse(t.tests)
        assert all(isinstance(node, ast.FunctionDef) for node in tree.body), t.task_id
        assert 4 <= len(t.test_names) <= 6, t.task_id
        assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree))
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert t.entry_point in used, t.task_id
        ref = ast.parse(t.reference)
        for node in ast.walk(ref):
            if isinstance(node, ast.Import):
                assert {a.name for a in node.names} <= allowed_ref_imports, t.task_id
            elif isinstance(node, ast.ImportFrom):
                assert node.module in allowed_ref_imports, t.task_id


def _wrong_solutions(task: PythonTask) -> dict[str, str]:
    name = task.entry_point
    return {
        "none": f"def {name}(*args, **kwargs):\n    return None\n",
        "first_arg": f"def {name}(*args, **kwargs):\n    return args[0] if args else None\n",
        # the classic small-model hack: hard-code the answer of the docstring example
        "example": f"def {name}(*args, **kwargs):\n    return {task.docstring.splitlines()[-1]}\n",
    }


@pytest.fixture(scope="module")
def bank_run(tasks, tmp_path_factory):
    """All tasks x (reference, three wrong solutions) in ONE pytest subprocess.

    Every candidate gets its own module name (``ref_017.py`` + ``test_ref_017.py`` starting
    ``from ref_017 import *``), so the pairs can share a directory. Returns
    {(variant, task_id): {test_name: (passed, seconds)}}.
    """
    root = tmp_path_factory.mktemp("bank")
    owner: dict[str, tuple[str, str]] = {}
    for i, task in enumerate(tasks, start=1):
        variants = {"ref": task.reference, **_wrong_solutions(task)}
        for variant, source in variants.items():
            files = task_files(task, source)
            assert files[TEST_FILE].startswith(TEST_HEADER)
            module = f"{variant}_{i:03d}"
            (root / f"{module}.py").write_text(files[SOLUTION_FILE])
            body = files[TEST_FILE][len(TEST_HEADER) :]
            (root / f"test_{module}.py").write_text(f"from {module} import *\n" + body)
            owner[f"test_{module}"] = (variant, task.task_id)
    (root / "pytest.ini").write_text("[pytest]\n")
    junit = root / "report.xml"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("PYTEST_ADDOPTS", None)
    # --tb=no: the verdicts come from the junit report; pytest's failure summary is
    # quadratic in the number of failures (the wrong solutions fail thousands of tests)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--tb=no",
            f"--junitxml={junit}",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    results: dict[tuple[str, str], dict[str, tuple[bool, float]]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        key = owner[case.get("classname", "").split(".")[-1]]
        ok = not any(c.tag in ("failure", "error", "skipped") for c in case)
        results.setdefault(key, {})[case.get("name")] = (ok, float(case.get("time", "0")))
    return results


def test_every_reference_passes_all_its_tests(tasks, bank_run):
    results = bank_run
    for t in tasks:
        outcome = results.get(("ref", t.task_id), {})
        assert set(outcome) == set(t.test_names), t.task_id
        failed = [name for name, (ok, _) in outcome.items() if not ok]
        assert not failed, (t.task_id, failed)


@pytest.mark.parametrize("variant", ["none", "first_arg", "example"])
def test_wrong_solutions_fail_and_earn_at_most_half_credit(tasks, bank_run, variant):
    results = bank_run
    for t in tasks:
        outcome = results[(variant, t.task_id)]
        assert set(outcome) == set(t.test_names), t.task_id
        passed = sum(ok for ok, _ in outcome.values())
        assert passed < len(outcome), (variant, t.task_id)
        assert passed / len(outcome) <= 0.5, (variant, t.task_id, passed)


def test_validate_reference_real_path(tasks):
    by_difficulty = {}
    for t in tasks:
        by_difficulty.setdefault(t.difficulty, t)
    for t in by_difficulty.values():
        n = len(t.test_names)
        assert validate_reference(t) == (n, n), t.task_id


def test_validate_reference_counts_partial_credit(tasks):
    task = next(t for t in tasks if t.entry_point == "clamp")
    # right inside the range, wrong outside it: only the in-range tests pass
    broken = dataclasses.replace(task, reference="def clamp(x, low, high):\n    return x\n")
    assert validate_reference(broken) == (1, 4)
    crashing = dataclasses.replace(task, reference="def clamp(x, low, high):\n    1 / 0\n")
    assert validate_reference(crashing) == (0, 4)
    syntax = dataclasses.replace(task, reference="def clamp(x, low, high) return x\n")
    assert validate_reference(syntax) == (0, 4)


def test_validate_reference_timeout(tasks):
    task = next(t for t in tasks if t.entry_point == "sign")
    looping = dataclasses.replace(task, reference="def sign(n):\n    while True:\n        pass\n")
    # the reference never returns: only the timeout can give this verdict (its seconds:
    # benchmarks/task_bank.py)
    assert validate_reference(looping, timeout_s=2) == (0, 4)


def test_task_files_layout(tasks):
    task = tasks[0]
    files = task_files(task, "def sum_list(nums):\n    return sum(nums)\n")
    assert set(files) == {"solution.py", "test_solution.py"}
    assert files["solution.py"] == "def sum_list(nums):\n    return sum(nums)\n"
    assert files["test_solution.py"] == "from solution import *\n" + task.tests
    assert task.n_tests == len(task.test_names) == 4


def test_from_dict_validates(tasks):
    assert PythonTask.from_dict(_good_line(tasks)) == tasks[0]
    with pytest.raises(ValueError, match="difficulty 'easyish'"):
        PythonTask.from_dict({**_good_line(tasks), "difficulty": "easyish"})


def test_task_is_frozen(tasks):
    with pytest.raises(dataclasses.FrozenInstanceError):
        tasks[0].difficulty = "hard"  # type: ignore[misc]
    assert isinstance(tasks[0].tags, tuple)
    assert hash(tasks[0]) == hash(dataclasses.replace(tasks[0]))


# ---------------------------------------------------------------------------------------
# extract_code


def _run(code: str, call: str):
    namespace: dict = {}
    exec(code, namespace)
    return eval(call, namespace)


def test_extract_fenced_block():
    text = (
        "Here is my solution:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
        "It adds the numbers."
    )
    code = extract_code(text, "add")
    assert code == "def add(a, b):\n    return a + b\n"


def test_extract_code_does_not_print_syntax_warnings(capfd):
    # `1for` makes Python's tokenizer warn; a run parses every completion, so such
    # warnings would flood its log.
    text = "def evens(xs):\n    return [x for x in xs if x % 2 == 0] + [1for _ in '']\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SyntaxWarning)
        assert extract_code(text, "evens") == text
    assert "SyntaxWarning" not in capfd.readouterr().err


def test_extract_unfenced_bare_code():
    text = "def is_even(n):\n    return n % 2 == 0\n"
    assert extract_code(text, "is_even") == text


def test_extract_chatty_unfenced_with_usage_and_helper():
    text = (
        "Sure! Here's a function that counts vowels.\n"
        "import re\n"
        "VOWELS = 'aeiou'\n"
        "\n"
        "def _is_vowel(ch):\n"
        "    return ch in VOWELS\n"
        "\n"
        "def count_vowels(s):\n"
        "    result = 0\n"
        "    for ch in s.lower():\n"
        "        if _is_vowel(ch):\n"
        "            result += 1\n"
        "    return result\n"
        "\n"
        "Example usage:\n"
        "result = count_vowels('Banana')\n"
        "print(result)  # 3\n"
        "\n"
        "def unrelated():\n"
        "    return 1\n"
        "This works because we lower-case the string first.\n"
    )
    code = extract_code(text, "count_vowels")
    assert code is not None
    tree = ast.parse(code)
    kinds = [(type(n).__name__, getattr(n, "name", None)) for n in tree.body]
    assert kinds == [
        ("Import", None),
        ("Assign", None),
        ("FunctionDef", "_is_vowel"),
        ("FunctionDef", "count_vowels"),
    ]
    assert "print" not in code and "unrelated" not in code
    assert _run(code, "count_vowels('Banana')") == 3


def test_extract_drops_main_block_and_asserts():
    text = (
        "```py\n"
        "from math import sqrt\n\n"
        "def hyp(a, b):\n    return sqrt(a * a + b * b)\n\n"
        "assert hyp(3, 4) == 99\n\n"
        'if __name__ == "__main__":\n    print(hyp(3, 4))\n'
        "```"
    )
    code = extract_code(text, "hyp")
    assert code == "from math import sqrt\n\ndef hyp(a, b):\n    return sqrt(a * a + b * b)\n"


def test_extract_missing_function_returns_none():
    assert extract_code("I don't know how to do that.", "reverse_string") is None
    assert (
        extract_code("```python\ndef reverse(s):\n    return s[::-1]\n```", "reverse_string")
        is None
    )
    assert extract_code("", "f") is None
    # mentioned but never defined
    assert extract_code("You can call reverse_string('abc') to reverse.", "reverse_string") is None


def test_extract_broken_definition_returns_none():
    assert extract_code("```python\ndef f(x)\n    return x\n```", "f") is None
    # truncated mid-expression by the token budget
    assert extract_code("```python\ndef f(x):\n    return (x +\n", "f") is None


def test_extract_truncated_last_attempt_falls_back_to_earlier_one():
    text = (
        "```python\ndef f(x):\n    return x\n```\n"
        "A faster version:\n```python\ndef f(x):\n    y = x\n    return y +"
    )
    assert extract_code(text, "f") == "def f(x):\n    return x\n"


def test_extract_is_fast_on_degenerate_repetition():
    looping = "def f(x):\n    return (x +\n" * 400 + "Some prose.\ndef f(x):\n    return x\n" * 400
    # linear, not backtracking: its time is in benchmarks/task_bank.py
    assert extract_code(looping, "f") == "def f(x):\n    return x\n"


def test_extract_unterminated_fence_and_last_block_wins():
    text = (
        "First try:\n```python\ndef f(x):\n    return x\n```\n"
        "Better:\n```python\ndef f(x):\n    return x * 2\n"
    )
    code = extract_code(text, "f")
    assert code == "def f(x):\n    return x * 2\n"


def test_extract_skips_a_later_block_without_the_function():
    text = (
        "```python\ndef square(n):\n    return n * n\n```\n"
        "Usage:\n```python\nprint(square(4))\n```\n"
    )
    assert extract_code(text, "square") == "def square(n):\n    return n * n\n"


def test_extract_indented_code_in_prose():
    text = (
        "Solution:\n"
        "    def triple(x):\n"
        "        return helper(x) * 3\n"
        "\n"
        "    def helper(x):\n"
        "        return x\n"
        "Hope this helps!"
    )
    code = extract_code(text, "triple")
    assert code is not None and _run(code, "triple(2)") == 6


def test_extract_keeps_decorators_and_recursion():
    text = (
        "```python\nfrom functools import lru_cache\n\n"
        "@lru_cache(maxsize=None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "```"
    )
    code = extract_code(text, "fib")
    assert code is not None and code.count("@lru_cache") == 1
    assert _run(code, "fib(20)") == 6765


def test_extract_on_reference_solutions_is_identity_in_behaviour(tasks):
    for t in tasks:
        chatty = f"Here you go:\n```python\n{t.reference}```\nDone."
        code = extract_code(chatty, t.entry_point)
        assert code is not None, t.task_id
        assert ast.dump(ast.parse(code)) == ast.dump(ast.parse(t.reference)), t.task_id


# ---------------------------------------------------------------------------------------
# load_tasks on malformed files


def _good_line(tasks) -> dict:
    t = tasks[0]
    return {
        "task_id": t.task_id,
        "entry_point": t.entry_point,
        "signature": t.signature,
        "docstring": t.docstring,
        "prompt": t.prompt,
        "reference": t.reference,
        "tests": t.tests,
        "difficulty": t.difficulty,
        "tags": list(t.tags),
    }


def test_load_tasks_from_path_round_trip(tasks, tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(_good_line(tasks)) + "\n\n")
    loaded = load_tasks(path)
    assert loaded == [tasks[0]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"difficulty": "trivial"}, "difficulty 'trivial'"),
        ({"reference": "def other(nums):\n    return 0\n"}, "does not define the entry point"),
        ({"tests": "def test_a():\n    assert True\n"}, "at least 3 needed"),
        ({"tests": "def test_a(:\n"}, "tests does not parse"),
        ({"entry_point": "sum list"}, "not a Python identifier"),
        ({"signature": "def other(nums):"}, "signature"),
        ({"tags": "lists"}, "tags"),
        ({"prompt": ""}, "'prompt' must be a non-empty string"),
        ({"extra": 1}, "unknown field(s) extra"),
    ],
)
def test_load_tasks_rejects_bad_task(tasks, tmp_path, change, message):
    raw = {**_good_line(tasks), **change}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(raw) + "\n")
    with pytest.raises(ValueError) as info:
        load_tasks(path)
    text = str(info.value)
    assert message in text
    assert f"{path}:1" in text and tasks[0].task_id in text


def test_load_tasks_rejects_missing_field_duplicates_and_bad_json(tasks, tmp_path):
    good = _good_line(tasks)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "tests"}) + "\n")
    with pytest.raises(ValueError, match=r"pf-001-sum-list.*missing field\(s\) tests"):
        load_tasks(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=r":2: task 'pf-001-sum-list': duplicate task_id"):
        load_tasks(path)
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match=r":2: invalid JSON"):
        load_tasks(path)
