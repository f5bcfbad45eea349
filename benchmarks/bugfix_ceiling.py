"""What a model can fix with no tools: the ceiling of the bug-fix recipe, per bug kind.

Run: ``python benchmarks/bugfix_ceiling.py --task-file TASKS.jsonl [--model embedded]``
(a few minutes on 2 CPU cores for the held-out tasks of smallkit). For each held-out bug
task the model is shown the buggy function (as the task's workdir has it) and the failing
tests' report (the task's problem statement) and asked for the fixed function, greedy. Its
answer is scripted into the task's own episode (``replace`` of the whole function, then
``finish``) and graded by the environment's real scorer in the sandbox, so "resolved" means
what it means for the agent: every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks.

Printed: resolved / tasks per bug kind and overall, and (``--show``) each answer. The agent
cannot do better than this with the same model unless training teaches it to fix bugs;
kinds at zero here are beyond the model, kinds above zero are where a recipe can move.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, check_input, machine_line

SYSTEM = "You are a careful Python programmer. You fix bugs in Python functions."
_BLOCK = re.compile(r"```(?:python)?\n(.*?)(?:```|$)", re.DOTALL)


def fix_prompt(buggy: str, statement: str) -> str:
    """The question: the buggy function and the failing tests' report."""
    report = statement.split("\n\n", 1)[-1]
    for section in ("\n\nThe error was raised in `", "\n\nThe failing tests call `"):
        report = report.split(section, 1)[0]  # the task's own copy of the code
    report = report.rsplit("\n\nAlso failing", 1)[0].strip()
    return (
        f"This function has a bug:\n\n```python\n{buggy.rstrip()}\n```\n\n"
        f"The failing tests report:\n\n{report}\n\n"
        "Write the whole corrected function in one ```python block."
    )


def answer_code(text: str, buggy: str) -> str:
    """The function the answer writes (its first definition, where the answer goes on to
    write more), indented as the buggy one is (a method keeps its class's indentation)."""
    import ast
    import textwrap

    match = _BLOCK.search(text)
    code = (match.group(1) if match else text).strip("\n")
    try:
        tree = ast.parse(textwrap.dedent(code))
    except SyntaxError:
        tree = None
    if tree is not None and tree.body and hasattr(tree.body[0], "decorator_list"):
        code = "\n".join(code.splitlines()[: tree.body[0].end_lineno])
    first_old = next((ln for ln in buggy.splitlines() if ln.strip()), "")
    first_new = next((ln for ln in code.splitlines() if ln.strip()), "")
    want = len(first_old) - len(first_old.lstrip())
    have = len(first_new) - len(first_new.lstrip())
    if want != have:
        shift = want - have
        code = "\n".join(
            (" " * shift + ln if shift > 0 else ln[min(-shift, len(ln) - len(ln.lstrip())) :])
            if ln.strip()
            else ln
            for ln in code.splitlines()
        )
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task-file", type=Path, required=True)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--split", default="heldout", choices=("heldout", "train", "all"))
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--show", action="store_true", help="print every answer")
    args = parser.parse_args()
    check_input(args.task_file, "--task-file")
    check_count(args.max_new_tokens, "--max-new-tokens", what="tokens")
    check_count(args.batch, "--batch", what="prompts at once")

    from composer_replication.envs.feature_deletion import FeatureDeletionEnv
    from composer_replication.inference.decoding.generate import SamplingSettings, generate
    from composer_replication.model.loading import load_policy

    print(machine_line())
    env = FeatureDeletionEnv(args.task_file, tools=["replace", "finish"], max_turns=2)
    tasks = [
        t
        for t in env.tasks.values()
        if t.kind == "bug" and (args.split == "all" or t.split == args.split)
    ]
    if not tasks:
        raise SystemExit(f"error: no {args.split} bug tasks in {args.task_file}")
    model, tokenizer = load_policy(None if args.model == "embedded" else args.model)
    started = time.perf_counter()
    buggy = {}
    prompts = []
    for task in tasks:
        ref = env.reference(task.task_id)
        lines = (env.workdirs[task.task_id] / ref.file).read_text(encoding="utf-8")
        buggy[task.task_id] = "".join(
            lines.splitlines(keepends=True)[ref.start_line - 1 : ref.end_line]
        )
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": fix_prompt(buggy[task.task_id], task.prompt)},
        ]
        prompts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        )
        if not isinstance(prompts[-1], list):  # transformers >= 5 returns a mapping
            prompts[-1] = list(prompts[-1]["input_ids"])
    answers = []
    settings = SamplingSettings(
        max_new_tokens=args.max_new_tokens, temperature=0.0, stop_strings=("\n```",)
    )
    for start in range(0, len(prompts), args.batch):
        batch = prompts[start : start + args.batch]
        answers += [
            tokenizer.decode(g.completion_ids, skip_special_tokens=True)
            for g in generate(model, tokenizer, batch, settings)
        ]
    decoded = time.perf_counter() - started
    tool_format = env.format_for(tokenizer)
    scripts = []
    for task, answer in zip(tasks, answers):
        old = buggy[task.task_id].rstrip("\n")
        new = answer_code(answer, old)
        scripts.append(
            [
                tool_format.format_call("replace", {"path": task.file, "old": old, "new": new}),
                tool_format.format_call("finish", {}),
            ]
        )
    rollouts = env.solve_many_with_reference(
        tokenizer, [t.task_id for t in tasks], max_new_tokens=4096, scripts=scripts
    )
    resolved, total = Counter(), Counter()
    for task, rollout, answer in zip(tasks, rollouts, answers):
        kind = task.bug_kind or "?"
        total[kind] += 1
        ok = rollout.reward >= 1.0
        resolved[kind] += ok
        if args.show:
            print(
                f"\n--- {task.task_id} ({kind}): {'resolved' if ok else f'reward {rollout.reward:.2f}'}"
            )
            print(answer_code(answer, buggy[task.task_id]))
    print(
        f"\n{len(tasks)} {args.split} bug tasks of {args.task_file}; model {args.model}; "
        f"decoded in {decoded:.0f} s, graded in {time.perf_counter() - started - decoded:.0f} s"
    )
    print(f"{'bug kind':<22} {'resolved':>9}")
    for kind in sorted(total):
        print(f"{kind:<22} {resolved[kind]:>4} / {total[kind]:<4}")
    n_ok, n = sum(resolved.values()), sum(total.values())
    print(f"{'all':<22} {n_ok:>4} / {n:<4} = {n_ok / n:.2f}")


if __name__ == "__main__":
    main()
