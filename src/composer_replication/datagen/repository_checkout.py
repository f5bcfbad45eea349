"""A repository's tree at a commit, and patches applied to it.

One job: give the tree of a repository at a commit in a folder of its own, from a git
repository (worktree or bare; a checkout through an index of our own, never the working
tree, no history in the result), an archive (``ARCHIVE_SUFFIXES``) or a plain folder already
at that commit, and apply a unified diff to such a tree with ``git apply``. What cannot be
done raises `Rejected`, naming the gate (``gate1_repository``, or the one the caller gives
`apply_patch`) and git's or the archive's reason; `datagen.swe` records it for the instance.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from composer_replication.datagen.repository_copy import copy_repository
from composer_replication.sandbox.scrub import scrub_tree

__all__ = [
    "ARCHIVE_SUFFIXES",
    "GATE_REPOSITORY",
    "Rejected",
    "apply_patch",
    "is_git_repository",
    "locate_repository",
    "materialise",
]

GATE_REPOSITORY = "gate1_repository"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
# Seconds a git command may take (a checkout of a large repository included).
_GIT_TIMEOUT_S = 900


class Rejected(Exception):
    """An instance failed ``gate``: the import records it and goes on."""

    def __init__(self, gate: str, reason: str, instance_id: str | None = None) -> None:
        super().__init__(reason)
        self.gate = gate
        self.reason = reason
        self.instance_id = instance_id  # of a line that was read but is not an instance


def _git(
    args: Sequence[str],
    *,
    cwd: Path,
    stdin: bytes | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """git in ``cwd``, never looking for a repository above it, unaffected by the caller's
    ``GIT_*`` variables; ``env`` adds variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    clean["GIT_CEILING_DIRECTORIES"] = str(cwd.parent)
    clean["GIT_TERMINAL_PROMPT"] = "0"
    clean.update(env or {})
    # a repository the user names is theirs to read, whoever owns its folder
    argv = ["git", "-c", f"safe.directory={cwd}", *args]
    return subprocess.run(
        argv, cwd=cwd, input=stdin, capture_output=True, env=clean, timeout=_GIT_TIMEOUT_S
    )


def _message(proc: subprocess.CompletedProcess[bytes]) -> str:
    text = (proc.stderr or proc.stdout or b"").decode("utf-8", "replace").strip()
    return " | ".join(text.splitlines()[-6:]) or f"exit {proc.returncode}"


def is_git_repository(path: Path) -> bool:
    """``path`` is the top of a git repository (a worktree holding ``.git``, or a bare
    repository); a folder inside someone else's repository is not."""
    if not path.is_dir():
        return False
    try:
        return _git(["rev-parse", "--git-dir"], cwd=path).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def locate_repository(repo: str, repo_path: str | None, base_dir: Path, repos: Path | None) -> Path:
    """The repository (folder or archive) of an instance of ``repo`` ("owner/name"): its
    ``repo_path`` (relative to ``base_dir``, the instances file's folder), else
    ``repos/<owner>__<name>`` or ``repos/<name>``."""
    if repo_path:
        path = base_dir / Path(repo_path).expanduser()
        if not path.exists():
            raise Rejected(GATE_REPOSITORY, f"repo_path {repo_path!r} ({path}) does not exist")
        return path.resolve()
    if repos is None:
        raise Rejected(
            GATE_REPOSITORY,
            f"no repository for {repo!r}: the instance has no repo_path and no repos "
            "folder was given (--repos DIR)",
        )
    owner, _, name = repo.rpartition("/")
    parts = [p for p in (owner, name) if p]
    if not name or any(p in (".", "..") or "/" in p or os.sep in p for p in parts):
        raise Rejected(GATE_REPOSITORY, f"repo {repo!r} is not 'owner/name'")
    looked = [repos / f"{owner}__{name}"] if owner else []
    looked.append(repos / name)
    for path in looked:
        if is_git_repository(path):
            return path
    raise Rejected(
        GATE_REPOSITORY,
        f"no git repository for {repo!r} in {repos} (looked for "
        f"{' and '.join(p.name for p in looked)})",
    )


