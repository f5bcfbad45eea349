"""HumanEval: the problems, the prompt, grading in the sandbox (every canonical solution
passes, wrong answers fail), pass@k end to end, and the ``eval --suite humaneval`` command."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from composer_replication.evals import humaneval as he
from composer_replication.samples.generation import Generation


@pytest.fixture(scope="module")
def problems() -> list[he.HumanEvalProblem]:
    return he.load_problems()


def _fenced(problem: he.HumanEvalProblem) -> str:
    """A chat-style reply whose code block is the prompt completed by the reference."""
    return (
        "Here is the function:\n```python\n"
        + problem.prompt
        + problem.canonical_solution
        + "\n```\nIt runs in linear time."
    )


def test_the_164_problems_in_order(problems):
    assert len(problems) == he.N_PROBLEMS == 164
    assert [p.task_id for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    assert [p.task_id for p in he.load_problems(limit=3)] == [
        "HumanEval/0",
        "HumanEval/1",
        "HumanEval/2",
    ]
    with pytest.raises(ValueError, match="limit=0"):
        he.load_problems(limit=0)


def test_preamble_keeps_imports_and_helpers_and_drops_the_stub(problems):
    by_id = {p.task_id: p for p in problems}
    assert by_id["HumanEval/0"].preamble == "from typing import List"
    assert by_id["HumanEval/2"].preamble == ""
    find_zero = by_id["HumanEval/32"]
    assert "import math" in find_zero.preamble and "def poly(" in find_zero.preamble
    assert "def find_zero(" not in find_zero.preamble
    assert find_zero.stub.startswith("def find_zero(") and '"""' in find_zero.stub
    assert "def encode_cyclic(" in by_id["HumanEval/38"].preamble
    assert by_id["HumanEval/64"].preamble.startswith("FIX = ")
    for p in problems:
        assert f"def {p.entry_point}(" not in p.preamble, p.task_id
        assert p.stub.startswith(f"def {p.entry_point}("), p.task_id


