"""ComposerDataCollator on multi-turn traces: every assistant turn trained, every turn after a
failing observation an SDPO site; the real tokenizer's rows equal its chat template's tokens,
the teacher's trained tokens are the student's, and compose_loss distils the sites."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from composer_replication.backends.trl.data_collator import (
    CollatorConfig,
    ComposerDataCollator,
    TraceExample,
)
from composer_replication.loss import compose_loss, sdpo_tokens
from composer_replication.opsd import generalized_jsd_loss
from composer_replication.traces.ingestion.render import render_tool_call

BASE_KEYS = {"input_ids", "attention_mask", "response_mask", "labels", "rewards"}
SDPO_KEYS = {
    "ctx_teacher_input_ids",
    "ctx_teacher_attention_mask",
    "ctx_teacher_response_mask",
    "sdpo_loss_mask",
}

READ_ERROR = "FileNotFoundError: add.py"
TEST_ERROR = "E   assert add(1, 2) == 3"
# the three assistant turns as the collator renders them (content, a blank line, the call)
ACTIONS = (
    "Reading the code.\n\n" + render_tool_call("Read", {"path": "add.py"}),
    render_tool_call("Bash", {"cmd": "pytest -q"}),
    "def add(a, b):\n    return a + b",
)


def trace(*, read_fails: bool = True, tests_fail: bool = True) -> dict:
    """Three assistant turns; the two tool results between them fail (or not)."""
    read = {"role": "tool", "name": "Read", "content": "no such file: add.py"}
    if read_fails:
        read["tool_error"] = READ_ERROR
    run = {"role": "tool", "name": "Bash", "content": TEST_ERROR, "is_error": tests_fail}
    return {
        "trace_id": "multi",
        "turns": [
            {"role": "user", "content": "Make test_add pass."},
            {
                "role": "assistant",
                "content": "Reading the code.",
                "tool_call": {"name": "Read", "arguments": {"path": "add.py"}},
            },
            read,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "Bash", "arguments": '{"cmd": "pytest -q"}'}}],
            },
            run,
            {"role": "assistant", "content": ACTIONS[2]},
        ],
        "final_reward": 1.0,
    }


def conversation(hints: tuple[str | None, str | None] = (None, None)) -> list[dict]:
    """The trace as chat messages, with a hint as a user message after a tool result."""
    out = [{"role": "user", "content": "Make test_add pass."}]
    for action, observation, hint in zip(
        ACTIONS, ("no such file: add.py", TEST_ERROR), hints, strict=False
    ):
        out += [{"role": "assistant", "content": action}, {"role": "tool", "content": observation}]
        if hint:
            out.append({"role": "user", "content": f"Hint: {hint}"})
    return [*out, {"role": "assistant", "content": ACTIONS[2]}]


def template_ids(tokenizer, messages, generation_prompt=False) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def runs(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, list[int]]]:
    """A row as maximal runs of equal mask values: [(mask value, ids), ...]."""
    out: list[tuple[int, list[int]]] = []
    for token, flag in zip(ids.tolist(), mask.tolist()):
        if out and out[-1][0] == flag:
            out[-1][1].append(token)
        else:
            out.append((flag, [token]))
    return out


def decoded(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, str]]:
    return [(flag, tokenizer.decode(run)) for flag, run in runs(ids, mask)]


def observation_text(content: str, hint: str | None = None) -> str:
    text = f"\n<|im_start|>tool\n{content}<|im_end|>\n"
    if hint:
        text += f"<|im_start|>user\nHint: {hint}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


class Hints:
    """A hint generator that records its calls and answers from a table (tool -> hint)."""

    def __init__(self, answers: dict[str, str | None]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, kind, ctx):
        self.calls.append((kind, dict(ctx)))
        return self.answers[ctx["tool_name"]]


def collator(tokenizer, hints=None, **kw) -> ComposerDataCollator:
    cfg = CollatorConfig(pad_token_id=tokenizer.pad_token_id, hint_generator=hints, **kw)
    return ComposerDataCollator(tokenizer, cfg)


def test_every_assistant_turn_is_trained_and_the_row_is_the_template_rendering(tokenizer):
    batch = collator(tokenizer)([trace()])
    assert set(batch) == BASE_KEYS
    row, mask = batch["input_ids"][0], batch["response_mask"][0]
    prompt = tokenizer.apply_chat_template(
        conversation()[:1], tokenize=False, add_generation_prompt=True
    )
    assert decoded(tokenizer, row, mask) == [
        (0, prompt),
        (1, ACTIONS[0] + "<|im_end|>"),
        (0, observation_text("no such file: add.py")),
        (1, ACTIONS[1] + "<|im_end|>"),
        (0, observation_text(TEST_ERROR)),
        (1, ACTIONS[2] + "<|im_end|>"),
    ]
    # the template's tokens of the whole conversation, up to the last turn's eos
    full = template_ids(tokenizer, conversation())
    assert row.tolist() == full[: len(row)]
    assert tokenizer.decode(full[len(row) :]) == "\n"
    # each trained turn is its text's tokens + eos, as a single response is
    trained = [
        t for a in ACTIONS for t in [*tokenizer(a, add_special_tokens=False)["input_ids"], 2]
    ]
    assert row[mask == 1].tolist() == trained
    assert batch["labels"][0].tolist() == torch.where(mask == 1, row, -100).tolist()
    # the example's response and state are unchanged: the last turn, and the turns before it
    ex = TraceExample.from_dict(trace())
    assert ex.response == ACTIONS[2] and ex.earlier_actions == (1, 3)
    assert [t.text() for t in ex.turns if t.role == "assistant"] == list(ACTIONS[:2])


def test_the_turns_after_the_two_failures_are_the_sdpo_sites(tokenizer):
    hints = Hints({"Read": "the file is src/add.py", "Bash": "read the assert"})
    batch = collator(tokenizer, hints)([trace()])
    assert set(batch) == BASE_KEYS | SDPO_KEYS
    assert hints.calls == [
        (
            "runtime_error",
            {"error_message": READ_ERROR, "error_kind": "runtime_error", "tool_name": "Read"},
        ),
        (
            "runtime_error",
            {"error_message": TEST_ERROR, "error_kind": "runtime_error", "tool_name": "Bash"},
        ),
    ]
    row, sites = batch["input_ids"][0], batch["sdpo_loss_mask"][0]
    assert [text for flag, text in decoded(tokenizer, row, sites) if flag] == [
        ACTIONS[1] + "<|im_end|>",
        ACTIONS[2] + "<|im_end|>",
    ]
    # the teacher: the template's tokens of the conversation with each hint after its failure
    teacher = batch["ctx_teacher_input_ids"][0]
    t_mask = batch["ctx_teacher_response_mask"][0]
    hinted = template_ids(tokenizer, conversation(("the file is src/add.py", "read the assert")))
    assert teacher.tolist() == hinted[: len(teacher)]
    assert tokenizer.decode(hinted[len(teacher) :]) == "\n"
    assert [flag for flag, _ in runs(teacher, t_mask)] == [0, 1, 0, 1, 0, 1]
    assert decoded(tokenizer, teacher, t_mask)[2] == (
        0,
        observation_text("no such file: add.py", "the file is src/add.py"),
    )
    # the same trained ids in the same order: token k of one context is token k of the other
    assert torch.equal(row[batch["response_mask"][0] == 1], teacher[t_mask == 1])
    tokens = sdpo_tokens(batch)
    assert tokens.student.tolist() == sites.nonzero().squeeze(-1).tolist()
    assert torch.equal(row[tokens.student], teacher[tokens.teacher])
    # each site's tokens sit after the hints before it in the teacher
    first, second = (
        len(tokenizer(f"<|im_start|>user\nHint: {h}<|im_end|>\n")["input_ids"])
        for h in ("the file is src/add.py", "read the assert")
    )
    shifts = (tokens.teacher - tokens.student).tolist()
    n2 = len(tokenizer(ACTIONS[1], add_special_tokens=False)["input_ids"]) + 1
    assert shifts == [first] * n2 + [first + second] * (len(shifts) - n2)


def test_a_failure_without_a_hint_is_not_a_site(tokenizer):
    hints = Hints({"Read": None, "Bash": "read the assert"})
    batch = collator(tokenizer, hints)([trace()])
    assert [ctx["tool_name"] for _, ctx in hints.calls] == ["Read", "Bash"]
    row, sites = batch["input_ids"][0], batch["sdpo_loss_mask"][0]
    assert [text for flag, text in decoded(tokenizer, row, sites) if flag] == [
        ACTIONS[2] + "<|im_end|>"
    ]
    teacher = batch["ctx_teacher_input_ids"][0]
    hinted = template_ids(tokenizer, conversation((None, "read the assert")))
    assert teacher.tolist() == hinted[: len(teacher)]
    t_mask = batch["ctx_teacher_response_mask"][0]
    assert torch.equal(row[batch["response_mask"][0] == 1], teacher[t_mask == 1])


def test_a_trace_without_failures_has_no_sdpo_fields(tokenizer):
    hints = Hints({})
    batch = collator(tokenizer, hints)([trace(read_fails=False, tests_fail=False)])
    assert set(batch) == BASE_KEYS and hints.calls == []
    # beside a trace with a site, its rows are the plain conversation with no site
    hints = Hints({"Read": "the file is src/add.py", "Bash": "read the assert"})
    clean, failing = trace(read_fails=False, tests_fail=False), trace()
    batch = collator(tokenizer, hints)([clean, failing])
    assert set(batch) == BASE_KEYS | SDPO_KEYS
    assert batch["sdpo_loss_mask"][0].sum() == 0 and batch["sdpo_loss_mask"][1].sum() > 0
    n = int(batch["attention_mask"][0].sum())
    assert int(batch["ctx_teacher_attention_mask"][0].sum()) == n
    assert batch["ctx_teacher_input_ids"][0, :n].tolist() == batch["input_ids"][0, :n].tolist()


def test_an_error_after_the_last_turn_makes_it_the_site_with_the_hint_before_it(tokenizer):
    turns = trace()["turns"][:5]  # the Bash call is the last turn; its failure comes after
    ex = TraceExample.from_dict({"trace_id": "t", "turns": turns, "final_reward": 0.0})
    assert ex.response == ACTIONS[1] and ex.error == TEST_ERROR
    hints = Hints({"Read": "unused", "Bash": "read the assert"})
    batch = collator(tokenizer, hints)([ex])
    # the response's site is the failure it led to (it also follows the Read failure)
    assert hints.calls == [
        (
            "runtime_error",
            {"error_message": TEST_ERROR, "error_kind": "runtime_error", "tool_name": "Bash"},
        )
    ]
    row, sites = batch["input_ids"][0], batch["sdpo_loss_mask"][0]
    assert [text for flag, text in decoded(tokenizer, row, sites) if flag] == [
        ACTIONS[1] + "<|im_end|>"
    ]
    # the hint is a user message right before the site (no user message since the last turn)
    hinted = [
        *conversation()[:3],
        {"role": "user", "content": "Hint: read the assert"},
        {"role": "assistant", "content": ACTIONS[1]},
    ]
    teacher = batch["ctx_teacher_input_ids"][0].tolist()
    assert teacher == template_ids(tokenizer, hinted)[: len(teacher)]


def test_multi_turn_off_trains_the_response_after_the_whole_state(tokenizer):
    hints = Hints({"Read": "the file is src/add.py", "Bash": "read the assert"})
    batch = collator(tokenizer, hints, multi_turn=False)([trace()])
    state = conversation()[:-1]
    last = [*tokenizer(ACTIONS[2], add_special_tokens=False)["input_ids"], 2]
    prompt = template_ids(tokenizer, state, generation_prompt=True)
    assert batch["input_ids"][0].tolist() == prompt + last
    assert batch["response_mask"][0].tolist() == [0] * len(prompt) + [1] * len(last)
    assert batch["sdpo_loss_mask"][0].tolist() == batch["response_mask"][0].tolist()
    # one site, the response; its hint in the state's last user message (the old rule)
    assert [ctx["tool_name"] for _, ctx in hints.calls] == ["Bash"]
    state[0] = {"role": "user", "content": "Make test_add pass.\n\nHint: read the assert"}
    hinted = template_ids(tokenizer, state, generation_prompt=True)
    assert batch["ctx_teacher_input_ids"][0].tolist() == hinted + last


# the SmolLM2 template, but an earlier assistant turn loses its reasoning (as Qwen3's does)
THINK = "<think>the file may be missing</think>"


def think_dropping(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tokenizer.chat_template.replace(
        "message['content']",
        "(message['content'].split('</think>')[-1] if message['role'] == 'assistant' "
        "and not loop.last else message['content'])",
    )
    return tok


def test_a_template_that_rewrites_history_gets_the_turns_between_from_a_stand_in(tokenizer):
    tok = think_dropping(tokenizer)
    turns = [*trace()["turns"][:3], {"role": "assistant", "content": ACTIONS[2]}]
    turns[1] = {"role": "assistant", "content": THINK + "Reading."}
    batch = collator(tok)([{"trace_id": "t", "turns": turns, "final_reward": 1.0}])
    prompt = tok.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True)
    # the trained turn keeps its reasoning; the tool turn is the template's own tokens for it
    assert decoded(tok, batch["input_ids"][0], batch["response_mask"][0]) == [
        (0, prompt),
        (1, THINK + "Reading.<|im_end|>"),
        (0, observation_text("no such file: add.py")),
        (1, ACTIONS[2] + "<|im_end|>"),
    ]
    whole = [{"role": t["role"], "content": t["content"]} for t in turns]
    assert THINK not in tok.decode(template_ids(tok, whole))  # what the template rewrote


def test_compose_loss_distils_exactly_the_sites(tiny):
    model, tokenizer = tiny
    model = copy.deepcopy(model).double()
    hints = Hints({"Read": "the file is src/add.py", "Bash": "read the assert"})
    clean = trace(read_fails=False, tests_fail=False)
    batch = collator(tokenizer, hints)([trace(), clean])
    parts = compose_loss(model, batch, alpha_sdpo=1.0, beta_replay=0.0, sdpo_jsd_beta=0.5)
    # reference from full logits: response token k of the student row against token k of
    # the teacher row, on the sites' tokens
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t_logits = model(
            input_ids=batch["ctx_teacher_input_ids"],
            attention_mask=batch["ctx_teacher_attention_mask"],
        ).logits
    s_sel, t_sel = [], []
    for b in range(2):
        s_pos = batch["response_mask"][b].nonzero().squeeze(-1)
        t_pos = batch["ctx_teacher_response_mask"][b].nonzero().squeeze(-1)
        keep = batch["sdpo_loss_mask"][b, s_pos] == 1
        s_sel.append(logits[b, s_pos[keep] - 1])
        t_sel.append(t_logits[b, t_pos[keep] - 1])
    s_sel, t_sel = torch.cat(s_sel)[None], torch.cat(t_sel)[None]
    site_tokens = sum(
        len(tokenizer(a, add_special_tokens=False)["input_ids"]) + 1 for a in ACTIONS[1:]
    )
    assert s_sel.shape[1] == site_tokens
    sdpo = generalized_jsd_loss(s_sel, t_sel, beta=0.5, reduction="sum") / site_tokens
    targets = batch["labels"][:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )
    values = parts.detached()
    assert math.isfinite(values["sdpo_jsd"]) and values["sdpo_jsd"] > 0
    assert values["sdpo_jsd"] == pytest.approx(float(sdpo), rel=1e-6)
    assert values["lm_ce"] == pytest.approx(float(ce), rel=1e-6)


# --- exact layout and truncation with a character tokenizer ----------------------------------

EOS = 2


class CharTokenizer:
    """One token per character (code point + 10); a chat turn is ``[1, *role, *content]``
    and the generation prompt is ``[1, 5]`` (not an assistant turn's opening: a template
    whose rendering of the next turns never extends the row, so every turn in between is
    rendered on its own)."""

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


def char_trace(first_fails=False):
    tool = {"role": "tool", "content": "o1"}
    if first_fails:
        tool["tool_error"] = "bad"
    turns = [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "a1"},
        tool,
        {"role": "assistant", "content": "a2"},
        {"role": "tool", "content": "o2"},
        {"role": "assistant", "content": "a3"},
    ]
    return {"trace_id": "c", "turns": turns, "final_reward": 1.0}


P = [1, *chars("user"), *chars("task"), 1, 5]  # 11 tokens
A1, A2, A3 = ([*chars(a), EOS] for a in ("a1", "a2", "a3"))
O1, O2 = ([1, *chars("tool"), *chars(o), 1, 5] for o in ("o1", "o2"))  # 9 tokens each


def collate_chars(cap, trace_, **kw):
    return ComposerDataCollator(CharTokenizer(), CollatorConfig(max_seq_len=cap, **kw))([trace_])


def test_truncation_cuts_the_prompt_then_drops_whole_trailing_turns():
    def row(cap):
        batch = collate_chars(cap, char_trace())
        return batch["input_ids"][0].tolist(), batch["response_mask"][0].tolist()

    assert row(64) == (
        [*P, *A1, *O1, *A2, *O2, *A3],
        [0] * 11 + [1] * 3 + [0] * 9 + [1] * 3 + [0] * 9 + [1] * 3,
    )
    # the prompt is cut from the left first
    assert row(30) == ([*P[-3:], *A1, *O1, *A2, *O2, *A3], [0] * 3 + row(64)[1][11:])
    # then the last turn goes with the tool turn before it, and the prompt is whole again
    assert row(27) == ([*P, *A1, *O1, *A2], [0] * 11 + [1] * 3 + [0] * 9 + [1] * 3)
    assert row(25) == ([*P[-10:], *A1, *O1, *A2], [0] * 10 + [1] * 3 + [0] * 9 + [1] * 3)
    assert row(15) == ([*P, *A1], [0] * 11 + [1] * 3)
    # a first turn longer than the cap is cut from the right, after one prompt token
    assert row(3) == ([P[-1], *chars("a1")], [0, 1, 1])


def test_a_row_keeps_the_turns_its_hinted_teacher_holds():
    trace_ = char_trace(first_fails=True)  # a2 follows a failing tool: a site
    plain = collate_chars(30, trace_)
    assert plain["input_ids"][0].tolist() == [*P[-3:], *A1, *O1, *A2, *O2, *A3]
    batch = collate_chars(30, trace_, hint_generator=lambda kind, ctx: "H")
    # the hint message makes the teacher 12 tokens longer: only two turns fit both contexts
    hinted_o1 = [1, *chars("tool"), *chars("o1"), 1, *chars("user"), *chars("Hint: H"), 1, 5]
    assert batch["input_ids"][0].tolist() == [*P, *A1, *O1, *A2]
    assert batch["ctx_teacher_input_ids"][0].tolist() == [*P[-3:], *A1, *hinted_o1, *A2]
    assert batch["sdpo_loss_mask"][0].tolist() == [0] * 23 + [1] * 3
    assert batch["ctx_teacher_response_mask"][0].tolist() == (
        [0] * 3 + [1] * 3 + [0] * len(hinted_o1) + [1] * 3
    )
