"""SDPO at the turn where an agent's call failed: which turns are sites, the teacher context
built up to that turn with the hint in its last observation, and the jsd-only samples that
carry exactly that turn's tokens."""

from __future__ import annotations

from composer_replication.algo import build_algorithm
from composer_replication.algo.context import TurnSite, turn_sites, turn_teacher_context
from composer_replication.config.algorithm import AlgorithmConfig
from composer_replication.rollout.agent import Episode, ScriptedSampler, run_agent_rollouts
from composer_replication.rollout.tool_calls import ToolError, ToolResult, format_tool_call
from composer_replication.samples.generation import SamplingSettings

PROMPT = [
    {"role": "system", "content": "You fix code with tools."},
    {"role": "user", "content": "Make the tests pass."},
]


def replace(state, arguments):
    if arguments.get("old") != "x = 1":
        raise ToolError("old does not occur in a.py", "no_match")
    state["edited"] = True
    return "replaced in a.py"


def run_tests(state, arguments):
    if state.get("fixed"):
        return ToolResult("1 passed, 0 failed, 0 errors", {"failed": 0, "errors": 0})
    return ToolResult("0 passed, 1 failed, 0 errors\nE   assert 1 == 2", {"failed": 1, "errors": 0})


TOOLS = {"replace": replace, "run_tests": run_tests, "finish": lambda s, a: "bye"}


def episode(tokenizer, script, state):
    (rollout,) = run_agent_rollouts(
        None,
        tokenizer,
        [Episode("task", list(PROMPT), state)],
        sampling=SamplingSettings(max_new_tokens=96),
        max_turns=8,
        tools=TOOLS,
        sample_fn=ScriptedSampler(tokenizer, [script]),
    )
    return rollout


def failing_episode(tokenizer):
    script = [
        '<tool_call>{"name": "replace", "arguments": </tool_call>',  # malformed
        format_tool_call("replace", {"path": "a.py", "old": "x = 0", "new": "x = 2"}),  # no match
        format_tool_call("replace", {"path": "a.py", "old": "x = 1", "new": "x = 2"}),  # edits
        format_tool_call("run_tests"),  # fails: blames the edit before it
        format_tool_call("finish"),
    ]
    rollout = episode(tokenizer, script, {})
    rollout.reward = 0.0
    return rollout


def test_sites_are_the_failing_call_turns_and_the_edit_before_a_failing_run(tokenizer):
    rollout = failing_episode(tokenizer)
    sites = turn_sites(rollout)
    assert [s.step for s in sites] == [0, 1, 2]
    assert sites[0].error.startswith("Error: the tool call is not valid JSON")
    assert sites[1].error == "Error: old does not occur in a.py"
    assert sites[2] == TurnSite(2, "0 passed, 1 failed, 0 errors\nE   assert 1 == 2")


def test_the_teacher_sees_the_hint_before_the_same_turn_tokens(tokenizer):
    rollout = failing_episode(tokenizer)
    ids, index, length = turn_teacher_context(
        tokenizer, rollout, 1, "{content}\n\nHint: {hint}", hint="check the old text"
    )
    steps = rollout.trajectory
    turn = [t for t, m in zip(steps[1].completion_ids, steps[1].completion_mask) if m]
    assert ids[-len(turn) :] == turn  # the same sampled ids, never re-tokenised
    positions = [p for p, i in enumerate(index) if i >= 0]
    assert length == len(rollout.prompt_ids) + steps[1].start + len(turn)
    assert positions == list(range(length - len(turn), length))
    assert [rollout.input_ids[p] for p in positions] == [ids[index[p]] for p in positions]
    context = tokenizer.decode(ids[: -len(turn)])
    # the conversation up to turn 2: turn 1's malformed reply and its error, then the hint
    assert context.count("<|im_start|>assistant") == 2
    assert context.rstrip().endswith("Hint: check the old text<|im_end|>\n<|im_start|>assistant")
    assert "not valid JSON" in context and "x = 0" not in context


def test_sdpo_trains_each_failing_turn_in_a_jsd_only_sample(tokenizer):
    solved = episode(
        tokenizer,
        [
            format_tool_call("replace", {"path": "a.py", "old": "x = 1", "new": "x = 2"}),
            format_tool_call("finish"),
        ],
        {"fixed": True},
    )
    solved.reward = 1.0
    failed = failing_episode(tokenizer)
    config = AlgorithmConfig.model_validate({"advantage": {"type": "sdpo", "alpha_sdpo": 0.5}})
    algorithm = build_algorithm(config, tokenizer=tokenizer)
    samples = algorithm.process_group([failed, solved])
    main, _, *turns = samples
    assert main.advantages is not None  # rl on the whole episode
    # the solved sibling is a demonstration for the whole failed episode, besides its turns
    assert main.metadata["jsd_note"] == "demo"
    assert [s.metadata["jsd_turn"] for s in turns] == [1, 2, 3]
    for sample, step in zip(turns, failed.trajectory[:3]):
        sampled = sum(step.completion_mask)
        assert sample.advantages is None  # no rl on a site sample
        assert sum(sample.loss_mask) == sampled
        assert [w for w in sample.jsd_weights if w] == [0.5] * sampled
        assert sample.input_ids == failed.input_ids[: len(sample.input_ids)]
        sample.check_alignment()
    assert all(s.metadata["jsd_note"] == "turn_hint" for s in turns)


def test_a_failed_episode_without_failing_turns_distils_its_last_edit(tokenizer):
    quiet = episode(
        tokenizer,
        [
            format_tool_call("replace", {"path": "a.py", "old": "x = 1", "new": "x = 3"}),
            format_tool_call("finish"),
        ],
        {},
    )
    quiet.reward, quiet.feedback = 0.0, "FAILED tests/test_a.py::test_x - assert 3 == 2"
    solved = episode(tokenizer, [format_tool_call("finish")], {"fixed": True})
    solved.reward = 1.0
    config = AlgorithmConfig.model_validate({"advantage": {"type": "composer", "beta_replay": 0}})
    samples = build_algorithm(config, tokenizer=tokenizer).process_group([quiet, solved])
    (site,) = samples[2:]
    assert site.metadata["jsd_turn"] == 1  # the replace turn
    assert "assert 3 == 2" in tokenizer.decode(site.teacher_input_ids)
