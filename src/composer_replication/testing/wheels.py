"""Pure-Python wheels written directly (PEP 427), for offline wheelhouses in tests.

A wheelhouse of such wheels lets a repository's virtualenv be built with no index and no
build backend (``sandbox.virtualenv``, ``--wheelhouse``).
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

__all__ = ["pure_wheel"]


def pure_wheel(house: Path, name: str, version: str, module: str) -> Path:
    """A wheel of the one module ``name.py`` (text ``module``) in the directory ``house``."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": module,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: composer-replication\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
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
