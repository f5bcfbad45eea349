"""Bad input never loses data: an input that yields nothing exits non-zero and leaves an
existing output as it was, output paths are checked before any paid call, deep or oversized
lines and wrong-typed rows are skipped and counted, and a bad `train` config is one line."""

from __future__ import annotations

import json

from trace_helpers import MAIN_SESSION
from typer.testing import CliRunner

from composer_replication.cli import app as main_app
from composer_replication.testing import LocalOpenAIServer
from composer_replication.trace_cli import app

runner = CliRunner()
PRECIOUS = '{"state_id": "keep me"}\n'


def _existing(path):
    path.write_text(PRECIOUS)
    return path


def test_ingest_of_empty_binary_or_sessionless_input_leaves_the_output_alone(tmp_path):
    inputs = {
        "empty.jsonl": b"",
        "binary.jsonl": bytes(range(256)) * 40,
        "sessionless.jsonl": b'{"type": "summary", "summary": "x"}\n{"foo": 1}\n',
    }
    for name, data in inputs.items():
        src = tmp_path / name
        src.write_bytes(data)
        out = _existing(tmp_path / f"{name}.out")
        result = runner.invoke(app, ["ingest", str(src), "-o", str(out)])
        assert result.exit_code == 1, name
        assert "left untouched" in result.output
        assert out.read_text() == PRECIOUS


def test_deep_and_oversized_lines_are_skipped_and_counted(tmp_path):
    session = tmp_path / "s.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    session.write_text(deep + "\n" + MAIN_SESSION.read_text())
    out = tmp_path / "states.jsonl"
    result = runner.invoke(app, ["ingest", str(session), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "oversized or too deep 1" in result.output
    assert out.read_text().strip()  # the good records still made states


def test_replay_checks_inputs_and_output_before_paying(tmp_path):
    with LocalOpenAIServer() as server:
        teachers = tmp_path / "t.json"
        teachers.write_text(
            json.dumps(
                [
                    {
                        "slug": "local/t",
                        "input_per_mtok": 1,
                        "output_per_mtok": 1,
                        "base_url": server.base_url,
                    }
                ]
            )
        )
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        out = _existing(tmp_path / "rows.jsonl")
        result = runner.invoke(
            app, ["replay", str(empty), "-o", str(out), "--teachers", str(teachers)]
        )
        assert result.exit_code == 1 and "no states" in result.output
        assert out.read_text() == PRECIOUS
        states = tmp_path / "states.jsonl"
        states.write_text(
            json.dumps(
                {
                    "state_id": "s",
                    "messages": [{"role": "user", "content": "hi"}],
                    "student_action": "x",
                }
            )
            + "\n"
        )
        as_dir = tmp_path / "a_directory"
        as_dir.mkdir()
        result = runner.invoke(
            app, ["replay", str(states), "-o", str(as_dir), "--teachers", str(teachers)]
        )
        assert result.exit_code == 2 and "is a directory" in result.output
        assert server.requests == []  # nothing was paid for


def test_pairs_with_mismatched_or_wrong_typed_inputs(tmp_path):
    states = tmp_path / "states.jsonl"
    states.write_text(
        json.dumps({"state_id": "a", "messages": [], "student_action": "x"}) + "\n" + "[1, 2, 3]\n"
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"state_id": "other", "teacher_slug": "t", "response_text": "y", "error": None})
        + '\n["a list"]\n{not json\n'
    )
    out = _existing(tmp_path / "pairs.jsonl")
    result = runner.invoke(app, ["pairs", str(rows), "--states", str(states), "-o", str(out)])
    assert result.exit_code == 1
    assert "wrong type 1" in result.output and "malformed 1" in result.output
    assert "no result row" in result.output and "Traceback" not in result.output
    assert out.read_text() == PRECIOUS


def test_train_config_errors_are_one_line_and_create_nothing(tmp_path):
    run_dir = tmp_path / "run"
    for args, needle in (
        (["--set", "steps=0"], "steps: Input should be greater than or equal to 1"),
        (["--set", "model.source=/no/such/model"], "model.source '/no/such/model' does not exist"),
        (
            [
                "--set",
                "loss.sdpo_jsd_beta=0.9",
                "--set",
                "envs.0.algorithm.advantage.sdpo_jsd_beta=0.5",
            ],
            "loss.sdpo_jsd_beta = 0.9 contradicts envs.0.algorithm.advantage.sdpo_jsd_beta = 0.5",
        ),
        ([str(tmp_path / "missing.toml")], "does not exist"),
    ):
        result = runner.invoke(main_app, ["train", *args, "--output-dir", str(run_dir)])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], result.output
        assert not run_dir.exists()
    debug = runner.invoke(main_app, ["train", "--set", "steps=0", "--debug"])
    assert debug.exit_code != 0 and debug.exception is not None  # the traceback is kept


def _states_file(tmp_path, n=2):
    from trace_helpers import make_states

    path = tmp_path / "states.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in make_states(n)))
    return path


def test_an_output_equal_to_an_input_is_refused_and_the_input_kept(tmp_path):
    session = tmp_path / "session.jsonl"
    session.write_bytes(MAIN_SESSION.read_bytes())
    hard = tmp_path / "same_inode.jsonl"
    hard.hardlink_to(session)
    states = _states_file(tmp_path)
    before = {p: p.read_bytes() for p in (session, states)}
    for args in (
        ["ingest", str(session), "-o", str(session)],
        ["ingest", str(session), "-o", str(hard)],  # the same file by another name
        ["ingest", str(tmp_path), "-o", str(tmp_path / "states2.jsonl")],  # read back later
        ["replay", str(states), "-o", str(states), "--teachers", "openai/gpt-5"],
        ["pairs", str(states), "--states", str(states), "-o", str(states)],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "is the input" in result.output or "inside the input folder" in result.output
        assert {p: p.read_bytes() for p in before} == before
    assert not (tmp_path / "states2.jsonl").exists()


def test_replay_whose_every_call_failed_exits_1_and_keeps_the_old_results(tmp_path):
    states = _states_file(tmp_path, n=3)
    out = _existing(tmp_path / "rows.jsonl")
    with LocalOpenAIServer() as server:
        gone = server.base_url  # a teacher that stops answering: connection refused
    teachers = tmp_path / "t.json"
    teachers.write_text(
        json.dumps(
            [{"slug": "local/t", "input_per_mtok": 1, "output_per_mtok": 1, "base_url": gone}]
        )
    )
    common = ["replay", str(states), "-o", str(out), "--teachers", str(teachers), "--no-cache"]
    for extra in (["--max-retries", "0", "--timeout", "2"], ["--max-usd", "0"]):
        result = runner.invoke(app, [*common, *extra])
        assert result.exit_code == 1, result.output
        assert "every one of the 3 teacher calls failed" in result.output
        assert "Traceback" not in result.output
        assert out.read_text() == PRECIOUS
