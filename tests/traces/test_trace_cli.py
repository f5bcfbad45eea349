"""`trace_cli`: ingest -> replay -> pairs through typer's CliRunner, against the local server."""

from __future__ import annotations

import json

import pytest
import typer
from trace_helpers import MAIN_SESSION, PROJECTS
from typer.testing import CliRunner

from composer_replication.teacher_replay import read_jsonl
from composer_replication.testing import Fault, LocalOpenAIServer
from composer_replication.trace_cli import app, load_teachers, register

runner = CliRunner()


def teachers_file(tmp_path, server: LocalOpenAIServer, fmt: str = "json"):
    specs = [
        {
            "slug": f"local/t{j}",
            "input_per_mtok": 1.0,
            "output_per_mtok": 2.0,
            "base_url": server.base_url,
        }
        for j in range(3)
    ]
    path = tmp_path / f"teachers.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps({"teachers": specs}))
    else:
        path.write_text(
            "".join(
                f'[[teachers]]\nslug = "{t["slug"]}"\ninput_per_mtok = 1.0\noutput_per_mtok = 2.0\n'
                f'base_url = "{t["base_url"]}"\n\n'
                for t in specs
            )
        )
    return path


def test_ingest_writes_states_and_prints_counts(tmp_path):
    out = tmp_path / "states.jsonl"
    result = runner.invoke(app, ["ingest", str(PROJECTS), "-o", str(out)])
    assert result.exit_code == 0, result.output
    states = list(read_jsonl(out))
    assert len(states) == 19
    assert (
        "ingested 6 file(s), 62 records: 19 states (2 after an error, 0 truncated)" in result.output
    )
    assert (
        "skipped 18 records: subagent 4, subagent files 1, summary 1, snapshot 1, " in result.output
    )
    assert (
        "warning: 3c9e5d02-7d3f-4e50-9c91-2f406d8eac32.jsonl: Claude Code version '9.1.0'"
        in result.output
    )
    missing = runner.invoke(app, ["ingest", str(tmp_path / "none"), "-o", str(out)])
    assert missing.exit_code == 2 and "does not exist" in missing.output


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["json", "toml"])
def test_replay_then_pairs_end_to_end(tmp_path, fmt):
    states_path = tmp_path / "states.jsonl"
    assert runner.invoke(app, ["ingest", str(MAIN_SESSION), "-o", str(states_path)]).exit_code == 0

    def reply(model, messages):  # two teachers agree, the third does not
        return "Let me run the tests." if model != "local/t2" else "no idea"

    with LocalOpenAIServer(reply) as server:
        server.add_faults(Fault("status", status=500), model="local/t2")
        results = tmp_path / "out" / "results.jsonl"
        args = [
            "replay",
            str(states_path),
            "-o",
            str(results),
            "--teachers",
            str(teachers_file(tmp_path, server, fmt)),
            "--max-usd",
            "1",
            "--max-retries",
            "0",
        ]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert server.request_count == 24
        rows = list(read_jsonl(results))
        assert len(rows) == 24 and sum(r["error"] is not None for r in rows) == 1
        assert "8 states x 3 teachers" in result.output
        assert "rows 24: ok 23, cache hits 0, calls 24, requests 24 (retries 0)" in result.output
        spend = sum(r["cost_usd"] for r in rows)
        assert "errors: http_500=1" in result.output
        assert f"spend ${spend:.6f} of $1 (overshoot $0.000000)" in result.output
        # the default cache next to the output makes a re-run free for finished rows
        again = runner.invoke(app, args)
        assert "cache hits 23" in again.output and server.request_count == 25

    pairs_out = tmp_path / "pairs.jsonl"
    result = runner.invoke(
        app, ["pairs", str(results), "--states", str(states_path), "-o", str(pairs_out)]
    )
    assert result.exit_code == 0, result.output
    pairs = list(read_jsonl(pairs_out))
    assert len(pairs) == 8 and all(p["chosen"] == "Let me run the tests." for p in pairs)
    assert "8 states, 24 rows (0 errors): 8 pairs" in result.output
    assert "wrote 8 pairs" in result.output


def test_pairs_normalize_without_data_juicer_fails_cleanly(tmp_path, monkeypatch):
    import composer_replication.replaysim.normalize as normalize_module

    monkeypatch.setattr(normalize_module, "dj_available", lambda: False)
    for name in ("states.jsonl", "results.jsonl"):
        (tmp_path / name).write_text("")
    result = runner.invoke(
        app,
        [
            "pairs",
            str(tmp_path / "results.jsonl"),
            "--states",
            str(tmp_path / "states.jsonl"),
            "-o",
            str(tmp_path / "p.jsonl"),
            "--normalize",
        ],
    )
    assert result.exit_code == 2 and "replaysim" in result.output


def test_replay_errors_are_reported_not_raised(tmp_path, monkeypatch):
    states = tmp_path / "states.jsonl"
    states.write_text(
        json.dumps(
            {
                "state_id": "a",
                "student_action": "x",
                "messages": [{"role": "user", "content": "hi"}],
            }
        )
        + "\n"
    )
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    no_key = runner.invoke(app, ["replay", str(states), "-o", str(tmp_path / "r.jsonl")])
    assert no_key.exit_code == 2 and "OPENROUTER_API_KEY" in no_key.output
    bad = runner.invoke(
        app, ["replay", str(states), "-o", str(tmp_path / "r.jsonl"), "--teachers", "openai/gpt-4"]
    )
    assert bad.exit_code == 2 and "unknown teacher slug" in bad.output


def test_load_teachers_and_register():
    assert [t["slug"] for t in load_teachers("openai/gpt-5, deepseek/deepseek-v4-pro")] == [
        "openai/gpt-5",
        "deepseek/deepseek-v4-pro",
    ]
    assert load_teachers("openai/gpt-5")[0]["input_per_mtok"] == 1.25
    main = typer.Typer()

    @main.command()
    def version() -> None:
        """Print the version."""

    register(main)
    help_text = runner.invoke(main, ["--help"]).output
    for command in ("ingest", "replay", "pairs", "version"):
        assert command in help_text
