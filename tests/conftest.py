"""Shared fixtures: the tiny model and the tokenizer, world-traversable temp dirs for
sandboxes, the FD fixture repo, a folder of kept start evaluations per test."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from composer_replication.model.cpu_threads import limit_thread_spinning

limit_thread_spinning()  # as every command does: tests run sandboxes beside torch too

import pytest  # noqa: E402

from composer_replication.sandbox.local import LocalSubprocessSandbox  # noqa: E402
from composer_replication.sandbox.workdir import make_shared_tempdir  # noqa: E402

FD_REPO = Path(__file__).resolve().parent / "fixtures" / "fd_repo"


@pytest.fixture(autouse=True)
def own_kept_evaluations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test keeps the start evaluations its runs measure to itself (``eval.reuse_start``):
    a test's run never reads one that another test's run kept."""
    from composer_replication.evals import start_reuse

    folder = tmp_path / "kept-evaluations"
    monkeypatch.setattr(start_reuse, "evaluations_dir", lambda: folder)
    return folder


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A 0755 temp dir the sandbox uid (nobody) can reach; pytest's tmp_path is 0700."""
    path = make_shared_tempdir("cr-datagen-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workdir(shared_dir: Path) -> Path:
    path = shared_dir / "work"
    path.mkdir()
    return path


@pytest.fixture
def fd_repo_copy(shared_dir: Path) -> Path:
    """A fresh copy of tests/fixtures/fd_repo named `fd_repo` (task ids contain the name)."""
    dest = shared_dir / "fd_repo"
    shutil.copytree(FD_REPO, dest, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return dest


@pytest.fixture
def sandbox_factory() -> Callable[[Path], LocalSubprocessSandbox]:
    def factory(path: Path) -> LocalSubprocessSandbox:
        return LocalSubprocessSandbox(path, exec_timeout_s=60)

    return factory


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer (the tiny model shares its vocabulary)."""
    from composer_replication.model.loading import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """(the tiny random Llama of seed 0 in eval mode, the tokenizer); one per test module,
    so a module may change it (most copy it first)."""
    from composer_replication.model.loading import tiny_model

    return tiny_model(seed=0).eval(), tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny random model with the real tokenizer, saved as a Hugging Face directory."""
    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tok = tiny_policy(seed=0)
    return str(save_checkpoint(model, tmp_path_factory.mktemp("tiny") / "model", tokenizer=tok))


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    """Three trace-replay pairs (JSONL) for runs whose algorithm trains on pairs."""
    import json

    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    rows = [
        {
            "state_id": f"s{i}",
            "state_messages": [{"role": "user", "content": f"write f{i}"}],
            "chosen": f"def f{i}(x):\n    return x + {i}",
            "rejected": f"def f{i}(x):\n    pass",
            "n_teachers_agreeing": 2,
        }
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