def test_prompt_is_the_python_functions_chat(problems):
    from composer_replication.envs.python_functions import SYSTEM_PROMPT

    chat = he.messages(problems[2])  # its prompt starts with blank lines
    assert chat[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert chat[1]["role"] == "user"
    expected = f"Complete this function:\n```python\n{problems[2].prompt.strip()}\n```"
    assert chat[1]["content"] == expected


def test_program_layout(problems):
    p = problems[0]
    candidate = "def has_close_elements(numbers, threshold):\n    return False\n"
    text = he.program(p, candidate, marker="MARK")
    order = [
        text.index("from typing import List"),
        text.index("def has_close_elements"),
        text.index("def check(candidate)"),
        text.index("check(has_close_elements)"),
        text.index("print('MARK', flush=True)"),
    ]
    assert order == sorted(order)
    assert "print(" not in he.program(p, candidate)
    compile(text, "program.py", "exec")


@pytest.mark.integration
def test_every_canonical_solution_passes_through_the_grading_path(problems):
    """Prompt + canonical solution as the model's reply: extract_code, the program, the
    sandbox. (About 4 s for the 164 programs on 2 CPU cores.)"""
    t0 = time.perf_counter()
    verdicts = he.grade_completions(problems, [[_fenced(p)] for p in problems], workers=2)
    seconds = time.perf_counter() - t0
    failed = {p.task_id: v[0] for p, v in zip(problems, verdicts) if not v[0].passed}
    assert failed == {}
    assert len(verdicts) == 164 and all(len(v) == 1 for v in verdicts)
    print(f"164 canonical solutions graded in {seconds:.1f} s")


@pytest.mark.integration
def test_wrong_answers_fail(problems):
    p = problems[0]  # has_close_elements
    head = "def has_close_elements(numbers, threshold):\n"

    def verdict(candidate, **kw):
        return he.grade_candidate(p, candidate, **kw)

    wrong = verdict(head + "    return None\n")
    assert (wrong.status, wrong.detail) == ("failed", "AssertionError")
    syntax = verdict(head + "    return (\n")
    assert syntax.status == "failed" and "SyntaxError" in syntax.detail
    raises = verdict(head + "    raise RuntimeError('no idea')\n")
    assert raises.status == "failed" and raises.detail == "RuntimeError: no idea"
    early = verdict(head + "    import os\n    os._exit(0)\n")
    assert (early.status, early.detail) == (
        "failed",
        "the process exited before check() returned",
    )
    t0 = time.perf_counter()
    loop = verdict(head + "    while True:\n        pass\n", make_sandbox=he.sandbox_factory(2))
    assert loop.status == "timeout" and not loop.passed
    assert time.perf_counter() - t0 < 15
    # through the reply: no function of that name, or one that does not parse
    assert he.grade_completion(p, "I would sort the numbers first.").status == "format"
    assert he.grade_completion(p, "```python\n" + head + "    return (\n```").status == "format"
    assert he.grade_completion(p, "```python\ndef close(a, b):\n    return 1\n```").status == (
        "format"
    )
    assert he.grade_candidate(p, None).status == "format"


class ScriptedSampler:
    """A Sampler of scripted replies: per entry point, by temperature, cycling through a
    list (it samples from no policy)."""

    samples_from_live_policy = False

    def __init__(self, greedy: dict[str, str], sampled: dict[str, list[str]]):
        self.greedy, self.sampled = greedy, sampled
        self.seen: dict[str, int] = {}

    def sample_batch(self, tokenizer, prompts, settings, *, max_rows=None, on_row_done=None):
        out = []
        for ids in prompts:
            text = tokenizer.decode(ids)
            name = next(n for n in self.greedy if f"def {n}(" in text)
            if settings.temperature == 0:
                reply = self.greedy[name]
            else:
                i = self.seen.get(name, 0)
                self.seen[name] = i + 1
                reply = self.sampled[name][i % len(self.sampled[name])]
            out.append(Generation(list(ids), [], [], "stop", text=reply))
        return out


@pytest.mark.integration
def test_scores_end_to_end_with_known_answers(problems):
    from composer_replication.model.loading import load_tokenizer

    first = problems[:3]
    right = {p.entry_point: _fenced(p) for p in first}
    wrong = {p.entry_point: "no code today" for p in first}
    a, b, c = (p.entry_point for p in first)
    sampler = ScriptedSampler(
        greedy={a: right[a], b: wrong[b], c: right[c]},
        sampled={  # passes per problem: 2 of 5, 0 of 5, 5 of 5
            a: [right[a], wrong[a], right[a], wrong[a], wrong[a]],
            b: [wrong[b]],
            c: [right[c]],
        },
    )
    calls = []
    result = he.run_humaneval(
        sampler,
        load_tokenizer(),
        first,
        samples=5,
        temperature=0.8,
        progress=lambda phase, done, total: calls.append((phase, done, total)),
    )
    assert result["greedy"]["pass@1"] == pytest.approx(2 / 3)
    assert (result["greedy"]["passed"], result["greedy"]["format_count"]) == (2, 1)
    sampled = result["sampled"]
    assert sampled["ks"] == [1, 5]
    assert sampled["pass@1"] == pytest.approx((2 / 5 + 0 + 1) / 3)
    assert sampled["pass@5"] == pytest.approx((1 + 0 + 1) / 3)
    assert (sampled["attempts"], sampled["passed"], sampled["format_count"]) == (15, 7, 8)
    per = result["per_problem"]
    assert per["HumanEval/0"]["sampled"] == ["passed", "format", "passed", "format", "format"]
    assert [per[p.task_id]["sampled_passed"] for p in first] == [2, 0, 5]
    assert per["HumanEval/1"]["greedy"]["status"] == "format"
    assert ("grade (sampled)", 15, 15) in calls and ("generate (greedy)", 3, 3) in calls


def test_bad_settings_are_refused_before_any_work(problems):
    with pytest.raises(ValueError, match="nothing to evaluate"):
        he.run_humaneval(None, None, problems[:1], greedy=False, samples=0)
    with pytest.raises(ValueError, match="temperature=0"):
        he.run_humaneval(None, None, problems[:1], samples=4, temperature=0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        he.sandbox_factory(0)


def test_sampling_is_seeded_and_leaves_the_callers_rng_alone(problems):
    import torch

    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.model.loading import tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    policy = InProcessSampler(model)
    kwargs = dict(samples=2, temperature=1.0, max_new_tokens=6)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = he.generate_completions(policy, tokenizer, problems[:2], seed=5, **kwargs)
    assert torch.equal(torch.random.get_rng_state(), state)
    again = he.generate_completions(policy, tokenizer, problems[:2], seed=5, **kwargs)
    other = he.generate_completions(policy, tokenizer, problems[:2], seed=6, **kwargs)
    assert [len(texts) for texts in first] == [2, 2]
    assert first == again and first != other


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tok = tiny_policy(seed=0)
    return str(save_checkpoint(model, tmp_path_factory.mktemp("tiny") / "model", tokenizer=tok))


@pytest.mark.integration
def test_eval_command_on_humaneval_writes_the_result(tiny_dir, tmp_path):
    from composer_replication.cli import app

    out = tmp_path / "results" / "humaneval.json"
    args = ["eval", tiny_dir, "--suite", "humaneval", "--limit", "3", "--max-new-tokens", "8"]
    args += ["--samples", "2", "--temperature", "1.0", "--seed", "3", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for text in ("greedy pass@1", "pass@2", "HumanEval (3 problems)"):
        assert text in result.output
    data = json.loads(out.read_text())
    assert data["suite"] == "humaneval" and data["model"] == tiny_dir
    assert (data["n_problems"], data["limit"], data["seed"]) == (3, 3, 3)
    assert (data["max_new_tokens"], data["timeout_s"]) == (8, 10.0)
    assert set(data["greedy"]) == {
        "pass@1",
        "attempts",
        "passed",
        "failed_count",
        "timeout_count",
        "format_count",
        "infrastructure_count",
    }
    assert data["greedy"]["attempts"] == 3 and 0 <= data["greedy"]["pass@1"] <= 1
    sampled = data["sampled"]
    assert (sampled["samples_per_problem"], sampled["temperature"], sampled["ks"]) == (
        2,
        1.0,
        [1, 2],
    )
    assert sampled["attempts"] == 6 and {"pass@1", "pass@2"} <= set(sampled)
    assert list(data["per_problem"]) == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    for entry in data["per_problem"].values():
        assert entry["greedy"]["status"] in ("passed", "failed", "timeout", "format")
        assert set(entry["greedy"]) == {"status", "detail", "completion"}
        assert len(entry["sampled"]) == 2 and 0 <= entry["sampled_passed"] <= 2
    assert not list(out.parent.glob(".*.tmp"))  # written through a renamed temporary


def test_eval_command_refuses_bad_combinations(tiny_dir, tmp_path):
    from composer_replication.cli import app

    runner = CliRunner()

    def unboxed(output: str) -> str:  # rich wraps the error in a box
        return " ".join(output.replace("│", " ").split())

    cases = [
        (["--suite", "mmlu"], "'mmlu'; use heldout or humaneval"),
        (["--suite", "humaneval", "--samples", "4", "--temperature", "0"], "temperature"),
        (["--suite", "humaneval", "--no-greedy"], "nothing to evaluate"),
        (["--suite", "humaneval", "--env", "feature_deletion"], "--env and --split"),
    ]
    for extra, message in cases:
        result = runner.invoke(app, ["eval", tiny_dir, *extra])
        assert result.exit_code == 2, (extra, result.output)
        assert message in unboxed(result.output), (extra, result.output)
    missing = runner.invoke(app, ["eval", str(tmp_path / "nope"), "--suite", "humaneval"])
    assert missing.exit_code == 2 and "does not exist" in unboxed(missing.output)
