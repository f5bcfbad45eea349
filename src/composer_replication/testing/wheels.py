"""Pure-Python wheels written directly (PEP 427), for offline wheelhouses in tests.

A wheelhouse of such wheels lets a repository's virtualenv be built with no index
(``sandbox.virtualenv``, ``--wheelhouse``): :func:`pure_wheel` writes a one-module
distribution; :func:`installed_wheel` packs a pure-Python distribution installed here (pytest,
a build backend) back into a wheel, and :func:`runner_wheels` does so for what every
repository environment needs offline: pytest with its requirements and setuptools.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import re
import zipfile
from pathlib import Path

__all__ = ["installed_wheel", "pure_wheel", "runner_wheels"]


def pure_wheel(
    house: Path, name: str, version: str, module: str, *, entry_points: str = ""
) -> Path:
    """A wheel of the one module ``name.py`` (text ``module``) in the directory ``house``;
    ``entry_points``: the text of its ``entry_points.txt`` (none when empty)."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": module,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: composer-replication\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = Path(house) / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{path},sha256={digest.decode()},{len(data)}"


def installed_wheel(house: Path, name: str) -> Path:
    """A wheel, in the directory ``house``, of the pure-Python distribution ``name`` as it
    is installed in this environment (its files as its ``RECORD`` lists them; scripts and
    bytecode left out: pip makes them again)."""
    dist = metadata.distribution(name)
    files: dict[str, bytes] = {}
    info = None
    for rel in dist.files or []:
        path = str(rel)
        if path.startswith("..") or "__pycache__" in path or path.endswith(".pyc"):
            continue
        top, _, rest = path.partition("/")
        if top.endswith(".dist-info") and rest == "RECORD":
            continue
        if top.endswith(".dist-info") and rest == "METADATA":
            info = top  # (a vendored package's .dist-info lies deeper)
        files[path] = Path(str(dist.locate_file(rel))).read_bytes()
    if info is None:
        raise ValueError(f"{name} is installed without a .dist-info folder")
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: composer-replication\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files.pop(f"{info}/INSTALLER", None)
    files.pop(f"{info}/direct_url.json", None)
    record = [_record_line(path, data) for path, data in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    stem = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    wheel = Path(house) / f"{stem}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def _requirements_here(root: str) -> list[str]:
    """``root`` and the distributions it requires as installed here (markers evaluated, no
    extras), by name."""
    from packaging.requirements import Requirement  # pytest's own dependency

    names: dict[str, str] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in names:
            continue
        names[key] = name
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(names.values())


def runner_wheels(house: Path) -> list[Path]:
    """Wheels of pytest, everything it requires here, and setuptools (the build backend of
    the test repositories), in ``house``: what a repository environment needs offline
    beyond the repository's own dependencies."""
    names = [*_requirements_here("pytest"), "setuptools"]
    return [installed_wheel(house, name) for name in names]
