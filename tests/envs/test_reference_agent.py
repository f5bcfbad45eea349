"""The scripted reference agent: edits that apply exactly, the episode it runs, the budgets it
fits, and its episodes as demonstrations."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_replication.datagen.feature_deletion import generate_tasks
from composer_replication.envs.fd_tasks import read_jsonl_records
from composer_replication.envs.fd_tools import occurrences
from composer_replication.envs.feature_deletion import FeatureDeletionEnv
from composer_replication.envs.reference_agent import (
    Edit,
    ReferenceCost,
    edits_between,
    near_miss,
    reference_calls,
    reply_budget_problem,
    reply_span,
    stable_share,
    with_recovery,
    without_reply,
    without_text,
)
from composer_replication.rollout.tool_calls import parse_tool_call
from composer_replication.samples.generation import SamplingSettings
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.workdir import make_shared_tempdir

FD_REPO = Path(__file__).resolve().parents[1] / "fixtures" / "fd_repo"
TASK_ID = "fd:fd_repo:textkit/stats.py:median"


def apply(text: str, edits: list[Edit]) -> str:
    for edit in edits:
        (at,) = occurrences(text, edit.old)  # exactly once, when its turn comes
        text = text[:at] + edit.new + text[at + len(edit.old) :]
    return text


_lines = st.lists(st.sampled_from(["a\n", "b\n", "\n", "x = 1\n", "    return y\n"]), max_size=12)


@settings(max_examples=400, deadline=None)
@given(before=_lines, after=_lines)
def test_edits_turn_before_into_after_each_old_unique_in_its_turn(before, after):
    before, after = "".join(before), "".join(after)
    if not before:
        assert edits_between("f.py", before, after) == (
            [Edit("f.py", "", after, 0, 0)] if after else []
        )
        return
    edits = edits_between("f.py", before, after)
    assert apply(before, edits) == after
    assert all(e.old for e in edits)
    assert [e.first_line for e in edits] == sorted(e.first_line for e in edits)


def test_a_restored_body_is_one_replace_of_the_stub():
    before = (
        'def f(x):\n    """Doc."""\n    raise NotImplementedError("f")\n\n\ndef g():\n    pass\n'
    )
    after = 'def f(x):\n    """Doc."""\n    y = x + 1\n    return y\n\n\ndef g():\n    pass\n'
    (edit,) = edits_between("m.py", before, after)
    assert edit == Edit(
        "m.py", '    raise NotImplementedError("f")\n', "    y = x + 1\n    return y\n", 3, 3
    )
    calls = reference_calls([edit], ["t.py::a", "t.py::b"], line_counts=lambda _: 7)
    assert calls == [
        ("read_file", {"path": "m.py", "start_line": 1, "end_line": 6}),
        (
            "replace",
            {
                "path": "m.py",
                "old": '    raise NotImplementedError("f")',
                "new": "    y = x + 1\n    return y",
            },
        ),
        ("run_tests", {"tests": ["t.py"]}),  # the target tests' files
        ("finish", {}),
    ]
    # without reading first (the prompt shows the code): edit, test, finish
    assert [name for name, _ in reference_calls([edit], ["t.py::a"], read=False)] == [
        "replace", "run_tests", "finish",
    ]  # fmt: skip
    many = [f"tests/test_{i % 2}.py::t{i}" for i in range(9)]
    assert reference_calls([edit], many)[2] == (
        "run_tests",
        {"tests": ["tests/test_0.py", "tests/test_1.py"]},
    )
    new_file = Edit("pkg/new.py", "", "X = 1\n", 0, 0)
    assert reference_calls([new_file], [])[:2] == [
        ("create_file", {"path": "pkg/new.py", "content": "X = 1\n"}),
        ("run_tests", {}),
    ]


def test_budget_problems_name_the_setting(tokenizer):
    replies = ["a " * 50, "b"]
    assert reply_budget_problem(replies, tokenizer, max_turns=1, max_new_tokens=100) == (
        "the reference needs 2 turns; max_turns is 1"
    )
    problem = reply_budget_problem(replies, tokenizer, max_turns=4, max_new_tokens=10)
    assert problem.endswith("tokens; the turn budget (sampling.max_new_tokens) is 10")
    assert reply_budget_problem(replies, tokenizer, max_turns=4, max_new_tokens=100) is None
    cost = ReferenceCost(turns=4, max_reply_tokens=90, total_tokens=1500)
    assert cost.problem(max_turns=8, max_new_tokens=256, max_total_tokens=4096) is None
    assert cost.problem(max_turns=8, max_new_tokens=256, max_total_tokens=1000) == (
        "the reference episode has 1500 tokens; max_total_tokens is 1000"
    )


@pytest.fixture(scope="module")
def generated() -> Iterator[Path]:
    root = make_shared_tempdir("cr-reference-agent-test-")
    repo = root / "fd_repo"
    shutil.copytree(FD_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    report = generate_tasks(
        repo,
        root / "out" / "tasks.jsonl",
        max_tasks=1,
        sandbox_factory=lambda path: LocalSubprocessSandbox(path, exec_timeout_s=60),
        only=["median"],
        environment="system",
    )
    assert report.accepted == 1
    yield Path(report.output)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.integration
def test_the_reference_agent_solves_within_budgets_and_says_why_not_beyond(generated, tokenizer):
    env = FeatureDeletionEnv(generated)
    replies = env.reference_replies(tokenizer, TASK_ID)
    calls = [parse_tool_call(r) for r in replies]
    assert [c.name for c in calls] == ["read_file", "replace", "run_tests", "finish"]
    # code goes in blocks of its own lines, exactly as it is (no JSON escapes)
    assert "\n<new>\n    if not values:\n" in replies[1] and calls[1].arguments["new"].startswith(
        "    if not values:\n        raise ValueError("
    )
    solved = env.solve_with_reference(tokenizer, TASK_ID)
    assert solved.reward == 1.0 and "reference_problem" not in solved.metadata
    assert solved.metadata["end_reason"] == "finish" and solved.metadata["turns"] == 4
    cost = solved.metadata["reference_cost"]
    assert cost["turns"] == 4 and 0 < cost["max_reply_tokens"] <= 256
    assert cost["tool_format"] == "text" and cost["total_tokens"] == len(solved.input_ids)
    # the read showed the stub's line in full, numbered
    read = solved.metadata["conversation"][3]["content"]
    assert "median was removed; restore it" in read and read.startswith("textkit/stats.py (lines")
    # a turn budget below the replace call: unsolvable, and the reason names the setting
    short = env.solve_with_reference(tokenizer, TASK_ID, max_new_tokens=60)
    assert short.reward == 0.0
    assert short.metadata["reference_problem"].startswith("the reference's replace call has")
    assert short.metadata["end_reason"] == "truncated"
    few_turns = FeatureDeletionEnv(generated, max_turns=2).solve_with_reference(tokenizer, TASK_ID)
    assert few_turns.metadata["reference_problem"] == "the reference needs 4 turns; max_turns is 2"


@pytest.mark.integration
def test_demonstrations_are_the_reference_episodes_made_once(generated, tokenizer):
    env = FeatureDeletionEnv(generated)
    (group,) = env.demonstrations(tokenizer, [TASK_ID])
    (demo,) = group
    assert demo.is_demonstration and demo.reward == 1.0
    assert demo.metadata["end_reason"] == "finish"
    sampled = [t for t, m in zip(demo.completion_ids, demo.completion_mask) if m]
    assert "ordered = sorted(values)" in tokenizer.decode(sampled)  # the replies are trained
    again = env.demonstrations(tokenizer, [TASK_ID])[0][0]
    assert again.completion_ids == demo.completion_ids and again is not demo
    assert env._demonstrations[(TASK_ID, id(tokenizer))] is not again  # kept, handed out as copies


@pytest.mark.integration
def test_a_run_with_budgets_below_a_tasks_recorded_reference_is_refused(generated, tokenizer):
    records = read_jsonl_records(generated)
    heldout = generated.with_name("tasks.heldout.jsonl")
    records += read_jsonl_records(heldout) if heldout.is_file() else []
    cost = {"turns": 4, "max_reply_tokens": 120, "total_tokens": 900, "tool_format": "text",
            "tokenizer": tokenizer.name_or_path}  # fmt: skip
    copy = generated.with_name("costed.jsonl")
    copy.write_text(
        "".join(json.dumps(dict(r, reference_cost=cost, split="train")) + "\n" for r in records)
    )
    env = FeatureDeletionEnv(copy, repo_root=Path(records[0]["workdir"]).parent)
    with pytest.raises(
        ValueError, match=r"the turn budget \(sampling.max_new_tokens\) is 64; raise it"
    ):
        env.rollouts(
            None,
            tokenizer,
            [TASK_ID],
            group_size=1,
            sampling=SamplingSettings(max_new_tokens=64),
            sample_fn=lambda p, s: [],
        )
    # another tool format or tokenizer was not measured: no refusal
    other = dataclasses.replace(env.tasks[TASK_ID], reference_cost=dict(cost, tokenizer="other"))
    env.tasks[TASK_ID] = other
    env.check_budgets([TASK_ID], 64, env.format_for(tokenizer), tokenizer)


@pytest.mark.integration
def test_many_reference_episodes_run_at_once_each_with_its_own_script(tokenizer, shared_dir):
    repo = shared_dir / "fd_repo"
    shutil.copytree(FD_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    report = generate_tasks(
        repo,
        shared_dir / "out" / "tasks.jsonl",
        max_tasks=3,
        sandbox_factory=lambda path: LocalSubprocessSandbox(path, exec_timeout_s=60),
        split=None,
        only=["median", "mean", "shout"],
        environment="system",
    )
    env = FeatureDeletionEnv(report.output)
    ids = list(reversed(env.task_ids()))  # any order: each episode plays its own task's script
    solved = env.solve_many_with_reference(tokenizer, ids)
    assert [r.task_id for r in solved] == ids
    assert [r.reward for r in solved] == [1.0, 1.0, 1.0]
    for rollout in solved:
        replace = rollout.metadata["conversation"][4]["content"]
        assert env.tasks[rollout.task_id].qualname.rsplit(".", 1)[-1] in replace


def test_whole_function_edits_rewrite_the_definition_holding_the_change():
    before = (
        "import os\n\n\nclass Box:\n    @property\n    def size(self):\n"
        '        """How big."""\n        raise NotImplementedError("size")\n\n'
        "    def other(self):\n        return 2\n"
    )
    after = before.replace('        raise NotImplementedError("size")\n', "        return 1\n")
    (edit,) = edits_between("box.py", before, after, whole_functions=True)
    assert edit.old == (
        '    @property\n    def size(self):\n        """How big."""\n'
        '        raise NotImplementedError("size")\n'
    )
    assert (
        edit.new == '    @property\n    def size(self):\n        """How big."""\n        return 1\n'
    )
    assert apply(before, [edit]) == after
    assert edit.function == "Box.size"  # the edit is that one definition, whole
    # a change outside any function, or source that does not parse, stays a line edit
    (top,) = edits_between("m.py", "x = 1\ny = 2\n", "x = 1\ny = 3\n", whole_functions=True)
    assert (top.old, top.new, top.function) == ("y = 2\n", "y = 3\n", None)
    (broken,) = edits_between("m.py", "def (:\nx = 1\n", "def (:\nx = 2\n", whole_functions=True)
    assert (broken.old, broken.new) == ("x = 1\n", "x = 2\n")
    # the definition written once: replace_function where the edit is one whole definition,
    # with its short docstring; a long unchanged one is left out (the tool keeps it)
    calls = reference_calls([edit, top], ["tests/test_box.py::test_size"], read=False,
                            rewrite_functions=True)  # fmt: skip
    assert calls == [
        ("replace_function", {"path": "box.py", "name": "Box.size", "code": edit.new[:-1]}),
        ("replace", {"path": "m.py", "old": "y = 2", "new": "y = 3"}),
        ("run_tests", {"tests": ["tests/test_box.py"]}),
        ("finish", {}),
    ]
    documented = before.replace(
        '"""How big."""', '"""How big.\n\n        >>> Box().size\n        1\n        """'
    )
    (long_doc,) = edits_between(
        "box.py", documented, documented.replace('raise NotImplementedError("size")', "return 1"),
        whole_functions=True,
    )  # fmt: skip
    (call, *_) = reference_calls([long_doc], [], read=False, rewrite_functions=True)
    # a name defined twice (one definition per branch) cannot say which: a line edit
    twice = "if X:\n    def f():\n        return 1\nelse:\n    def f():\n        return 2\n"
    (branch,) = edits_between("m.py", twice, twice.replace("return 2", "return 3"),
                              whole_functions=True)  # fmt: skip
    assert branch.function is None and branch.old.startswith("    def f():\n        return 2")
    (first_call, *_) = reference_calls([branch], [], read=False, rewrite_functions=True)
    assert first_call[0] == "replace"
    assert call[1]["code"] == "    @property\n    def size(self):\n        return 1"


def test_a_near_miss_is_one_small_mistake_on_the_first_code_line_that_has_one():
    assert near_miss('    return text.strip() == ""') == '    return text.strip() != ""'
    assert near_miss("    if not items:\n        return default\n    return items[0]") == (
        "    if items:\n        return default\n    return items[0]"
    )
    assert near_miss("    # keep\n    return n + 1") == "    # keep\n    return n - 1"
    assert near_miss("    return sum(values) / len(values)") == "    return None"
    assert near_miss("        return None") == "        pass"


def test_a_recovery_episode_misses_runs_the_tests_fixes_and_finishes():
    before = "def f(n):\n    raise NotImplementedError('f was removed')\n\n\ndef g():\n    pass\n"
    (edit,) = edits_between("m.py", before, before.replace(
        "    raise NotImplementedError('f was removed')", "    if n > 0:\n        return 1\n    return 0"
    ))  # fmt: skip
    calls = reference_calls([edit], ["tests/test_m.py::test_f"], read=False)
    episode, shown = with_recovery(calls, {"m.py": before}.__getitem__, max_turns=8)
    assert [name for name, _ in episode] == [
        "replace", "run_tests", "replace", "run_tests", "finish"
    ]  # fmt: skip
    assert shown == 0 and episode[0][1]["new"] == "    if n >= 0:\n        return 1\n    return 0"
    # the fix replaces the near miss's line by the right one, and applied in turn they give
    # the reference's file
    text = before.replace(episode[0][1]["old"], episode[0][1]["new"], 1)
    text = text.replace(episode[2][1]["old"], episode[2][1]["new"], 1)
    assert episode[2][1]["old"] == "    if n >= 0:" and text == before.replace(edit.old, edit.new)
    # no room for a second test run: fix, then finish
    short, _ = with_recovery(calls, {"m.py": before}.__getitem__, max_turns=4)
    assert [name for name, _ in short] == ["replace", "run_tests", "replace", "finish"]
    assert with_recovery(calls, {"m.py": before}.__getitem__, max_turns=3) is None
    two = reference_calls([edit, edit], [], read=False)
    assert with_recovery(two, {"m.py": before}.__getitem__, max_turns=8) is None


def test_only_the_named_text_of_a_reply_is_left_out_of_training():
    # one character a token: the mask shows exactly which characters are trained
    reply0, observation, reply1 = "call <new>\nbad\n</new>", "tool says", "call <new>\nbad\n</new>"
    tokens = [ord(c) for c in reply0 + observation + reply1]
    mask = [1] * len(reply0) + [0] * len(observation) + [1] * len(reply1)
    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    assert reply_span(mask, 0) == (0, len(reply0))
    assert reply_span(mask, 1) == (len(reply0) + len(observation), len(tokens))
    assert reply_span(mask, 2) is None
    out = without_text(mask, tokens, 1, "bad", decode)
    kept = decode([t for t, m in zip(tokens, out) if m])
    assert kept == reply0 + "call <new>\n\n</new>"
    # tokens of several characters: a token that writes any of the text is left out
    pairs = [tokens[k : k + 2] for k in range(0, len(tokens), 2)]
    ids = list(range(len(pairs)))
    pair_decode = lambda seq: "".join(decode(pairs[i]) for i in seq)  # noqa: E731
    pair_mask = [int(all(mask[2 * i : 2 * i + 2])) for i in ids]
    out = without_text(pair_mask, ids, 0, "bad", pair_decode)
    left_out = pair_decode([i for i, m, o in zip(ids, pair_mask, out) if m and not o])
    assert "bad" in left_out and len(left_out) <= len("bad") + 2
    # text the reply does not hold as written: the whole reply is left out
    assert without_text(mask, tokens, 0, "missing", decode) == without_reply(mask, 0)
    assert without_text(mask, tokens, 3, "bad", decode) == mask


def test_a_reply_left_out_of_training_is_the_one_named():
    mask = [0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert without_reply(mask, 0) == [0, 0, 0, 0, 0, 1, 0, 1, 1, 1]
    assert without_reply(mask, 2) == [0, 1, 1, 0, 0, 1, 0, 0, 0, 0]
    assert without_reply(mask, 5) == mask
    shares = [stable_share(f"task-{k}") for k in range(400)]
    assert all(0 <= s < 1 for s in shares) and shares == [
        stable_share(f"task-{k}") for k in range(400)
    ]
    assert 0.4 < sum(s < 0.5 for s in shares) / len(shares) < 0.6  # a share of them, roughly


@pytest.mark.integration
def test_recovery_demonstrations_show_the_near_miss_and_train_the_fix(generated, tokenizer):
    with pytest.raises(ValueError, match=r"reference_recovery = 1\.5"):
        FeatureDeletionEnv(generated, reference_recovery=1.5)
    env = FeatureDeletionEnv(generated, reference_recovery=1.0)
    ((demo,),) = env.demonstrations(tokenizer, [TASK_ID])
    assert demo.metadata["recovery"] and demo.reward == 1.0
    names = [e["name"] for e in demo.metadata["events"] if e["type"] == "tool_call"]
    assert names == ["read_file", "replace", "run_tests", "replace", "run_tests", "finish"]
    first_run, second_run = (
        e["info"] for e in demo.metadata["events"] if e.get("name") == "run_tests"
    )
    assert first_run["target_passed"] < first_run["n_targets"] == second_run["target_passed"]
    trained = tokenizer.decode([t for t, m in zip(demo.completion_ids, demo.completion_mask) if m])
    everything = tokenizer.decode(demo.completion_ids)
    # the near miss is written twice (its replace, then the fix's old) and trained once:
    # the fix copies it; of the miss itself only the call and its old text are imitated
    # (they are right), its wrong code is shown only
    assert everything.count("<new>\n    if values:") == 1 and "<new>\n    if values:" not in trained
    assert "<old>\n    if values:" in trained
    assert "    if not values:" in trained  # the fix is imitated
    assert trained.count('"name": "replace"') == 2
    assert trained.count("<old>\n    raise NotImplementedError") == 1
    plain = FeatureDeletionEnv(generated).demonstrations(tokenizer, [TASK_ID])[0][0]
    assert "recovery" not in plain.metadata


def test_the_evaluation_digest_reads_the_task_workdirs(generated):
    """What a kept start evaluation is keyed by: a task's workdir files and its grader."""
    env = FeatureDeletionEnv(generated)
    before = env.evaluation_digest([TASK_ID])
    assert before is not None and before == FeatureDeletionEnv(generated).evaluation_digest(
        [TASK_ID]
    )
    edited = env.workdirs[TASK_ID] / env.tasks[TASK_ID].file
    text = edited.read_text()
    try:
        edited.write_text(text + "\n# edited\n")
        assert env.evaluation_digest([TASK_ID]) != before
    finally:
        edited.write_text(text)
    assert env.evaluation_digest([TASK_ID]) == before
    closure = FeatureDeletionEnv(generated, sandbox_factory=lambda path: None)
    assert closure.evaluation_digest([TASK_ID]) is None
