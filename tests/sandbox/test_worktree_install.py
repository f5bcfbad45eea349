"""worktree_install: a repository's wheel reduced to its metadata, the work tree's import roots
found, build-generated files found, the path hook and the pretended VCS version."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import zipfile
from pathlib import Path

from composer_replication.sandbox.worktree_install import (
    PATH_HOOK_MODULE,
    build_environment,
    generated_files,
    import_roots,
    source_version,
    strip_to_metadata,
    wheel_dist_info,
    wheel_extras,
    wheel_top_level,
    write_path_hook,
)


def _wheel(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in members.items():
            zf.writestr(name, text)
    return path


def test_a_wheels_import_names_metadata_and_extras(tmp_path: Path) -> None:
    wheel = _wheel(
        tmp_path / "pkg-1.0-py3-none-any.whl",
        {
            "pkg/__init__.py": "",
            "pkg/sub/mod.py": "",
            "helper.py": "",
            "pkg-1.0.dist-info/METADATA": "Name: pkg\nVersion: 1.0\nProvides-Extra: test\n"
            "Provides-Extra: docs\n",
            "pkg-1.0.data/scripts/tool": "",
            "pkg.pth": "",
        },
    )
    assert wheel_dist_info(wheel) == "pkg-1.0.dist-info"
    assert wheel_top_level(wheel) == ["helper", "pkg"]
    assert wheel_extras(wheel) == ["test", "docs"]


def test_import_roots_of_flat_and_src_layouts(tmp_path: Path) -> None:
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "tool.py").write_text("")
    (tmp_path / "tests" / "pkg").mkdir(parents=True)  # a test folder of that name is no root
    assert import_roots(tmp_path, ["pkg", "tool", "missing"]) == ("src", ".")


def test_generated_files_are_what_the_wheel_has_and_the_tree_lacks(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "src" / "pkg").mkdir(parents=True)
    (repo / "src" / "pkg" / "__init__.py").write_text("")
    wheel = _wheel(
        tmp_path / "pkg-1.0-py3-none-any.whl",
        {
            "pkg/__init__.py": "",
            "pkg/_version.py": "version = '1.0'\n",
            "pkg/_speedups.cpython-311-x86_64-linux-gnu.so": "binary",
            "pkg-1.0.dist-info/METADATA": "Name: pkg\n",
        },
    )
    found = generated_files(wheel, repo, import_roots(repo, wheel_top_level(wheel)))
    assert found == {
        "src/pkg/_version.py": b"version = '1.0'\n",
        "src/pkg/_speedups.cpython-311-x86_64-linux-gnu.so": b"binary",
    }


def test_strip_to_metadata_keeps_the_dist_info_and_scripts_only(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = "pkg-1.0.dist-info"
    files = {
        "pkg/__init__.py": "SECRET = 1\n",
        "pkg/__pycache__/__init__.cpython-311.pyc": "x",
        "pkg/data/table.txt": "x",
        "shared/other.py": "kept: another distribution's file\n",
        f"{info}/METADATA": "Name: pkg\n",
        f"{info}/entry_points.txt": "[console_scripts]\npkg = pkg:main\n",
    }
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    rows = [
        ["pkg/__init__.py", "sha256=a", "11"],
        ["pkg/__pycache__/__init__.cpython-311.pyc", "", ""],
        ["pkg/data/table.txt", "sha256=b", "1"],
        [f"{info}/METADATA", "sha256=c", "10"],
        [f"{info}/entry_points.txt", "sha256=d", "30"],
        ["../../../bin/pkg", "sha256=e", "200"],
        [f"{info}/RECORD", "", ""],
    ]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    (site / info / "RECORD").write_text(text.getvalue())
    removed = strip_to_metadata(site, info)
    assert removed == [
        "pkg/__init__.py",
        "pkg/__pycache__/__init__.cpython-311.pyc",
        "pkg/data/table.txt",
    ]
    assert not (site / "pkg").exists()  # the code is gone, folders and all
    assert (site / "shared" / "other.py").is_file()
    kept = list(csv.reader(io.StringIO((site / info / "RECORD").read_text())))
    assert [row[0] for row in kept] == [
        f"{info}/METADATA",
        f"{info}/entry_points.txt",
        "../../../bin/pkg",
        f"{info}/RECORD",
    ]


def test_the_path_hook_puts_the_named_work_trees_roots_on_the_path(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    write_path_hook(site, ["src", "."])
    tree = tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]); "
        "print('\\n'.join(p for p in sys.path if p.startswith(sys.argv[2])))"
    )
    for env, cwd in (({"COMPOSER_REPLICATION_WORKTREE": str(tree)}, tmp_path), ({}, tree)):
        done = subprocess.run(
            [sys.executable, "-c", code, str(site), str(tree)],
            env={"PATH": "/usr/bin:/bin", **env},
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
        lines = done.stdout.split()
        assert lines[-2:] == [str(tree / "src"), str(tree)], done.stdout
    assert (site / f"{PATH_HOOK_MODULE}.pth").read_text() == f"import {PATH_HOOK_MODULE}\n"


def test_an_sdist_without_history_builds_with_its_recorded_version(tmp_path: Path) -> None:
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: p\nVersion: 3.2.1\n")
    assert source_version(tmp_path) == "3.2.1"
    assert build_environment(tmp_path) == {"SETUPTOOLS_SCM_PRETEND_VERSION": "3.2.1"}
    (tmp_path / ".git").mkdir()  # history: the backend derives the version itself
    assert source_version(tmp_path) is None and build_environment(tmp_path) == {}
