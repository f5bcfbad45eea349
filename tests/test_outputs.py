"""The output policy every command shares (``composer_replication.common.outputs``) and the atomic
writer under it: inputs, directories, devices, FIFOs and links are refused before any work;
a file is replaced only as a whole, keeping its mode; a failure leaves it as it was."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from composer_replication.common.atomic_io import (
    EmptyOutputError,
    write_lines_atomic,
    write_text_atomic,
)
from composer_replication.common.outputs import (
    OutputError,
    check_output,
    check_output_dir,
    owner_of,
)


def test_an_input_is_refused_by_path_by_link_and_by_inode(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("x\n")
    with pytest.raises(OutputError, match="is the input"):
        check_output(src, inputs=[src])
    with pytest.raises(OutputError, match="is the input"):
        check_output(tmp_path / "." / "in.jsonl", inputs=[src])  # another spelling
    hard = tmp_path / "hard.jsonl"
    os.link(src, hard)
    with pytest.raises(OutputError, match="is the input"):
        check_output(hard, inputs=[src])
    folder = tmp_path / "sessions"
    folder.mkdir()
    with pytest.raises(OutputError, match="inside the input folder"):
        check_output(folder / "states.jsonl", input_dirs=[folder])
    assert check_output(tmp_path / "new" / "out.jsonl", inputs=[src]) == tmp_path / "new/out.jsonl"


def test_directories_devices_fifos_and_links_are_refused(tmp_path):
    with pytest.raises(OutputError, match="is a directory"):
        check_output(tmp_path)
    with pytest.raises(OutputError, match="is a character device, not a regular file"):
        check_output("/dev/null")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="is a FIFO"):
        check_output(fifo)
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with pytest.raises(OutputError, match=r"symbolic link.*--follow-symlinks"):
        check_output(link)
    assert check_output(link, follow_symlinks=True) == real
    with pytest.raises(OutputError, match="is the input"):  # followed to an input
        check_output(link, inputs=[real], follow_symlinks=True)
    with pytest.raises(OutputError, match="is a FIFO"):  # followed to a FIFO
        (tmp_path / "to_fifo").symlink_to(fifo)
        check_output(tmp_path / "to_fifo", follow_symlinks=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes everywhere")
def test_an_unwritable_folder_or_a_file_as_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="is not writable"):
            check_output(locked / "sub" / "out.jsonl")
        with pytest.raises(OutputError, match="is not writable"):
            check_output_dir(locked)
    finally:
        locked.chmod(0o700)
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OutputError, match="a part of its folder is a file"):
        check_output(a_file / "out.jsonl")
    with pytest.raises(OutputError, match="is a regular file, not a directory"):
        check_output_dir(a_file)


def test_the_writer_keeps_the_mode_and_refuses_special_files(tmp_path):
    secret = tmp_path / "traces.jsonl"
    secret.write_text("old\n")
    secret.chmod(0o600)
    assert write_lines_atomic(secret, ["a\n", "b\n"]) == 2
    assert secret.read_text() == "a\nb\n"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    fresh = write_text_atomic(tmp_path / "new.json", "{}\n")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(secret)
    for special in (fifo, link):
        with pytest.raises(OutputError, match="not a regular file"):
            write_text_atomic(special, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fifo",
        "link",
        "new.json",
        "traces.jsonl",
    ]


def test_a_failed_or_empty_write_leaves_the_old_file(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")

    def rows():
        yield json.dumps({"a": 1}) + "\n"
        raise RuntimeError("the work failed half way")

    with pytest.raises(RuntimeError):
        write_lines_atomic(out, rows())
    with pytest.raises(EmptyOutputError):
        write_lines_atomic(out, [], require_lines=True)
    assert out.read_text() == "precious\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary left


def test_files_other_commands_keep_are_refused_unless_the_command_owns_them(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSER_REPLICATION_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "tasks").mkdir(parents=True)
    cached = tmp_path / "cache" / "tasks" / "tasks.jsonl"
    assert owner_of(cached)[0] == "project_cache"
    assert owner_of(tmp_path / "x" / "replay-cache.jsonl")[0] == "replay_cache"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / ".run.lock").write_text("")  # a run that has not written a row yet
    assert owner_of(run / "checkpoints" / "step_1.pt")[0] == "run_record"
    assert owner_of(run / "config.json")[0] == "run_record"
    assert owner_of(run / "notes.json") is None  # beside a run's record: the user's
    tasks = tmp_path / "gen.jsonl"
    tasks.write_text('{"task_id": "fd:r:a.py:f"}\n')
    assert owner_of(tasks)[0] == "task_generation"
    assert owner_of(tmp_path / "plain.jsonl") is None
    with pytest.raises(OutputError, match="in the project's cache"):
        check_output(cached)
    with pytest.raises(OutputError, match="record of the run"):
        check_output(run / "config.json", option="--json")
    assert check_output(tasks, owns=("task_generation",)) == tasks  # datagen rewrites its own


def test_an_output_folder_that_is_a_link_is_refused_unless_followed(tmp_path: Path) -> None:
    from composer_replication.common.outputs import check_output_dir

    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OutputError) as refused:
        check_output_dir(link, option="--out")
    assert str(refused.value) == (
        f"--out {str(link)!r} is a symbolic link; pass the folder it points to "
        f"({str(real)!r}) if that is where the files should go"
    )
    assert check_output_dir(link, follow_symlinks=True) == link


def test_the_projects_own_files_are_owned_wherever_they_sit_in_the_package():
    import composer_replication
    from composer_replication.common import outputs

    package = Path(composer_replication.__file__).parent
    for path in (package / "__init__.py", package / "common" / "outputs.py", package / "cli.py"):
        assert outputs.owner_of(path) == ("source", "one of the project's own files"), path
