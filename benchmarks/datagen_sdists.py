"""datagen on real repositories nobody here wrote: pip sdists with their tests, both kinds.

Run: ``python benchmarks/datagen_sdists.py [--kinds bugs,deletion] [--max-tasks 5]
[NAME==VERSION ...]`` (about an hour for the default fifteen on 2 CPU cores; the package
index is needed once, to download the sdists and build their environments). Each sdist is
downloaded with ``pip download --no-deps --no-binary NAME``, unpacked, and handed to
``generate_tasks`` as it ships: its tests run as it configures them, in the environment its
maintainers use (the repository installed from its work tree, its declared test
dependencies, pytest and its plugins), graded by per-test baselines.

Printed per repository and kind: candidates, accepted (and the share of the candidates
tried), rejections per gate with an example reason, the tests the baseline excluded and why,
and seconds per accepted task; then a summary line per kind (repositories with tasks, the
median acceptance). The candidates reports stay in ``--out``.

The default set covers the shapes a task factory meets: a src layout (packaging, pluggy,
iniconfig, humanize, cachetools, attrs, python-dateutil), a flat package (toolz,
more-itertools, boltons, idna, pathspec, tabulate, wcwidth) and a single module (six), tests
inside the package (toolz), unittest suites (cachetools, idna, pathspec), versions read with
``importlib.metadata`` or made by setuptools-scm / hatch-vcs (toolz, pluggy, humanize,
tabulate, attrs, python-dateutil), pytest plugins in ``addopts`` (wcwidth ``--cov``, humanize
``--doctest-modules`` with pytest-cov and pytest-benchmark), thread tests (more-itertools),
packages pytest itself imports (packaging, pluggy, iniconfig), and test dependencies in each
declared place: dependency groups (packaging, pluggy, iniconfig, toolz, boltons, attrs,
pathspec), a test extra (humanize), requirement files (more-itertools' ``requirements/``,
wcwidth's ``requirements-tests39.txt``) and tox ``deps`` (cachetools, tabulate,
python-dateutil).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_choices, check_count, checked_output, machine_line

DEFAULT = (
    "toolz==1.2.0",
    "more-itertools==11.2.1",
    "packaging==26.4",
    "wcwidth==0.9.4",
    "pluggy==1.7.0",
    "iniconfig==2.3.1",
    "humanize==4.17.0",
    "cachetools==8.0.2",
    "tabulate==0.10.0",
    "idna==3.20",
    "six==1.17.0",
    "python-dateutil==4.0.0",
    "boltons==26.2.0",
    "attrs==26.1.0",
    "pathspec==1.1.1",
)
KINDS = ("bugs", "deletion")


def fetch(requirement: str, into: Path) -> Path:
    """The unpacked sdist of ``requirement`` under ``into`` (downloaded once)."""
    into.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0]
    key = name.replace("-", "_").lower()

    def archive() -> Path | None:
        return next(
            (p for p in into.glob("*.tar.gz") if p.name.lower().replace("-", "_").startswith(key)),
            None,
        )

    if archive() is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             name, "--dest", str(into), requirement],
            check=True,
        )  # fmt: skip
    found = archive()
    assert found is not None, f"pip download left no sdist of {requirement} in {into}"
    folder = into / found.name[: -len(".tar.gz")]
    if not folder.is_dir():
        with tarfile.open(found) as tar:
            tar.extractall(into, filter="data")
    return folder


def report_lines(requirement: str, kind: str, report, seconds: float) -> list[str]:
    """What the benchmark prints of one generation."""
    tried = report.accepted + sum(report.rejected.values())
    share = report.accepted / tried if tried else 0.0
    per_task = seconds / report.accepted if report.accepted else float("nan")
    excluded = ", ".join(f"{n} {why}" for why, n in report.excluded.items()) or "none"
    uncovered = (
        "coverage unknown" if report.uncovered is None else f"{report.uncovered} not covered"
    )
    lines = [
        f"\n{requirement} [{kind}]: {report.candidates} candidates ({uncovered}), {tried} tried, "
        f"{report.accepted} accepted ({share:.0%}; {report.train} train, {report.heldout} "
        f"held out), {seconds:.0f} s, {per_task:.0f} s per accepted task",
        f"  tests: {report.test_command}  ({report.test_source})",
        f"  interpreter: {report.python or 'the sandbox default'}",
        f"  baseline: {report.baseline_passing} tests pass; excluded: {excluded}",
    ]
    first: dict[str, str] = {}
    for qualname, gate, reason in report.rejections:
        first.setdefault(gate, f"{qualname}: {' '.join(reason.split())[:140]}")
    for gate, count in report.rejected.items():
        if count:
            lines.append(f"  rejected at {gate}: {count}  e.g. {first[gate]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requirements", nargs="*", default=list(DEFAULT))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--max-tasks", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/cr-bench-datagen-sdists"))
    args = parser.parse_args()
    kinds = check_choices(args.kinds, "--kinds", KINDS)
    check_count(args.max_tasks, "--max-tasks", what="tasks per repository")
    args.out = checked_output(args.out, "--out", directory=True)
    from composer_replication.datagen.generation import generate_tasks
    from composer_replication.sandbox.local import LocalSubprocessSandbox
    from composer_replication.sandbox.workdir import make_shared_tempdir

    print(machine_line(), flush=True)
    root = make_shared_tempdir("cr-bench-sdists-")
    args.out.mkdir(parents=True, exist_ok=True)
    shares: dict[str, list[float]] = {kind: [] for kind in kinds}
    with_tasks: dict[str, int] = dict.fromkeys(kinds, 0)
    for requirement in args.requirements:
        repo = fetch(requirement, root / "sdists")
        for kind in kinds:

            def factory(workdir: Path, **options: object) -> LocalSubprocessSandbox:
                return LocalSubprocessSandbox(workdir, exec_timeout_s=300, **options)

            started = time.perf_counter()
            output = root / "out" / f"{repo.name}-{kind}" / "tasks.jsonl"
            report = generate_tasks(
                repo, output, max_tasks=args.max_tasks, sandbox_factory=factory, kind=kind
            )
            seconds = time.perf_counter() - started
            print("\n".join(report_lines(requirement, kind, report, seconds)), flush=True)
            tried = report.accepted + sum(report.rejected.values())
            shares[kind].append(report.accepted / tried if tried else 0.0)
            with_tasks[kind] += report.accepted > 0
            kept = args.out / f"{repo.name}-{kind}.candidates.jsonl"
            if Path(report.candidates_output).is_file():
                kept.write_text(Path(report.candidates_output).read_text())
    print()
    for kind in kinds:
        print(
            f"{kind}: tasks from {with_tasks[kind]} of {len(args.requirements)} repositories; "
            f"accepted share of the candidates tried: median {statistics.median(shares[kind]):.0%}, "
            f"lowest {min(shares[kind]):.0%}"
        )


if __name__ == "__main__":
    main()
