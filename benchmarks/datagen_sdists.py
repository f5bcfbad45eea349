"""datagen on real repositories nobody here wrote: pip sdists with their tests.

Run: ``python benchmarks/datagen_sdists.py [--max-tasks 5] [NAME==VERSION ...]`` (a few
minutes on 2 CPU cores; needs the package index once, to download the sdists). Each sdist
is downloaded with ``pip download --no-deps --no-binary :all:``, unpacked, and handed to
``generate_tasks`` as it ships: its tests run as it configures them, in a virtualenv of its
declared dependencies when it has any. Printed per repository: how its tests were found,
the interpreter, candidates, tasks accepted (train / held out), each gate's rejections with
an example reason, and the time; the candidates reports stay in the output folder.

The default three: ``jsonpointer`` (a unittest suite in ``tests.py``), ``python-slugify``
(a dependency, ``text-unidecode``, its tests need) and ``inflection`` (one pytest module at
the root).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, checked_output, machine_line

DEFAULT = ("jsonpointer==3.12", "python-slugify==9.2.0", "inflection==0.5.1")


def fetch(requirement: str, into: Path) -> Path:
    """The unpacked sdist of ``requirement`` under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
         ":all:", "--dest", str(into), requirement],
        check=True,
    )  # fmt: skip
    name = requirement.split("==")[0].replace("-", "_").lower()
    archive = next(
        p for p in into.glob("*.tar.gz") if p.name.lower().replace("-", "_").startswith(name)
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / archive.name[: -len(".tar.gz")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requirements", nargs="*", default=list(DEFAULT))
    parser.add_argument("--max-tasks", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/cr-bench-datagen-sdists"))
    args = parser.parse_args()
    check_count(args.max_tasks, "--max-tasks", what="tasks per repository")
    args.out = checked_output(args.out, "--out", directory=True)
    from composer_replication.datagen.feature_deletion import generate_tasks
    from composer_replication.sandbox.local import LocalSubprocessSandbox
    from composer_replication.sandbox.workdir import make_shared_tempdir

    print(machine_line())
    root = make_shared_tempdir("cr-bench-sdists-")
    args.out.mkdir(parents=True, exist_ok=True)
    for requirement in args.requirements:
        repo = fetch(requirement, root / "sdists")

        def factory(workdir: Path, **options: object) -> LocalSubprocessSandbox:
            return LocalSubprocessSandbox(workdir, exec_timeout_s=300, **options)

        started = time.perf_counter()
        report = generate_tasks(
            repo,
            root / "out" / repo.name / "tasks.jsonl",
            max_tasks=args.max_tasks,
            sandbox_factory=factory,
        )
        seconds = time.perf_counter() - started
        print(f"\n{requirement}: {report.candidates} candidates, {seconds:.0f} s")
        print(f"  tests: {report.test_command}  ({report.test_source})")
        print(f"  interpreter: {report.python or 'the sandbox default'}")
        print(f"  accepted: {report.accepted} ({report.train} train, {report.heldout} held out)")
        first: dict[str, str] = {}
        for qualname, gate, reason in report.rejections:
            first.setdefault(gate, f"{qualname}: {' '.join(reason.split())[:100]}")
        for gate, count in report.rejected.items():
            if count:
                print(f"  rejected at {gate}: {count}  e.g. {first[gate]}")
        kept = args.out / f"{repo.name}.candidates.jsonl"
        kept.write_text(Path(report.candidates_output).read_text())
        print(f"  every candidate: {kept}")


if __name__ == "__main__":
    main()
