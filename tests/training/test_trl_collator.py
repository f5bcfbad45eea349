"""ComposerDataCollator: the key contract per case, exact token layout and truncation with a
character tokenizer, and the real tokenizer's batch consumed by compose_loss."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from composer_replication.backends.trl.data_collator import (
    CollatorConfig,
    ComposerDataCollator,
    TokenizerLike,
    TraceExample,
    TraceTurn,
)
from composer_replication.hint_generator import dispatch
from composer_replication.loss import compose_loss
from composer_replication.traces.ingestion.render import render_tool_call

BASE_KEYS = {"input_ids", "attention_mask", "response_mask", "labels", "rewards"}
SDPO_KEYS = {
    "ctx_teacher_input_ids",
    "ctx_teacher_attention_mask",
    "ctx_teacher_response_mask",
    "sdpo_loss_mask",
}
DPO_KEYS = {
    f"dpo_{side}_{part}"
    for side in ("chosen", "rejected")
    for part in ("input_ids", "attention_mask", "response_mask")
}
EOS = 2


class CharTokenizer:
    """One token per character (code point + 10); a chat turn is ``[1, *role, *content]``
    and the generation prompt is ``[1, 5]``."""

    eos_token_id = EOS

    def __call__(self, text, *, add_special_tokens=True):
        return {"input_ids": [ord(c) + 10 for c in text]}

    def apply_chat_template(self, conversation, *, tokenize, add_generation_prompt):
        ids = []
        for m in conversation:
            ids += [1, *self(m["role"])["input_ids"], *self(m["content"])["input_ids"]]
        return ids + ([1, 5] if add_generation_prompt else [])


def chars(text):
    return [ord(c) + 10 for c in text]


def example(response="ok", error=None, reward=1.0, pair=False, turns=None, **kw):
    return TraceExample(
        turns=tuple(turns or (TraceTurn("user", "hi"),)),
        response=response,
        rewards={"final_reward": reward},
        error=error,
        chosen="yes" if pair else None,
        rejected="no" if pair else None,
        **kw,
    )


def prompt_ids(content="hi"):
    return [1, *chars("user"), *chars(content), 1, 5]


def test_char_tokenizer_satisfies_the_protocol():
    assert isinstance(CharTokenizer(), TokenizerLike)


def test_base_keys_exact_layout():
    collate = ComposerDataCollator(CharTokenizer(), CollatorConfig(pad_token_id=0))
    batch = collate([example("ok", reward=1.0), example("abcd", reward=0.25)])
    assert set(batch) == BASE_KEYS
    p = prompt_ids()
    row0 = [*p, *chars("ok"), EOS]
    row1 = [*p, *chars("abcd"), EOS]
    assert batch["input_ids"].tolist() == [[*row0, 0, 0], row1]
    assert batch["attention_mask"].tolist() == [[1] * len(row0) + [0, 0], [1] * len(row1)]
    assert batch["response_mask"].tolist() == [
        [0] * len(p) + [1] * 3 + [0, 0],
        [0] * len(p) + [1] * 5,
    ]
    assert batch["labels"].tolist() == [
        [-100] * len(p) + [*chars("ok"), EOS, -100, -100],
        [-100] * len(p) + [*chars("abcd"), EOS],
    ]
    assert batch["rewards"].tolist() == [1.0, 0.25]
    assert batch["rewards"].dtype == torch.float32


def test_error_sites_give_sdpo_fields_only_with_a_hint_generator():
    examples = [
        example("ok", error="Traceback ...\nZeroDivisionError: division by zero"),
        example(),
    ]
    plain = ComposerDataCollator(CharTokenizer())(examples)
    assert set(plain) == BASE_KEYS
    calls = []

    def generator(kind, ctx):
        calls.append((kind, ctx["error_message"]))
        return "HINT"

    batch = ComposerDataCollator(CharTokenizer(), CollatorConfig(hint_generator=generator))(
        examples
    )
    assert set(batch) == BASE_KEYS | SDPO_KEYS
    assert calls == [("runtime_error", "Traceback ...\nZeroDivisionError: division by zero")]
    hinted = [1, *chars("user"), *chars("hi\n\nHint: HINT"), 1, 5, *chars("ok"), EOS]
    assert batch["ctx_teacher_input_ids"][0].tolist() == hinted
    assert batch["sdpo_loss_mask"].tolist() == [
        batch["response_mask"][0].tolist(),
        [0] * batch["response_mask"].shape[1],
    ]
    # every row's response ids are the same in both contexts (the JSD's alignment)
    for b in range(2):
        s = batch["input_ids"][b][batch["response_mask"][b] == 1]
        t = batch["ctx_teacher_input_ids"][b][batch["ctx_teacher_response_mask"][b] == 1]
        assert torch.equal(s, t)


def test_sdpo_off_or_no_error_site_gives_no_sdpo_fields():
    on = CollatorConfig(hint_generator=lambda kind, ctx: "HINT")
    assert set(ComposerDataCollator(CharTokenizer(), on)([example()])) == BASE_KEYS
    off = CollatorConfig(hint_generator=lambda kind, ctx: "HINT", enable_sdpo=False)
    assert set(ComposerDataCollator(CharTokenizer(), off)([example(error="boom")])) == BASE_KEYS


def test_an_error_on_the_last_observation_turn_is_an_error_site():
    turns = (
        TraceTurn("user", "fix it"),
        TraceTurn("assistant", "call"),
        TraceTurn("tool", "no", tool_name="grep", error="unknown tool 'grpe'"),
    )
    ex = example(turns=turns, available_tools=("grep", "ls"))
    site = ex.error_site()
    assert site["error_kind"] == "tool_not_found" and site["tool_name"] == "grep"
    batch = ComposerDataCollator(CharTokenizer(), CollatorConfig(hint_generator=dispatch))([ex])
    assert set(batch) == BASE_KEYS | SDPO_KEYS


def test_pairs_give_dpo_fields_one_row_per_example_with_a_pair():
    collate = ComposerDataCollator(CharTokenizer())
    batch = collate([example(pair=True), example(), example(pair=True)])
    assert set(batch) == BASE_KEYS | DPO_KEYS
    p = prompt_ids()
    assert batch["dpo_chosen_input_ids"].tolist() == [[*p, *chars("yes"), EOS]] * 2
    assert batch["dpo_rejected_input_ids"].tolist() == [[*p, *chars("no"), EOS]] * 2
    assert batch["dpo_rejected_response_mask"].tolist() == [[0] * len(p) + [1] * 3] * 2
    off = ComposerDataCollator(CharTokenizer(), CollatorConfig(enable_replay_dpo=False))
    assert set(off([example(pair=True)])) == BASE_KEYS


def test_truncation_keeps_the_prompt_tail_and_the_response_head():
    cfg = CollatorConfig(max_seq_len=12, max_dpo_seq_len=8, hint_generator=lambda k, c: "H")
    ex = example("r" * 20, error="boom", pair=True, turns=(TraceTurn("user", "x" * 30),))
    batch = ComposerDataCollator(CharTokenizer(), cfg)([ex])
    full_prompt = [1, *chars("user"), *chars("x" * 30), 1, 5]
    # response alone exceeds the cap: 11 response tokens and the prompt's last token
    assert batch["input_ids"].tolist() == [[full_prompt[-1], *chars("r" * 11)]]
    assert batch["response_mask"].tolist() == [[0] + [1] * 11]
    assert batch["ctx_teacher_input_ids"].shape == (1, 12)
    assert batch["dpo_chosen_input_ids"].tolist() == [[*full_prompt[-4:], *chars("yes"), EOS]]
    assert batch["dpo_rejected_input_ids"].tolist() == [[*full_prompt[-5:], *chars("no"), EOS]]
    short = ComposerDataCollator(CharTokenizer(), CollatorConfig(max_seq_len=9))
    row = short([example("ab")])["input_ids"][0].tolist()
    assert row == [*prompt_ids()[-6:], *chars("ab"), EOS]


def test_missing_reward_and_bad_records_raise():
    collate = ComposerDataCollator(CharTokenizer(), CollatorConfig(rlvr_reward_key="pass"))
    with pytest.raises(ValueError, match="has no reward 'pass'"):
        collate([example()])
    with pytest.raises(ValueError, match="both chosen and rejected"):
        TraceExample(turns=(TraceTurn("user", "hi"),), response="x", chosen="y")
    with pytest.raises(ValueError, match="no turns"):
        TraceExample(turns=(), response="x")
    with pytest.raises(ValueError, match="role 'robot'"):
        TraceTurn("robot", "beep")
    with pytest.raises(ValueError, match="max_seq_len=1 must be >= 2"):
        CollatorConfig(max_seq_len=1)
    with pytest.raises(ValueError, match="no examples"):
        ComposerDataCollator(CharTokenizer())([])


def test_real_tokenizer_batch_feeds_compose_loss():
    from composer_replication.model.loading import tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    cfg = CollatorConfig(pad_token_id=tokenizer.pad_token_id, hint_generator=dispatch)
    examples = [
        example("def f(x):\n    return 1 / x", error="E   ZeroDivisionError: division by zero"),
        example("def g():\n    return 2", pair=True),
    ]
    batch = ComposerDataCollator(tokenizer, cfg)(examples)
    assert set(batch) == BASE_KEYS | SDPO_KEYS | DPO_KEYS
    parts = compose_loss(model, batch, ref_model=copy.deepcopy(model))
    values = parts.detached()
    assert all(math.isfinite(v) for v in values.values())
    assert values["sdpo_jsd"] > 0
    assert values["trace_replay_dpo"] == pytest.approx(math.log(2), abs=1e-6)


TRACE = {
    "trace_id": "t-7",
    "turns": [
        {"role": "user", "content": "fix add"},
        {
            "role": "assistant",
            "content": "running tests",
            "tool_calls": [{"function": {"name": "bash", "arguments": '{"cmd": "pytest"}'}}],
        },
        {"role": "tool", "name": "bash", "content": "E   assert 1 == 2", "is_error": True},
        {"role": "assistant", "content": "def add(a, b): return a + b"},
    ],
    "final_reward": 0.5,
    "dpo_pairs": [
        {"chosen": "good one", "rejected": "bad one"},
        {"chosen": "good two", "rejected": "bad two"},
    ],
    "metadata": {"tools": ["bash"]},
}


def test_trace_dicts_become_examples_with_state_response_error_and_pairs():
    ex = TraceExample.from_dict(TRACE)
    assert ex.state_id == "t-7" and ex.response == "def add(a, b): return a + b"
    assert [t.role for t in ex.turns] == ["user", "assistant", "tool"]
    assert (
        ex.turns[1].content
        == 'running tests\n\n<tool_call>{"name": "bash", "arguments": {"cmd": "pytest"}}</tool_call>'
    )
    assert ex.turns[2].error == "E   assert 1 == 2" and ex.turns[2].tool_name == "bash"
    assert ex.rewards == {"final_reward": 0.5} and ex.available_tools == ("bash",)
    assert ex.pairs == [("good one", "bad one"), ("good two", "bad two")]
    site = ex.error_site()
    assert site["error_message"] == "E   assert 1 == 2" and site["tool_name"] == "bash"
    with pytest.raises(ValueError, match="trace 'empty' has no assistant turn"):
        TraceExample.from_dict({"trace_id": "empty", "turns": [{"role": "user", "content": "x"}]})


def test_collator_takes_trace_dicts_beside_examples():
    collator = ComposerDataCollator(
        CharTokenizer(), CollatorConfig(hint_generator=lambda kind, ctx: "look at the assert")
    )
    batch = collator([TRACE, example(response="yes", reward=1.0)])
    assert set(batch) == BASE_KEYS | SDPO_KEYS | DPO_KEYS
    assert batch["rewards"].tolist() == [0.5, 1.0]
    assert batch["dpo_chosen_input_ids"].shape[0] == 2  # one row per pair of the trace
    response = batch["input_ids"][0][batch["response_mask"][0] == 1].tolist()
    last = [*chars("def add(a, b): return a + b"), EOS]
    # both assistant turns are trained; the one after the failing tool is the error site
    assert response == [*chars(TraceExample.from_dict(TRACE).turns[1].text()), EOS, *last]
    assert batch["sdpo_loss_mask"][0].sum() == len(last)
    assert batch["sdpo_loss_mask"][1].sum() == 0


# --- the documented TypedDict shapes (seed-style traces) -------------------------------------

SEED_TURNS = [
    {"role": "user", "content": "fix add"},
    {"role": "assistant", "content": "", "tool_call": {"name": "Bash", "arguments": {"c": 1}}},
    {
        "role": "tool",
        "content": "1 failed",
        "tool_call": None,
        "tool_error": "E   assert add(1, 2) == 3",
        "error_meta": {"error_kind": "runtime_error", "tool_name": "Bash", "intent": "test"},
    },
    {"role": "assistant", "content": "def add(a, b): return a + b"},
]


def test_a_seed_trace_with_a_tool_error_produces_the_sdpo_channel():
    seen = []

    def my_dispatch(error_kind, error_meta):  # the documented (error_kind, error_meta) hook
        seen.append((error_kind, dict(error_meta)))
        return "run the failing test first"

    cfg = CollatorConfig(max_seq_len=2048, hint_generator=my_dispatch)
    collator = ComposerDataCollator(tokenizer=CharTokenizer(), config=cfg)
    batch = collator([{"trace_id": "x", "turns": SEED_TURNS, "final_reward": 1.0}])
    assert set(batch) == BASE_KEYS | SDPO_KEYS
    # the fix after the failing tool is the site; the tool call before it is trained too
    fix = [*chars("def add(a, b): return a + b"), EOS]
    assert batch["sdpo_loss_mask"].sum() == len(fix)
    assert seen == [
        (
            "runtime_error",
            {
                "error_kind": "runtime_error",
                "tool_name": "Bash",
                "intent": "test",
                "error_message": "E   assert add(1, 2) == 3",
            },
        )
    ]
    # the assistant's tool_call is rendered into the turn the policy is trained on
    trained = batch["input_ids"][0][batch["response_mask"][0] == 1].tolist()
    assert trained == [*chars(render_tool_call("Bash", {"c": 1})), EOS, *fix]
    # the same trace without tool errors gives no SDPO channel
    clean = [dict(t, tool_error=None, error_meta=None) for t in SEED_TURNS]
    assert set(collator([{"trace_id": "x", "turns": clean, "final_reward": 1.0}])) == BASE_KEYS


def test_trace_turn_and_trace_example_take_the_typeddict_keywords():
    turns = [
        TraceTurn(role="user", content="fix add"),
        TraceTurn(role="assistant", content="calling", tool_call={"name": "Bash", "arguments": {}}),
        TraceTurn(
            role="tool",
            content="boom",
            tool_call=None,
            tool_error="unknown tool 'Bsh'",
            error_meta={"available_tools": ["Bash", "Read"]},
        ),
        TraceTurn(role="assistant", content="ok"),
    ]
    assert turns[2].error == turns[2].tool_error == "unknown tool 'Bsh'"
    assert turns[1].message()["content"] == (
        'calling\n\n<tool_call>{"name": "Bash", "arguments": {}}</tool_call>'
    )
    ex = TraceExample(
        trace_id="t1",
        turns=turns,
        final_reward=0.5,
        dpo_pairs=[{"chosen": "good", "rejected": "bad"}],
    )
    assert (ex.state_id, ex.response, ex.rewards) == ("t1", "ok", {"final_reward": 0.5})
    assert [t.role for t in ex.turns] == ["user", "assistant", "tool"] and ex.pairs == [
        ("good", "bad")
    ]
    site = ex.error_site()
    assert site["error_kind"] == "tool_not_found" and site["available_tools"] == ["Bash", "Read"]
    batch = ComposerDataCollator(CharTokenizer(), CollatorConfig(hint_generator=dispatch))([ex])
    assert set(batch) == BASE_KEYS | SDPO_KEYS | DPO_KEYS
    # turn dicts of the same shape are the same example
    same = TraceExample(
        trace_id="t1",
        turns=[{k: v for k, v in vars(t).items() if v is not None} for t in turns],
        final_reward=0.5,
        dpo_pairs=[{"chosen": "good", "rejected": "bad"}],
    )
    assert same.messages() == ex.messages() and same.error_site() == site
    with pytest.raises(ValueError, match="they name the same failure"):
        TraceTurn(role="tool", content="", error="a", tool_error="b")


def test_an_error_reported_after_the_response_is_the_failure_it_led_to():
    turns = SEED_TURNS[:3]  # the response is the tool call; the tool turn reports its failure
    ex = TraceExample.from_dict({"trace_id": "y", "turns": turns, "final_reward": 0.0})
    assert ex.response == '<tool_call>{"name": "Bash", "arguments": {"c": 1}}</tool_call>'
    assert [t.role for t in ex.turns] == ["user"]
    assert ex.error == "E   assert add(1, 2) == 3" and ex.error_meta["intent"] == "test"
    assert ex.error_site()["tool_name"] == "Bash"
