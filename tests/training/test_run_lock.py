"""One run per output directory: the lock, across processes, and `train` refusing a held one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from composer_replication.training.run_lock import (
    LOCK_NAME,
    RunDirectoryBusy,
    RunDirectoryLock,
    check_run_directory_free,
)

HOLD = textwrap.dedent(
    """
    import sys, time
    from composer_replication.training.run_lock import RunDirectoryLock
    lock = RunDirectoryLock(sys.argv[1])
    lock.acquire()
    print("held", flush=True)
    time.sleep(120)
    """
)


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_lock_is_refused_naming_the_directory_and_the_holder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunDirectoryLock(run_dir) as first:
        assert first.held and (run_dir / LOCK_NAME).is_file()
        with pytest.raises(RunDirectoryBusy) as refused:
            RunDirectoryLock(run_dir).acquire()
        message = str(refused.value)
        assert message.startswith(f"{run_dir} is in use by another run (pid {os.getpid()} on ")
        assert message.endswith("give this run another output directory (--output-dir)")
        assert "\n" not in message
    assert not (run_dir / LOCK_NAME).exists()  # released: the file goes with it
    with RunDirectoryLock(run_dir):  # and the directory is free again
        pass


def test_a_holder_that_dies_however_it_dies_frees_the_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        with pytest.raises(RunDirectoryBusy, match=f"pid {proc.pid} on "):
            RunDirectoryLock(run_dir).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (run_dir / LOCK_NAME).is_file()  # SIGKILL left the file behind ...
    with RunDirectoryLock(run_dir) as lock:  # ... and it blocks nobody
        assert lock.held


@pytest.mark.integration
def test_train_refuses_a_directory_another_run_holds_and_leaves_it_as_it_was(
    tmp_path: Path,
) -> None:
    from composer_replication.cli import app
    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    save_checkpoint(model, tmp_path / "tiny", tokenizer=tokenizer)
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # the holder's
        before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
        started = time.monotonic()
        result = CliRunner().invoke(
            app,
            [
                "train",
                "--output-dir",
                str(run_dir),
                "--set",
                f"model.source={tmp_path / 'tiny'}",
                "--set",
                "steps=1",
            ],
        )
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert result.exit_code == 2, result.output
        assert (
            len(errors) == 1 and f"{run_dir} is in use by another run (pid {proc.pid}" in errors[0]
        )
        assert "Traceback" not in result.output
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
        assert time.monotonic() - started < 60
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("kind", ["link", "folder", "fifo"])
def test_a_lock_path_that_is_no_file_of_ours_is_refused_and_never_written_through(
    tmp_path: Path, kind: str
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    elsewhere = tmp_path / "someone-elses-file"
    elsewhere.write_text("precious\n")
    lock_path = run_dir / LOCK_NAME
    if kind == "link":
        lock_path.symlink_to(elsewhere)
    elif kind == "folder":
        lock_path.mkdir()
    else:
        os.mkfifo(lock_path)
    what = {"link": "a symbolic link", "folder": "a directory", "fifo": "a FIFO"}[kind]
    for attempt in (RunDirectoryLock(run_dir).acquire, lambda: check_run_directory_free(run_dir)):
        with pytest.raises(RunDirectoryBusy) as refused:
            attempt()
        message = str(refused.value)
        assert (
            f"the run's lock file {str(lock_path)!r} is {what}, not a file this command made"
            in (message)
        )
        assert "\n" not in message
    assert elsewhere.read_text() == "precious\n"


@pytest.mark.integration
def test_train_refuses_a_lock_file_that_links_elsewhere(tmp_path: Path) -> None:
    from composer_replication.cli import app

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    elsewhere = tmp_path / "notes.txt"
    elsewhere.write_text("precious\n")
    (run_dir / LOCK_NAME).symlink_to(elsewhere)
    result = CliRunner().invoke(app, ["train", "--output-dir", str(run_dir), "--set", "steps=1"])
    assert result.exit_code == 2, result.output
    assert "is a symbolic link, not a file this command made" in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert elsewhere.read_text() == "precious\n"
