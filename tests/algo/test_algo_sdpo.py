"""sdpo and composer: Dr.GRPO streams, teacher contexts at error sites, pair samples."""

from __future__ import annotations

import asyncio

import pytest
import torch

from composer_replication.algo import AlgorithmConfig, LocalPrefillScorer, build_algorithm
from composer_replication.algo.advantage import grpo_advantages
from composer_replication.hint_generator import dispatch
from composer_replication.loss import sequence_logps
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import pack_samples

TASK = "Write add(a, b)."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TASK}]
GOOD = "def add(a, b):\n    return a + b"
BAD = "def add(a, b):\n    return a - b"
CRASH = 'Traceback (most recent call last):\n  File "t.py", line 2, in f\nZeroDivisionError: division by zero'
PAIRS = [
    {"state_messages": MESSAGES, "chosen": GOOD, "rejected": BAD},
    {
        "state_messages": MESSAGES,
        "chosen_messages": [{"role": "assistant", "content": GOOD}],
        "rejected_messages": [{"role": "assistant", "content": "pass"}],
    },
]


def _prompt(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def _rollout(tokenizer, text, reward, feedback=None):
    completion = [*tokenizer(text, add_special_tokens=False)["input_ids"], 2]
    return Rollout(
        task_id="add",
        prompt_ids=_prompt(tokenizer, MESSAGES),
        completion_ids=completion,
        inference_logprobs=[-0.5] * len(completion),
        reward=reward,
        prompt_messages=MESSAGES,
        feedback=feedback,
    )


def _group(tokenizer):
    return [
        _rollout(tokenizer, GOOD, 1.0),  # best, clean: no jsd
        _rollout(tokenizer, BAD, 0.0),  # below the best: demo from rollout 0
        _rollout(tokenizer, GOOD, 1.0, feedback=CRASH),  # best but an error site: hint
    ]


def _hinted(tokenizer, note_content):
    messages = [MESSAGES[0], {"role": "user", "content": note_content}]
    return _prompt(tokenizer, messages)


def _check_teacher(sample, rollout, teacher_prompt, alpha):
    n_prompt, n_completion = len(rollout.prompt_ids), len(rollout.completion_ids)
    assert sample.teacher_input_ids == teacher_prompt + rollout.completion_ids
    assert sample.teacher_index == [-1] * n_prompt + [
        len(teacher_prompt) + j for j in range(n_completion)
    ]
    assert sample.jsd_weights == [0.0] * n_prompt + [alpha] * n_completion


def test_sdpo_assign(tokenizer):
    algo = build_algorithm(AlgorithmConfig(advantage={"type": "sdpo"}), tokenizer=tokenizer)
    group = _group(tokenizer)
    samples = algo.process_group(group)
    adv = grpo_advantages([1.0, 0.0, 1.0]).tolist()
    for sample, rollout, a in zip(samples, group, adv):
        n_prompt = len(rollout.prompt_ids)
        assert sample.advantages == [0.0] * n_prompt + [a] * len(rollout.completion_ids)
    assert samples[0].jsd_weights is None and samples[0].teacher_input_ids is None
    demo = f"{TASK}\n\nHere is a correct solution, for reference:\n{GOOD}"
    _check_teacher(samples[1], group[1], _hinted(tokenizer, demo), 1.0)
    hint = dispatch("runtime_error", {"error_message": CRASH})
    _check_teacher(samples[2], group[2], _hinted(tokenizer, f"{TASK}\n\nHint: {hint}"), 1.0)
    assert [s.metadata.get("jsd_note") for s in samples] == [None, "demo", "hint"]
    for s in samples:
        s.check_alignment()
    (batch,) = pack_samples(samples, max_tokens=4096, split=None)
    assert batch.teacher_input_ids.shape[0] == 3 and batch.jsd_weights.sum().item() == sum(
        len(r.completion_ids) for r in group[1:]
    )
    assert algo.advantage_config.teacher_mode == ("policy", 0.99)


@pytest.mark.parametrize(
    ("hint_source", "feedback", "expected"),
    [
        ("feedback", "tests are slow", "tests are slow"),
        ("generator", "tests are slow", "Your previous attempt failed with:\ntests are slow\n"
                                        "Find the cause and fix it."),
        ("generator", None, "A previous attempt at this task did not pass the tests. Re-read "
                            "the task, check the edge cases, and fix the cause."),
    ],
)  # fmt: skip
def test_sdpo_hints_without_demos(tokenizer, hint_source, feedback, expected):
    config = AlgorithmConfig(
        advantage={
            "type": "sdpo",
            "use_sibling_demos": False,
            "hint_source": hint_source,
            "alpha_sdpo": 0.5,
        }
    )
    algo = build_algorithm(config, tokenizer=tokenizer)
    group = [_rollout(tokenizer, GOOD, 1.0), _rollout(tokenizer, BAD, 0.0, feedback=feedback)]
    samples = algo.process_group(group)
    _check_teacher(samples[1], group[1], _hinted(tokenizer, f"{TASK}\n\nHint: {expected}"), 0.5)


@pytest.mark.parametrize("kind", ["sdpo", "composer"])
def test_reference_demonstrations_stand_in_for_a_missing_better_sibling(tokenizer, kind):
    """With ``use_reference_demos`` an error site without a better sibling gets the task's
    reference solution as its demonstration; a better sibling still comes first, and
    without the flag (or without a reference) the hint is used as before."""
    reference = "```python\ndef add(a, b):\n    return b + a\n```"

    def group():
        rollouts = [
            _rollout(tokenizer, BAD, 0.0, feedback="assert add(1, 2) == 3 failed"),
            _rollout(tokenizer, BAD, 0.0, feedback="assert add(0, 1) == 1 failed"),
        ]
        for r in rollouts:
            r.metadata["reference"] = reference
        return rollouts

    on = AlgorithmConfig(advantage={"type": kind, "use_reference_demos": True})
    samples = build_algorithm(on, tokenizer=tokenizer).process_group(group())
    demo = f"{TASK}\n\nHere is a correct solution, for reference:\n{reference}"
    alpha = 1.0 if kind == "sdpo" else 0.1
    for sample, rollout in zip(samples, group()):
        _check_teacher(sample, rollout, _hinted(tokenizer, demo), alpha)
        assert sample.metadata["jsd_note"] == "reference"
    # a better sibling is still the demonstration
    better = [*group(), _rollout(tokenizer, GOOD, 1.0)]
    notes = [
        s.metadata.get("jsd_note")
        for s in build_algorithm(on, tokenizer=tokenizer).process_group(better)
    ]
    assert notes[:3] == ["demo", "demo", None]  # (composer adds its pair sample after)
    # off (the default), or no reference on the rollout: a hint
    off = AlgorithmConfig(advantage={"type": kind})
    off_samples = build_algorithm(off, tokenizer=tokenizer).process_group(group())
    assert [s.metadata.get("jsd_note") for s in off_samples[:2]] == ["hint", "hint"]
    bare = [
        _rollout(tokenizer, BAD, 0.0, feedback="failed"),
        _rollout(tokenizer, BAD, 0.0, feedback="failed"),
    ]
    bare_samples = build_algorithm(on, tokenizer=tokenizer).process_group(bare)
    assert [s.metadata.get("jsd_note") for s in bare_samples[:2]] == ["hint", "hint"]


def test_python_functions_rollouts_carry_the_reference_as_an_answer():
    from composer_replication.envs.python_functions import (
        PythonFunctionsEnv,
        reference_demonstration,
    )
    from composer_replication.envs.task_bank import extract_code

    env = PythonFunctionsEnv()
    task = env.tasks["pf-001-sum-list"]
    demo = reference_demonstration(task)
    assert demo.startswith("```python\n") and demo.endswith("\n```")
    assert extract_code(demo, task.entry_point).strip() == task.reference.strip()
    # the prompt the policy sees never contains it
    assert task.reference.strip() not in str(env.messages(task))


def test_sdpo_no_signal_without_notes_or_error_sites(tokenizer):
    config = AlgorithmConfig(
        advantage={"type": "sdpo", "use_sibling_demos": False, "hint_source": "none"}
    )
    samples = build_algorithm(config, tokenizer=tokenizer).process_group(_group(tokenizer))
    assert all(s.jsd_weights is None for s in samples)
    uniform = [_rollout(tokenizer, GOOD, 1.0), _rollout(tokenizer, BAD, 1.0)]
    algo = build_algorithm(AlgorithmConfig(advantage={"type": "sdpo"}), tokenizer=tokenizer)
    assert all(s.jsd_weights is None for s in algo.process_group(uniform))


def test_composer_assign_and_score(tiny):
    model, tokenizer = tiny
    config = AlgorithmConfig(advantage={"type": "composer", "pairs_per_group": 1})
    algo = build_algorithm(
        config, tokenizer=tokenizer, pairs=PAIRS, reference_scorer=LocalPrefillScorer(model)
    )
    group = _group(tokenizer)
    samples = algo.process_group(group)
    assert len(samples) == 4
    *seq_samples, pair_sample = samples
    demo = f"{TASK}\n\nHere is a correct solution, for reference:\n{GOOD}"
    _check_teacher(seq_samples[1], group[1], _hinted(tokenizer, demo), 0.1)
    assert seq_samples[2].jsd_weights[-1] == 0.1
    assert pair_sample.input_ids == [] and pair_sample.dpo.weight == 0.05
    assert pair_sample.source == "composer"

    asyncio.run(algo.score(samples))
    pair = pair_sample.dpo
    for side in ("chosen", "rejected"):
        ids = torch.tensor([getattr(pair, f"{side}_ids")])
        mask = torch.tensor([getattr(pair, f"{side}_mask")])
        with torch.no_grad():
            expected = sequence_logps(model, ids, mask).item()
        assert getattr(pair, f"ref_{side}_logp") == pytest.approx(expected, abs=1e-4)
    for s in samples:
        s.check_alignment()
    batches = pack_samples(samples, max_tokens=4096, split=None)
    assert [p.weight for b in batches for p in b.pairs] == [0.05]
    # the next group draws the other pair of the pool
    assert algo.process_group(group)[-1].dpo is not pair


def test_composer_pairs_default_to_the_shipped_file_and_beta_replay_0_turns_them_off(tokenizer):
    from composer_replication.algo.replay_dpo import load_pair_records

    shipped = load_pair_records()
    assert len(shipped) >= 1
    algo = build_algorithm(AlgorithmConfig(advantage={"type": "composer"}), tokenizer=tokenizer)
    assert len(algo.pool.pairs) == len(shipped)
    assert algo.process_group(_group(tokenizer))[-1].dpo.weight == 0.05
    off = AlgorithmConfig(advantage={"type": "composer", "beta_replay": 0.0})
    algo = build_algorithm(off, tokenizer=tokenizer)
    samples = algo.process_group(_group(tokenizer))
    assert len(samples) == 3 and all(s.dpo is None for s in samples)
    asyncio.run(algo.score(samples))  # nothing to score: a no-op
