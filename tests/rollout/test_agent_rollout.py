"""Multi-turn agent rollouts: token bookkeeping, per-token attribution, failures as data.

The policy is the real tiny model (random weights: it never writes a tool call) or a
`ScriptedSampler` that feeds fixed replies through the same loop; tools are small real
functions.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from composer_replication.hint_generator import classify_error
from composer_replication.inference.decoding.generate import SamplingSettings, generate
from composer_replication.model.loading import load_tokenizer
from composer_replication.rollout.agent import (
    ChatRenderer,
    Episode,
    ScriptedSampler,
    policy_sampler,
    run_agent_rollouts,
)
from composer_replication.rollout.tool_calls import ToolError, format_tool_call

PROMPT = [
    {"role": "system", "content": "You use tools."},
    {"role": "user", "content": "Echo something."},
]
SAMPLING = SamplingSettings(max_new_tokens=64)
POLICY_SAMPLING = SamplingSettings(max_new_tokens=16)  # fits the scripted replies
# A template that knows no tool role, and one that rewrites earlier assistant turns
# (drops reasoning), as some reasoning models' templates do.
NO_TOOL_ROLE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DROPS_REASONING = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


CONCATENATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def echo(state, arguments):
    state.append(dict(arguments))
    return "echo: " + json.dumps(arguments, sort_keys=True)


def fail(state, arguments):
    raise ToolError("no such file: x.py", "path_error")


def boom(state, arguments):
    raise RuntimeError("sandbox vanished")


def finish(state, arguments):
    return "done"


TOOLS = {"echo": echo, "fail": fail, "boom": boom, "finish": finish}


def call(name, **arguments):
    return format_tool_call(name, arguments)


def episodes(n):
    return [Episode(f"t{i}", list(PROMPT), []) for i in range(n)]


def ids_of(encoded):
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def segments(rollout):
    """(mask, role, ids, logprobs) runs of equal mask and role."""
    runs = []
    for tok_id, m, role, lp in zip(
        rollout.completion_ids,
        rollout.completion_mask,
        rollout.token_roles,
        rollout.inference_logprobs,
    ):
        if runs and runs[-1][:2] == (m, role):
            runs[-1][2].append(tok_id)
            runs[-1][3].append(lp)
        else:
            runs.append((m, role, [tok_id], [lp]))
    return runs


def assert_aligned(rollout):
    n = len(rollout.completion_ids)
    assert n == len(rollout.inference_logprobs) == len(rollout.completion_mask)
    assert n == len(rollout.token_roles)
    for m, role, lp in zip(
        rollout.completion_mask, rollout.token_roles, rollout.inference_logprobs
    ):
        if m == 0:  # environment-written: never sampled, never credited
            assert lp == 0.0 and role in ("tool", "user", "assistant")
        else:
            assert m == 1 and role == "assistant"


def test_tiny_policy_rollouts_are_aligned_answers(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    rollouts = run_agent_rollouts(
        model, tok, episodes(3), sampling=SamplingSettings(max_new_tokens=12), max_turns=3,
        tools=TOOLS,
    )  # fmt: skip
    prompt = ids_of(tok.apply_chat_template(PROMPT, add_generation_prompt=True))
    assert [r.task_id for r in rollouts] == ["t0", "t1", "t2"]
    for r in rollouts:
        assert_aligned(r)
        n = len(r.completion_ids)
        assert 1 <= n <= 12 and r.prompt_ids == prompt and r.prompt_messages == PROMPT
        assert r.completion_mask == [1] * n and all(lp < 0 for lp in r.inference_logprobs)
        (reason,) = r.metadata["finish_reasons"]
        assert r.metadata["turns"] == 1
        if reason == "length":  # cut off by the budget: truncated, never an answer
            assert r.metadata["end_reason"] == "truncated"
            assert r.metadata["events"] == [
                {"turn": 1, "type": "truncated", "kind": "no_call", "tokens": n}
            ]
        else:
            assert r.metadata["end_reason"] == "answer"
            assert r.metadata["events"] == [{"turn": 1, "type": "answer", "finish_reason": reason}]
        assert (r.reward, r.error, r.feedback) == (0.0, None, None)


def test_malformed_calls_become_observations_and_the_policy_continues(tiny):
    model, tok = tiny
    malformed = '<tool_call>{"name": "echo"</tool_call>'
    sampler = ScriptedSampler(
        tok, [[malformed, '<tool_call>{"name": "sh"}</tool_call>']], then=policy_sampler(model, tok)
    )
    torch.manual_seed(0)
    rollouts = run_agent_rollouts(
        None, tok, episodes(2), sampling=POLICY_SAMPLING, max_turns=3, tools=TOOLS,
        sample_fn=sampler,
    )  # fmt: skip
    assert sampler.calls == [2, 2, 2]  # every turn is one batch across episodes
    unknown = "Error: unknown tool 'sh'; available tools: boom, echo, fail, finish"
    for r in rollouts:
        assert_aligned(r)
        events = r.metadata["events"]
        # the policy's own last reply ends the episode: an answer, or cut off by the budget
        last = "truncated" if r.metadata["finish_reasons"][-1] == "length" else "answer"
        assert [(e["turn"], e["type"]) for e in events] == [
            (1, "parse_error"),
            (2, "parse_error"),
            (3, last),
        ]
        assert [e.get("kind") for e in events[:2]] == ["json_decode", "unknown_tool"]
        assert r.metadata["turns"] == 3 and r.error is None
        assert r.feedback == unknown and classify_error(r.feedback) == "tool_not_found"
        runs = segments(r)
        # end of turn and the next turn's header are the template's (assistant, mask 0);
        # the observation message is the tool's
        assert [(m, role) for m, role, _, _ in runs] == [
            (1, "assistant"), (0, "assistant"), (0, "tool"), (0, "assistant"),
            (1, "assistant"), (0, "assistant"), (0, "tool"), (0, "assistant"),
            (1, "assistant"),
        ]  # fmt: skip
        assert tok.decode(runs[0][2]) == malformed
        assert tok.decode(runs[1][2]) == "<|im_end|>\n"
        assert tok.decode(runs[2][2]) == (f"<|im_start|>tool\n{events[0]['message']}<|im_end|>\n")
        assert tok.decode(runs[3][2]) == "<|im_start|>assistant\n"
        assert tok.decode(runs[5][2] + runs[6][2] + runs[7][2]) == (
            f"<|im_end|>\n<|im_start|>tool\n{unknown}<|im_end|>\n<|im_start|>assistant\n"
        )
        # the policy's turn was sampled on exactly this token stream: its log-probs match
        # a forward pass over prompt + completion
        n_policy = len(runs[-1][2])
        ids = torch.tensor([r.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -n_policy - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, -n_policy:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(runs[-1][3]), expected, atol=1e-4, rtol=1e-4)


def test_turn_limit_and_streams_equal_the_chat_template_rendering(tokenizer):
    tok = tokenizer
    state: list = []
    sampler = ScriptedSampler(tok, [[call("echo", i=i) for i in range(5)]], logprob=-0.5)
    (r,) = run_agent_rollouts(
        None, tok, [Episode("t", list(PROMPT), state)], sampling=SAMPLING, max_turns=3,
        tools=TOOLS, sample_fn=sampler,
    )  # fmt: skip
    assert state == [{"i": 0}, {"i": 1}, {"i": 2}]  # the last turn's call still ran
    meta = r.metadata
    assert (meta["turns"], meta["tool_calls"], meta["end_reason"]) == (3, 3, "turn_limit")
    assert meta["finish_reasons"] == ["stop"] * 3
    conversation = meta["conversation"]
    assert [m["role"] for m in conversation] == [
        "system", "user", "assistant", "tool", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert conversation[3]["content"] == 'echo: {"i": 0}'
    # never re-tokenised, yet identical to rendering the whole conversation at once
    rendered = ids_of(tok.apply_chat_template(conversation[:-1], add_generation_prompt=True))
    last = ids_of(tok(conversation[-1]["content"], add_special_tokens=False))
    assert r.input_ids == rendered + last
    assert_aligned(r)
    assert all((lp == -0.5) == bool(m) for lp, m in zip(r.inference_logprobs, r.completion_mask))


def test_finish_and_plain_answers_end_their_episodes(tokenizer):
    tok = tokenizer
    sampler = ScriptedSampler(tok, [[call("echo", a=1), call("finish")], ["All done."]])
    first, second = run_agent_rollouts(
        None, tok, episodes(2), sampling=SAMPLING, max_turns=5, tools=TOOLS, sample_fn=sampler
    )
    assert sampler.calls == [2, 1]
    assert first.metadata["end_reason"] == "finish" and first.metadata["turns"] == 2
    assert first.metadata["events"][-1] == {"turn": 2, "type": "finish", "output": "done"}
    assert first.metadata["tool_calls"] == 2
    assert second.metadata["end_reason"] == "answer" and second.metadata["turns"] == 1
    assert second.completion_ids[-1] == tok.eos_token_id
    assert second.completion_mask == [1] * len(second.completion_ids)
    assert tok.decode(second.completion_ids, skip_special_tokens=True) == "All done."


def test_tool_errors_are_observations_and_a_broken_tool_ends_only_its_episode(tokenizer):
    tok = tokenizer
    sampler = ScriptedSampler(
        tok,
        [
            [call("fail"), call("echo", ok=True)],
            [call("boom"), call("echo", never=True)],
            [call("echo", fine=1)],
        ],
    )
    eps = episodes(3)
    a, b, c = run_agent_rollouts(
        None, tok, eps, sampling=SAMPLING, max_turns=2, tools=TOOLS, sample_fn=sampler
    )
    assert a.metadata["events"][0] == {
        "turn": 1, "type": "tool_error", "kind": "path_error",
        "message": "Error: no such file: x.py", "name": "fail", "arguments": {},
    }  # fmt: skip
    assert (a.error, a.feedback, a.metadata["turns"]) == (None, "Error: no such file: x.py", 2)
    assert eps[0].state == [{"ok": True}]  # it recovered
    assert "<|im_start|>tool\nError: no such file: x.py<|im_end|>" in tok.decode(a.completion_ids)
    assert b.error == "sandbox_error: boom: RuntimeError: sandbox vanished"
    assert b.metadata["end_reason"] == "sandbox_error" and b.metadata["turns"] == 1
    assert eps[1].state == [] and b.completion_mask == [1] * len(b.completion_ids)
    assert c.error is None and eps[2].state == [{"fine": 1}]
    assert c.metadata["end_reason"] == "answer"  # its script ran out: an empty answer
    for r in (a, b, c):
        assert_aligned(r)


def test_token_cap_bounds_every_episode(tokenizer):
    tok = tokenizer
    prompt_len = len(ChatRenderer(tok).prompt_ids(PROMPT))
    cap = prompt_len + 40
    sampler = ScriptedSampler(tok, [[call("echo", text="a" * 10)] * 10])
    (r,) = run_agent_rollouts(
        None, tok, episodes(1), sampling=SAMPLING, max_turns=10, tools=TOOLS,
        max_total_tokens=cap, sample_fn=sampler,
    )  # fmt: skip
    assert r.metadata["end_reason"] == "token_limit"
    assert len(r.input_ids) <= cap and r.metadata["turns"] >= 1
    assert_aligned(r)
    (short,) = run_agent_rollouts(
        None, tok, episodes(1), sampling=SAMPLING, max_turns=2, tools=TOOLS,
        max_total_tokens=prompt_len, sample_fn=ScriptedSampler(tok, [["hi"]]),
    )  # fmt: skip
    assert short.completion_ids == [] and short.error.startswith("token_limit")


def test_template_without_a_tool_role_gets_user_observations(tokenizer):
    tok = tokenizer
    assert ChatRenderer(tok).tool_role == "tool"
    assert ChatRenderer(tok).turn_close_ids == ids_of(tok("<|im_end|>\n", add_special_tokens=False))
    plain = load_tokenizer()
    plain.chat_template = NO_TOOL_ROLE
    assert ChatRenderer(plain).tool_role == "user"
    (r,) = run_agent_rollouts(
        None, plain, episodes(1), sampling=SAMPLING, max_turns=2, tools=TOOLS,
        sample_fn=ScriptedSampler(plain, [[call("echo", x=1)]]),
    )  # fmt: skip
    # the observation is a user message here: its tokens carry the role "user"
    assert "tool" not in r.token_roles
    observation = [t for t, role in zip(r.completion_ids, r.token_roles) if role == "user"]
    assert plain.decode(observation) == '<|im_start|>user\n[tool result] echo: {"x": 1}<|im_end|>\n'

    assert r.metadata["conversation"][3] == {
        "role": "user",
        "content": '[tool result] echo: {"x": 1}',
    }
    assert not any(e["type"] == "render_fallback" for e in r.metadata["events"])


def test_history_rewriting_template_falls_back_without_retokenising():
    thinking = load_tokenizer()
    thinking.chat_template = DROPS_REASONING
    reply = "<think>check first</think>" + call("echo", x=1)
    (r,) = run_agent_rollouts(
        None, thinking, episodes(1), sampling=SAMPLING, max_turns=2, tools=TOOLS,
        sample_fn=ScriptedSampler(thinking, [[reply]]),
    )  # fmt: skip
    events = r.metadata["events"]
    assert {"turn": 1, "type": "render_fallback", "method": "stand_in"} in events
    runs = segments(r)
    assert thinking.decode(runs[0][2]) == reply  # the sampled reasoning stays in the stream
    assert [(m, role) for m, role, _, _ in runs[1:4]] == [
        (0, "assistant"),
        (0, "tool"),
        (0, "assistant"),
    ]
    assert thinking.decode(runs[1][2] + runs[2][2] + runs[3][2]) == (
        '<|im_end|>\n<|im_start|>tool\necho: {"x": 1}<|im_end|>\n<|im_start|>assistant\n'
    )


def test_a_row_cut_by_a_stop_string_keeps_no_padding(tiny):
    # generate() pads a row that stopped early while its batch ran on; the pad id is the
    # eos id here, so the loop must drop that token (it was never sampled).
    model, _ = tiny
    plain = load_tokenizer()
    plain.chat_template = CONCATENATE  # the prompt ends with the user's text
    greedy = SamplingSettings(max_new_tokens=6, temperature=0)
    a_msgs, b_msgs = [{"role": "user", "content": "abc"}], [{"role": "user", "content": "hello"}]
    renderer = ChatRenderer(plain)
    free_a, free_b = generate(
        model, plain, [renderer.prompt_ids(a_msgs), renderer.prompt_ids(b_msgs)], greedy
    )
    stop = plain.decode(free_a.completion_ids[:1])
    if not stop.strip() or stop in plain.decode(free_b.completion_ids):
        pytest.skip("the greedy completions give no stop string that cuts only the first row")
    a, b = run_agent_rollouts(
        model, plain, [Episode("a", a_msgs), Episode("b", b_msgs)],
        sampling=replace(greedy, stop_strings=(stop,)), max_turns=1, tools=TOOLS,
    )  # fmt: skip
    assert a.metadata["finish_reasons"] == ["stop"]
    assert a.completion_ids == free_a.completion_ids[:1]
    assert a.inference_logprobs == pytest.approx(free_a.logprobs[:1], abs=1e-5)
    assert b.completion_ids == free_b.completion_ids
    assert b.metadata["finish_reasons"] == ["length"]


def test_bad_arguments_are_rejected_early(tokenizer):
    tok = tokenizer
    with pytest.raises(ValueError, match="max_turns=0"):
        run_agent_rollouts(None, tok, [], sampling=SAMPLING, max_turns=0, tools=TOOLS)
    with pytest.raises(TypeError, match="not callable"):
        run_agent_rollouts(None, tok, [], sampling=SAMPLING, max_turns=1, tools={"x": 3})
    with pytest.raises(ValueError, match="needs a policy or a sample_fn"):
        run_agent_rollouts(None, tok, [], sampling=SAMPLING, max_turns=1, tools=TOOLS)
