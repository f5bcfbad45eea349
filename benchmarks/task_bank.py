"""The python_functions task bank's costs: how long its tests and its guards take.

Run: ``python benchmarks/task_bank.py`` (about a minute on 2 CPU cores). Prints:

- every task's reference solution under plain pytest, all in one process: the wall time
  and the slowest single test (each should stay well under a grading step's budget);
- ``extract_code`` on a degenerate completion (hundreds of repeated, unterminated
  definitions): seconds, against the same call on an ordinary completion;
- ``validate_reference`` of a reference that never returns, with ``timeout_s=2``: the
  seconds until the verdict, against the timeout.

These were once asserted in the tests as wall-clock limits; the tests now check the
verdicts and this script reports the times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import machine_line


def bank_under_pytest() -> tuple[float, float, str]:
    """(wall seconds, slowest test's seconds, its name) of every reference's tests."""
    from composer_replication.envs.task_bank import (
        SOLUTION_FILE,
        TEST_FILE,
        TEST_HEADER,
        load_tasks,
        task_files,
    )

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i, task in enumerate(load_tasks(), start=1):
            files = task_files(task, task.reference)
            module = f"ref_{i:03d}"
            (root / f"{module}.py").write_text(files[SOLUTION_FILE])
            body = files[TEST_FILE][len(TEST_HEADER) :]
            (root / f"test_{module}.py").write_text(f"from {module} import *\n" + body)
        (root / "pytest.ini").write_text("[pytest]\n")
        junit = root / "report.xml"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no",
             f"--junitxml={junit}"],
            cwd=root, env=env, capture_output=True, timeout=600, check=False,
        )  # fmt: skip
        wall = time.perf_counter() - start
        slowest, name = 0.0, ""
        for case in ET.parse(junit).getroot().iter("testcase"):
            seconds = float(case.get("time", "0"))
            if seconds > slowest:
                slowest, name = seconds, f"{case.get('classname')}::{case.get('name')}"
        return wall, slowest, name


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    import dataclasses

    from composer_replication.envs.task_bank import extract_code, load_tasks, validate_reference

    print(machine_line())
    wall, slowest, name = bank_under_pytest()
    print(
        f"references under pytest: {wall:.1f} s in all; slowest test {slowest * 1000:.0f} ms ({name})"
    )
    degenerate = (
        "def f(x):\n    return (x +\n" * 400 + "Some prose.\ndef f(x):\n    return x\n" * 400
    )
    ordinary = "Here:\n```python\ndef f(x):\n    return x\n```\n"
    slow = timed(lambda: extract_code(degenerate, "f"))
    fast = timed(lambda: extract_code(ordinary, "f"))
    print(
        f"extract_code: degenerate completion {slow * 1000:.1f} ms, ordinary {fast * 1000:.2f} ms"
    )
    task = next(t for t in load_tasks() if t.entry_point == "sign")
    looping = dataclasses.replace(task, reference="def sign(n):\n    while True:\n        pass\n")
    seconds = timed(lambda: validate_reference(looping, timeout_s=2))
    print(f"validate_reference of a reference that never returns (timeout 2 s): {seconds:.1f} s")


if __name__ == "__main__":
    main()
