"""The command line: fast --help, cheap top-level import, the smoke job end to end."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from composer_replication.cli import app


def test_help_lists_commands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("train", "smoke", "version"):
        assert command in result.output


def test_train_help_keeps_every_word_of_its_options():
    # rich reads "[name]" as markup and drops it: option help must not depend on brackets
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "sized by the config's roles table" in result.output


@pytest.mark.parametrize("group", ["", "diloco"])
def test_command_groups_show_help_when_bare_and_offer_no_completion(group):
    # every group is built by errors.command_group: bare -> its help, no completion options
    bare = CliRunner().invoke(app, [group] if group else [])
    assert "Usage:" in bare.output and "Commands" in bare.output
    assert bare.exit_code == 2  # click's code for a group called without a command
    helped = CliRunner().invoke(app, [*([group] if group else []), "--help"])
    assert helped.exit_code == 0 and "--install-completion" not in helped.output


def test_top_level_import_is_cheap():
    code = (
        "import sys, composer_replication as c\n"
        "heavy = {'torch', 'trl', 'torchft', 'docker', 'boto3', 'kubernetes', 'httpx',"
        " 'data_juicer', 'transformers'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
        "assert isinstance(c._DILOCO_AVAILABLE, bool)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_lazy_exports_resolve():
    import composer_replication as c
    from composer_replication.loss import compose_loss

    assert c.compose_loss is compose_loss
    assert callable(c.build_batch) and callable(c.generalized_jsd_loss)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = c.no_such_name


def test_smoke_runs_a_real_step_on_a_saved_tiny_model(tmp_path):
    from composer_replication.model.loading import save_checkpoint, tiny_policy
    from composer_replication.smoke import run_smoke

    model, tokenizer = tiny_policy(seed=0)
    path = save_checkpoint(model, tmp_path / "tiny", tokenizer=tokenizer)
    report = run_smoke(str(path), steps=3, lr=1e-2)
    assert len(report.steps) == 4 and len(report.step_seconds) == 3
    assert report.n_parameters == sum(p.numel() for p in model.parameters())
    # three AdamW steps at a high learning rate on a fixed batch must lower the CE
    assert report.steps[-1]["lm_ce"] < report.steps[0]["lm_ce"]
    with pytest.raises(ValueError, match="steps"):
        run_smoke(str(path), steps=0)


def test_smoke_command_prints_components(tmp_path):
    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    path = save_checkpoint(model, tmp_path / "tiny", tokenizer=tokenizer)
    result = CliRunner().invoke(app, ["smoke", "--model", str(path), "--steps", "1"])
    assert result.exit_code == 0, result.output
    for column in ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total", "after step 1"):
        assert column in result.output


def test_eval_heldout_prints_greedy_and_sampled_scores(tmp_path):
    import json

    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    path = str(save_checkpoint(model, tmp_path / "tiny", tokenizer=tokenizer))
    out = tmp_path / "heldout.json"
    args = ["eval", path, "--limit", "2", "--samples", "2", "--max-new-tokens", "8"]
    result = CliRunner().invoke(app, [*args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("python_functions heldout: pass@1", "greedy pass@1", "pass@2", "mean reward"):
        assert text in result.output
    data = json.loads(out.read_text())
    assert data["suite"] == "heldout" and data["n_tasks"] == 2
    assert (data["samples_per_task"], data["temperature"], data["seed"]) == (2, 1.0, 0)
    for key in ("pass@1", "pass@2", "greedy_pass@1", "mean_reward"):
        assert 0.0 <= data[key] <= 1.0, key
    assert list(data["per_task"]) == list(data["greedy_per_task"])
    assert all(len(rewards) == 2 for rewards in data["per_task"].values())


def test_train_prints_the_other_heldout_scores_before_and_after():
    from composer_replication.cli import _heldout_score_lines

    rows = [
        {"step": 0, "heldout/pass@1": 0.1, "heldout/pass@4": 0.3, "heldout/greedy_pass@1": 0.2},
        {"step": 3, "reward/mean": 0.5},
        {"step": 6, "heldout/pass@1": 0.2, "heldout/pass@4": 0.5, "heldout/greedy_pass@1": 0.25},
    ]
    assert _heldout_score_lines(rows) == [
        "held-out pass@4: before 0.300 -> after 0.500",
        "held-out greedy_pass@1: before 0.200 -> after 0.250",
    ]
    assert _heldout_score_lines([{"step": 6, "heldout/pass@4": 0.5}]) == [
        "held-out pass@4: before n/a -> after 0.500"
    ]