def materialise(
    source: Path, commit: str, dest: Path, scratch: Path, skip: Collection[Path] = ()
) -> None:
    """The tree of ``source`` at ``commit`` in ``dest``, scrubbed (no history); ``skip``:
    paths a plain folder's copy leaves out."""
    if source.is_dir():
        if is_git_repository(source):
            _checkout(source, commit, dest, scratch)
        else:  # a plain folder: taken as it is, at base_commit already
            try:
                copy_repository(source, dest, skip=skip)
            except (OSError, shutil.Error) as err:
                raise Rejected(GATE_REPOSITORY, f"cannot copy {source}: {err}") from None
    elif source.name.endswith(ARCHIVE_SUFFIXES):
        _extract(source, dest, scratch)
    else:
        raise Rejected(
            GATE_REPOSITORY,
            f"{source} is neither a folder nor an archive ({', '.join(ARCHIVE_SUFFIXES)})",
        )
    scrub_tree(dest)


def _checkout(repo: Path, commit: str, dest: Path, scratch: Path) -> None:
    """``commit``'s tree written to ``dest`` as a checkout writes it, through an index of
    our own (the repository's index, worktree and refs stay untouched)."""
    resolved = _git(["rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], cwd=repo)
    if resolved.returncode != 0:
        raise Rejected(GATE_REPOSITORY, f"commit {commit} does not exist in {repo}")
    sha = resolved.stdout.decode().strip()
    index = scratch / f"index-{dest.name}"
    dest.mkdir(parents=True)
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        for args in (["read-tree", sha], [f"--work-tree={dest}", "checkout-index", "-a", "-f"]):
            proc = _git(args, cwd=repo, env=env)
            if proc.returncode != 0:
                raise Rejected(
                    GATE_REPOSITORY, f"cannot check out {commit} of {repo}: {_message(proc)}"
                )
    except subprocess.TimeoutExpired:
        raise Rejected(GATE_REPOSITORY, f"checking out {commit} of {repo} timed out") from None
    finally:
        index.unlink(missing_ok=True)


def _extract(archive: Path, dest: Path, scratch: Path) -> None:
    """An archive's tree in ``dest`` (its one top folder, when it has nothing else)."""
    unpacked = scratch / f"unpack-{dest.name}"
    shutil.rmtree(unpacked, ignore_errors=True)
    unpacked.mkdir(parents=True)
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(unpacked)  # (drops absolute paths and '..' parts)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(unpacked, filter="data")  # no links or paths out of the tree
        entries = list(unpacked.iterdir())
        root = entries[0] if len(entries) == 1 and entries[0].is_dir() else unpacked
        shutil.move(str(root), dest)
    except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError) as err:
        raise Rejected(GATE_REPOSITORY, f"cannot extract {archive}: {err}") from None
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def apply_patch(tree: Path, patch: str, gate: str, what: str) -> list[str]:
    """Apply ``patch`` (a unified diff) to ``tree`` with ``git apply`` (a plain folder is
    fine); the files it writes, in patch order. A patch that does not apply rejects the
    instance at ``gate`` with git's message."""
    if not patch.strip():
        return []
    data = patch.encode("utf-8") if patch.endswith("\n") else (patch + "\n").encode("utf-8")
    try:
        listed = _git(["apply", "--numstat", "-z", "-"], cwd=tree, stdin=data)
        if listed.returncode == 0:
            applied = _git(["apply", "--whitespace=nowarn", "-"], cwd=tree, stdin=data)
        else:
            applied = listed
    except subprocess.TimeoutExpired:
        raise Rejected(gate, f"{what}: git apply timed out") from None
    if applied.returncode != 0:
        raise Rejected(gate, f"{what} does not apply: {_message(applied)}")
    # records "added\tdeleted\tpath", NUL-terminated (a rename gives its new path)
    records = listed.stdout.decode("utf-8", "surrogateescape").split("\0")
    paths = [r.split("\t", 2)[2] for r in records if r.count("\t") >= 2]
    return list(dict.fromkeys(p for p in paths if p))
