"""The workdir quota of ``LocalSubprocessSandbox``: held by a tmpfs volume, or measured.

Run: ``python benchmarks/sandbox_quota.py`` (about 30 s on 2 CPU cores, as root with
bubblewrap). Prints, for both ways of holding the quota side by side:

- the bytes that reach the host when 16 processes each write 1 MiB at once under a 4 MB
  quota (the volume: at most the quota; the measurement: whatever was written before it
  looked);
- the cost of one command (``true``) in a workdir of 20 and of 2,000 small files, the
  volume's copy in and out included, and the ratio of the two.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import machine_line

MB = 1024 * 1024
MODES = (("volume", True), ("measured", False))


def _sandbox(workdir, quota_mb: int, volume: bool):
    from composer_replication.sandbox.local import LocalSubprocessSandbox

    return LocalSubprocessSandbox(
        workdir, exec_timeout_s=60, workdir_quota_mb=quota_mb, quota_volume=volume
    )


def parallel_writers(volume: bool) -> int:
    """Bytes of file data on the host after 16 writers of 1 MiB under a 4 MB quota."""
    from composer_replication.sandbox.workdir import make_shared_tempdir

    root = make_shared_tempdir("cr-bench-quota-")
    try:
        sandbox = _sandbox(root, 4, volume)
        sandbox.exec(
            {"command": "for i in $(seq 16); do head -c 1048576 /dev/zero > f$i & done; wait"}
        )
        sandbox.close()
        return sum(p.stat().st_size for p in root.iterdir() if p.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def command_cost(files: int, volume: bool, repeats: int = 10) -> float:
    """Seconds per ``true`` in a workdir of ``files`` small files (after a first command)."""
    from composer_replication.sandbox.workdir import make_shared_tempdir

    root = make_shared_tempdir("cr-bench-quota-")
    try:
        for i in range(files):
            folder = root / f"d{i // 50}"
            folder.mkdir(exist_ok=True)
            (folder / f"f{i}.py").write_text("x = 1\n" * 20)
        sandbox = _sandbox(root, 256, volume)
        sandbox.exec({"command": "true"})
        start = time.perf_counter()
        for _ in range(repeats):
            sandbox.exec({"command": "true"})
        elapsed = (time.perf_counter() - start) / repeats
        sandbox.close()
        return elapsed
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    from composer_replication.sandbox.quota_volume import volume_support

    print(machine_line())
    reason = volume_support()
    if reason:
        print(f"no quota volume on this machine ({reason}); only the measured quota runs here")
        return
    written = {name: parallel_writers(volume) for name, volume in MODES}
    print("16 writers x 1 MiB at once, 4 MB quota: bytes on the host")
    for name, _ in MODES:
        print(
            f"  {name:9s} {written[name] / MB:6.2f} MB ({written[name] / (4 * MB):.2f}x the quota)"
        )
    for files in (20, 2000):
        cost = {name: command_cost(files, volume) for name, volume in MODES}
        print(
            f"one command, {files} files: volume {cost['volume'] * 1e3:.0f} ms, measured "
            f"{cost['measured'] * 1e3:.0f} ms (volume/measured {cost['volume'] / cost['measured']:.2f}x)"
        )


if __name__ == "__main__":
    main()
