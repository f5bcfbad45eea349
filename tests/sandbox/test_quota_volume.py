"""The workdir quota on a volume of its own: the kernel stops writes at the quota, and the
host directory stays an exact copy of what commands left there."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from composer_replication.sandbox.quota_volume import mirror_tree, volume_inodes, volume_support
from composer_replication.sandbox.workdir import disk_usage, make_shared_tempdir

MB = 1024 * 1024


@pytest.fixture
def workdir():
    root = make_shared_tempdir("cr-quota-test-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


needs_volume = pytest.mark.skipif(
    bool(volume_support()), reason=f"no quota volume here: {volume_support()}"
)


def _sandbox(workdir: Path, quota_mb: int):
    from composer_replication.sandbox.local import LocalSubprocessSandbox

    sandbox = LocalSubprocessSandbox(workdir, exec_timeout_s=60, workdir_quota_mb=quota_mb)
    assert sandbox.quota_enforcement == "volume"
    return sandbox


def _file_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


# --- mirror_tree: plain directories, no privileges needed ------------------------------


def _sample_tree(src: Path) -> None:
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "pkg" / "deep" / "mod.py").write_text("x = 1\n")
    (src / "a.txt").write_text("alpha")
    os.link(src / "a.txt", src / "a_link.txt")
    (src / "to_passwd").symlink_to("/etc/passwd")
    (src / "dangling").symlink_to("nowhere")
    with open(src / "sparse.bin", "wb") as f:
        f.truncate(64 * MB)
        f.seek(32 * MB)
        f.write(b"data")
    (src / "suid").write_text("#!/bin/sh\n")
    os.chmod(src / "suid", 0o4755)
    os.mkfifo(src / "pipe")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "sock"))


def test_mirror_copies_every_kind_of_entry_without_following_links(tmp_path: Path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    _sample_tree(src)
    (dst / "stale").write_text("gone after the mirror")
    mirror_tree(src, dst, {}, owner=None)

    assert sorted(p.name for p in dst.iterdir()) == [
        "a.txt", "a_link.txt", "dangling", "pipe", "pkg", "sparse.bin", "suid", "to_passwd",
    ]  # fmt: skip
    assert (dst / "pkg" / "deep" / "mod.py").read_text() == "x = 1\n"
    # hard links stay links, symbolic links stay links (never followed)
    assert os.stat(dst / "a.txt").st_ino == os.stat(dst / "a_link.txt").st_ino
    assert os.readlink(dst / "to_passwd") == "/etc/passwd"
    assert os.readlink(dst / "dangling") == "nowhere"
    # a hole stays a hole: the copy takes what the source takes, not its apparent size
    sparse = os.stat(dst / "sparse.bin")
    assert sparse.st_size == 64 * MB
    assert sparse.st_blocks * 512 <= os.stat(src / "sparse.bin").st_blocks * 512 + 4096
    with open(dst / "sparse.bin", "rb") as f:
        f.seek(32 * MB)
        assert f.read(8) == b"data\0\0\0\0"
    # set-uid dropped, the rest of the mode kept; a fifo is a fifo; sockets are left out
    assert stat.S_IMODE(os.stat(dst / "suid").st_mode) == 0o755
    assert stat.S_ISFIFO(os.lstat(dst / "pipe").st_mode)
    assert os.stat(dst / "a.txt").st_mtime_ns == os.stat(src / "a.txt").st_mtime_ns


def test_mirror_copies_only_what_changed_and_sees_a_rewrite_with_its_old_mtime(tmp_path: Path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "same.txt").write_text("unchanged")
    (src / "test_x.py").write_text("assert add(1, 2) == 3\n")
    record = mirror_tree(src, dst, {}, owner=None)
    # it returned a clock tick (10 ms at HZ=100) after its last write: a change from now on
    # cannot share that write's coarse change time
    newest = max(os.lstat(p).st_ctime_ns for p in dst.iterdir())
    assert time.time_ns() >= newest + 10_000_000

    # the same length, the old modification time put back: only the change time tells
    old = os.stat(src / "test_x.py")
    (src / "test_x.py").write_text("assert add(1, 2) != 3\n")
    os.utime(src / "test_x.py", ns=(old.st_atime_ns, old.st_mtime_ns))
    assert os.stat(src / "test_x.py").st_size == old.st_size
    # replaced by a new file of the same length and time, and a new one
    (src / "same.txt").unlink()
    (src / "same.txt").write_text("replaced!")
    os.utime(src / "same.txt", ns=(old.st_atime_ns, old.st_mtime_ns))
    (src / "kept.txt").write_text("new")
    record = mirror_tree(src, dst, record, owner=None)
    assert (dst / "test_x.py").read_text() == "assert add(1, 2) != 3\n"
    assert (dst / "same.txt").read_text() == "replaced!"
    assert (dst / "kept.txt").read_text() == "new"

    # nothing changed: nothing copied (the file we hold open is still the one linked there)
    with open(dst / "kept.txt", "rb") as held:
        mirror_tree(src, dst, record, owner=None)
        assert os.fstat(held.fileno()).st_nlink == 1
    # a change on the destination side since the last copy is undone
    (dst / "kept.txt").write_text("tampered")
    (src / "same.txt").unlink()
    (src / "same.txt").mkdir()
    mirror_tree(src, dst, record, owner=None)
    assert (dst / "kept.txt").read_text() == "new"
    assert (dst / "same.txt").is_dir()


def test_volume_inodes_scale_with_the_quota():
    assert volume_inodes(1 * MB) == 4096
    assert volume_inodes(512 * MB) == 131072


# --- the sandbox on a quota volume --------------------------------------------------------


@needs_volume
def test_many_files_written_at_once_stop_at_the_quota(workdir: Path):
    sandbox = _sandbox(workdir, quota_mb=4)
    many = "for i in $(seq 16); do head -c 1048576 /dev/urandom > f$i & done; wait"
    out = sandbox.exec({"command": many})
    assert "reached its disk quota of 4 MB" in out
    assert sandbox.over_quota == "the workdir reached its disk quota of 4 MB"
    # the kernel refused every byte past the quota: not one block more reached the host
    assert _file_bytes(workdir) <= 4 * MB
    assert disk_usage(workdir) <= 4 * MB
    assert sandbox.exec({"command": "true"}).startswith("Error: the workdir reached")
    sandbox.close()


@needs_volume
def test_hard_links_and_holes_give_the_host_no_more_than_the_quota(workdir: Path):
    sandbox = _sandbox(workdir, quota_mb=4)
    script = (
        "head -c 1048576 /dev/urandom > a && "
        "for i in $(seq 200); do ln a l$i; done && "
        "for i in $(seq 50); do truncate -s 3M s$i; done && echo done"
    )
    out = sandbox.exec({"command": script})
    assert out.strip() == "done", out
    assert os.stat(workdir / "a").st_ino == os.stat(workdir / "l200").st_ino
    assert os.stat(workdir / "s50").st_size == 3 * MB
    assert disk_usage(workdir) <= 2 * MB  # 200 links and 150 MB of holes: one real MB
    assert sandbox.over_quota is None
    sandbox.close()


@needs_volume
def test_the_host_directory_follows_the_commands_and_the_commands_see_the_host(workdir: Path):
    (workdir / "tests").mkdir()
    (workdir / "tests" / "test_calc.py").write_text("def test_it():\n    assert True\n")
    (workdir / "old.txt").write_text("remove me")
    sandbox = _sandbox(workdir, quota_mb=8)
    out = sandbox.exec(
        {
            "command": "cat tests/test_calc.py >/dev/null && rm old.txt && mkdir -p src/pkg && "
            "echo 'x = 1' > src/pkg/m.py && ln -s src/pkg/m.py link && chmod 700 src && "
            "stat -c %U . && df --output=fstype . | tail -1"
        }
    )
    owner, fstype = out.split()
    assert fstype == "tmpfs" and owner != "root"
    assert not (workdir / "old.txt").exists()
    assert (workdir / "src" / "pkg" / "m.py").read_text() == "x = 1\n"
    assert os.readlink(workdir / "link") == "src/pkg/m.py"
    assert stat.S_IMODE(os.stat(workdir / "src").st_mode) == 0o700
    # what the host writes or deletes between commands is what the next one sees
    (workdir / "tool_written.py").write_text("print('from the host')\n")
    shutil.rmtree(workdir / "src")
    assert sandbox.exec({"command": "python3 tool_written.py; ls"}).split() == [
        "from", "the", "host", "link", "tests", "tool_written.py",
    ]  # fmt: skip
    result = sandbox.run_tests("python -m pytest -q", ())
    assert result.ok and result.passed == 1
    assert not list(workdir.glob("*.xml"))  # the junit report was read and removed
    sandbox.close()


@needs_volume
def test_a_rewritten_test_file_reaches_the_host_even_with_its_old_mtime(workdir: Path):
    (workdir / "test_x.py").write_text("assert True  # original\n")
    sandbox = _sandbox(workdir, quota_mb=8)
    out = sandbox.exec(
        {
            "command": "t=$(stat -c %Y test_x.py); printf 'assert True  # tampered\\n' "
            "> test_x.py; touch -d @$t test_x.py; echo ok"
        }
    )
    assert out.strip() == "ok"
    assert (workdir / "test_x.py").read_text() == "assert True  # tampered\n"
    sandbox.close()


@needs_volume
def test_the_holder_ends_with_close_and_the_next_command_makes_a_new_volume(workdir: Path):
    sandbox = _sandbox(workdir, quota_mb=8)
    assert sandbox.exec({"command": "echo 1 > one"}) == ""
    volume = sandbox._volume
    assert volume is not None and volume.alive
    holder = volume._holder.pid
    sandbox.close()
    assert not volume.alive
    assert subprocess.run(["kill", "-0", str(holder)], capture_output=True).returncode != 0
    assert sandbox.exec({"command": "cat one"}) == "1\n"  # the host kept it
    sandbox.close()
