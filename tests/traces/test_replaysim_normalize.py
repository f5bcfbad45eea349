"""`replaysim`: pass-through, error paths, the packaged recipe, and real data-juicer runs."""

from __future__ import annotations

import importlib.util
import os

import pytest
import yaml
from trace_helpers import local_teachers, make_states

from composer_replication.replaysim import (
    DEFAULT_RECIPE,
    DJNormalizer,
    NormalizedDPOPair,
    replay_and_normalize_trace,
)
from composer_replication.replaysim import normalize as normalize_module
from composer_replication.testing import LocalOpenAIServer

DJ_INSTALLED = importlib.util.find_spec("data_juicer") is not None
needs_dj = pytest.mark.skipif(
    not DJ_INSTALLED,
    reason="data-juicer is not installed; pip install 'composer-replication[replaysim]'",
)

PAIR = {
    "state_id": "s0",
    "state_messages": [{"role": "user", "content": "fix it"}],
    "chosen": "def f():\n\treturn 1",
    "rejected": "def f():\n\treturn 2",
    "n_teachers_agreeing": 2,
}


def test_skip_dj_passes_pairs_through_in_chat_format():
    normalizer = DJNormalizer(skip_dj=True)
    assert normalizer.normalize([PAIR]) == [
        NormalizedDPOPair(
            state_id="s0",
            state_messages=[{"role": "user", "content": "fix it"}],
            chosen_messages=[{"role": "assistant", "content": "def f():\n\treturn 1"}],
            rejected_messages=[{"role": "assistant", "content": "def f():\n\treturn 2"}],
            n_teachers_agreeing=2,
            metadata={"skipped": True},
        )
    ]
    assert normalizer.last_stats.n_pairs_out == 1
    assert normalizer.normalize([]) == []
    row = normalizer.normalize([PAIR])[0].to_dict()
    assert row["chosen_messages"][0]["role"] == "assistant" and row["metadata"] == {"skipped": True}


def test_missing_recipe_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        DJNormalizer(tmp_path / "nope.yaml", skip_dj=True)
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        DJNormalizer(tmp_path / "nope.yaml")


def test_missing_data_juicer_raises_runtime_error_naming_the_extra(monkeypatch):
    if DJ_INSTALLED:  # make it absent for this test; otherwise the real absence is tested
        monkeypatch.setattr(normalize_module, "dj_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"composer-replication\[replaysim\]"):
        DJNormalizer()


def test_default_recipe_is_a_packaged_text_only_data_juicer_recipe():
    assert DEFAULT_RECIPE.is_file() and DEFAULT_RECIPE.name == "default.yaml"
    recipe = yaml.safe_load(DEFAULT_RECIPE.read_text())
    ops = [next(iter(op)) for op in recipe["process"]]
    assert ops == [
        "remove_specific_chars_mapper",
        "clean_email_mapper",
        "text_length_filter",
        "maximum_line_length_filter",
        "character_repetition_filter",
    ]
    assert recipe["text_keys"] == "text" and recipe["np"] == 1


@pytest.mark.integration
@pytest.mark.asyncio
async def test_replay_and_normalize_chains_the_pipeline():
    def agree(model, messages):
        return "pytest -q" if model != "local/t2" else "something else"

    with LocalOpenAIServer(agree) as server:
        raw, pairs = await replay_and_normalize_trace(
            states=make_states(2, student="rm -rf /"),
            teachers=local_teachers(server, 3),
            normalizer=DJNormalizer(skip_dj=True),
            concurrency=4,
        )
    assert len(raw) == 6 and all(r["error"] is None for r in raw)
    assert [(p.state_id, p.n_teachers_agreeing) for p in pairs] == [("s0", 2), ("s1", 2)]
    assert pairs[0].chosen_messages == [{"role": "assistant", "content": "pytest -q"}]
    assert pairs[0].rejected_messages == [{"role": "assistant", "content": "rm -rf /"}]


@pytest.mark.integration
def test_sync_wrapper_and_fail_before_spending(monkeypatch):
    with LocalOpenAIServer(lambda m, msgs: "same") as server:
        raw, pairs = normalize_module.replay_and_normalize_trace_sync(
            states=make_states(1),
            teachers=local_teachers(server, 2),
            normalizer=DJNormalizer(skip_dj=True),
        )
        assert len(raw) == 2 and len(pairs) == 1
        if DJ_INSTALLED:
            monkeypatch.setattr(normalize_module, "dj_available", lambda: False)
        server.reset_counts()
        with pytest.raises(RuntimeError, match="replaysim"):
            normalize_module.replay_and_normalize_trace_sync(
                states=make_states(1), teachers=local_teachers(server, 2)
            )
        assert server.request_count == 0  # nothing was paid for


@pytest.mark.asyncio
async def test_sync_wrapper_refuses_a_running_loop():
    with pytest.raises(RuntimeError, match="await replay_and_normalize_trace"):
        normalize_module.replay_and_normalize_trace_sync(states=[])


@needs_dj
@pytest.mark.integration
@pytest.mark.slow
def test_data_juicer_runs_the_default_recipe_on_cpu():
    pairs = [
        {**PAIR, "chosen": "def f():\n\treturn 1  # by dev@example.com\u200b"},  # cleaned
        {**PAIR, "state_id": "s1", "chosen": "ab" * 3000},  # degenerate repetition: dropped
        {**PAIR, "state_id": "s2", "chosen": "x = 1\u200b", "rejected": "x = 1"},  # identical
        {**PAIR, "state_id": "s3", "chosen": "a" * 5000 + "\nb"},  # 5000-char line: dropped
    ]
    env_before = dict(os.environ)
    normalizer = DJNormalizer()
    out = normalizer.normalize(pairs)
    assert [p.state_id for p in out] == ["s0"]
    assert out[0].chosen_messages == [
        {"role": "assistant", "content": "def f():\n\treturn 1  # by <email>"}  # tab kept
    ]
    assert out[0].rejected_messages == [{"role": "assistant", "content": "def f():\n\treturn 2"}]
    assert out[0].metadata["chosen_changed"] is True and out[0].metadata["skipped"] is False
    stats = normalizer.last_stats
    assert (stats.n_pairs_out, stats.n_dropped_by_recipe, stats.n_dropped_identical) == (1, 2, 1)
    assert dict(os.environ) == env_before  # data-juicer's own variables are undone too


@needs_dj
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("ftfy") is not None, reason="ftfy is installed: nothing to refuse"
)
def test_data_juicer_never_installs_packages(tmp_path):
    recipe = tmp_path / "needs_ftfy.yaml"
    recipe.write_text(
        "project_name: t\nnp: 1\ntext_keys: text\nprocess:\n  - fix_unicode_mapper:\n"
    )
    with pytest.raises(ImportError, match=r"never lets it.*pip install ftfy"):
        DJNormalizer(recipe).normalize([PAIR])
    assert importlib.util.find_spec("ftfy") is None  # still not installed


@needs_dj
@pytest.mark.integration
@pytest.mark.slow
def test_replay_and_normalize_with_data_juicer_end_to_end():
    def agree(model, messages):
        return "run: pytest -q  # ask dev@example.com"

    with LocalOpenAIServer(agree) as server:
        raw, pairs = normalize_module.replay_and_normalize_trace_sync(
            states=make_states(2, student="rm -rf /"), teachers=local_teachers(server, 2)
        )
    assert len(raw) == 4
    assert [p.chosen_messages[0]["content"] for p in pairs] == ["run: pytest -q  # ask <email>"] * 2
    assert all(p.metadata["recipe"] == str(DEFAULT_RECIPE) for p in pairs)
