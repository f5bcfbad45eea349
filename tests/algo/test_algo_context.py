"""Teacher-context helpers: message rewriting, error sites, better siblings."""

from __future__ import annotations

import pytest

from composer_replication.algo.context import (
    augment_messages,
    better_sibling,
    hint_text,
    is_error_site,
)
from composer_replication.hint_generator import dispatch
from composer_replication.samples.rollouts import Rollout


def _r(reward, feedback=None, error=None):
    return Rollout("t", [1], [2], [0.0], reward=reward, feedback=feedback, error=error)


def test_augment_messages_rewrites_the_last_user_message_only():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "second"},
    ]
    out = augment_messages(messages, "{content}\n\nHint: {hint}", hint="h")
    assert [m["content"] for m in out] == ["S", "first", "A", "second\n\nHint: h"]
    assert messages[3]["content"] == "second"  # the input is not modified
    only_system = augment_messages(
        [{"role": "system", "content": "S"}], "{content}\n\nHint: {hint}", hint="h"
    )
    assert only_system[-1] == {"role": "user", "content": "Hint: h"}


def test_error_sites_and_better_siblings():
    group = [_r(0.5), _r(1.0), _r(1.0, feedback="warning"), _r(0.0, error="timeout")]
    assert [is_error_site(group, i) for i in range(4)] == [True, False, True, True]
    assert better_sibling(group, 0) is group[1]
    assert better_sibling(group, 2) is None  # already the best
    assert better_sibling(group, 3) is group[1]


@pytest.mark.parametrize(
    ("rollout", "source", "expected"),
    [
        (_r(0, feedback="Traceback (most recent call last):\nKeyError: 'x'"), "generator",
         dispatch("runtime_error", {"error_message": "Traceback (most recent call last):\nKeyError: 'x'"})),
        (_r(0, error="unknown tool 'grep'"), "generator",
         dispatch("tool_not_found", {"error_message": "unknown tool 'grep'"})),
        (_r(0, feedback="boom"), "feedback", "boom"),
        (_r(0, feedback="boom"), "none", None),
    ],
)  # fmt: skip
def test_hint_text(rollout, source, expected):
    assert hint_text(rollout, source) == expected


def test_generic_hint_quotes_only_the_tail():
    long = "\n".join(f"line {i}" for i in range(20))
    hint = hint_text(_r(0, feedback=long), "generator")  # unclassifiable: generic
    assert (
        hint
        == "Your previous attempt failed with:\n"
        + "\n".join(f"line {i}" for i in range(12, 20))
        + "\nFind the cause and fix it."
    )
