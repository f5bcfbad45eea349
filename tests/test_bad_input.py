"""Bad input across every command: each case exits with its documented code and one error
line naming the value, shows no traceback, and leaves every prepared file byte-identical
(and creates nothing). The cases run in process through the command line's entry point;
a few run as real processes, Ctrl-C among them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from composer_replication.cli import app
from composer_replication.common.errors import EXIT_INTERRUPTED, EXIT_NO_RESULT, EXIT_USAGE

TRACE_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "claude_code" / "projects"
SESSION = TRACE_FIXTURES / "-home-dev-calc" / "1f0c7a2e-5b1d-4c3e-9a7f-0d2e4b6c8a10.jsonl"
PRECIOUS = b'{"state_id": "keep me"}\n'
NO_CUDA = "model.device=cuda"


def _state(i: int) -> dict:
    return {
        "state_id": f"s{i}",
        "messages": [{"role": "user", "content": f"task s{i}"}],
        "student_action": "student answer",
    }


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace of inputs and prepared outputs every case must leave as they are."""
    from composer_replication.model.loading import save_checkpoint, tiny_policy

    root = tmp_path_factory.mktemp("bad_input")
    (root / "session.jsonl").write_bytes(SESSION.read_bytes())
    (root / "sessions").mkdir()
    (root / "sessions" / "a.jsonl").write_bytes(SESSION.read_bytes())
    states = [_state(i) for i in range(2)]
    (root / "states.jsonl").write_text("".join(json.dumps(s) + "\n" for s in states))
    rows = [
        {"state_id": s["state_id"], "teacher_slug": f"t{j}", "response_text": "x", "error": None}
        for s in states
        for j in range(3)
    ]
    (root / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("out.jsonl", "out.json", "out.toml", "tasks.jsonl"):
        (root / name).write_bytes(PRECIOUS)
    (root / "secret.jsonl").write_bytes(PRECIOUS)
    (root / "secret.jsonl").chmod(0o600)
    (root / "a_dir").mkdir()
    os.mkfifo(root / "fifo")
    (root / "link.jsonl").symlink_to(root / "out.jsonl")
    (root / "a_file").write_bytes(b"not a folder\n")
    (root / "empty.jsonl").write_bytes(b"")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (root / "binary.json").write_bytes(bytes(range(256)) * 8)
    (root / "binary.toml").write_bytes(bytes(range(256)) * 8)
    (root / "binary.yaml").write_bytes(bytes(range(256)) * 8)
    (root / "broken.yaml").write_text("process: [unclosed\n  - x: {")
    (root / "bad.toml").write_text("steps = [unclosed\n")
    (root / "steps0.toml").write_text("steps = 0\n")
    (root / "run.toml").write_text('steps = 1\n[model]\nsource = "tiny"\n')
    adv = 'type = "replay_dpo", pairs_path = "{}"'
    env = '[[envs]]\nname = "python_functions"\nalgorithm = {{advantage = {{{}}}}}\n'
    (root / "pairs_missing.toml").write_text(env.format(adv.format("no/pairs.jsonl")))
    (root / "pairs_binary.toml").write_text(env.format(adv.format("binary.bin")))
    (root / "pairs_empty.toml").write_text(env.format(adv.format("empty.jsonl")))
    dead = root / "dead.json"  # a teacher nobody answers for (connection refused)
    dead.write_text(
        json.dumps(
            [
                {
                    "slug": "t",
                    "input_per_mtok": 1,
                    "output_per_mtok": 1,
                    "base_url": "http://127.0.0.1:9/v1",
                }
            ]
        )
    )
    model, tokenizer = tiny_policy(seed=0)
    save_checkpoint(model, root / "tiny", tokenizer=tokenizer)
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "README").write_text("no config.json here\n")
    (root / "corrupt.gguf").write_bytes(b"NOTGGUF" + bytes(100))
    (root / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(16))
    (root / "repo").mkdir()  # a repository with no tests: gate 1 rejects it
    (root / "repo" / "mod.py").write_text("def f():\n    return 1\n")
    (root / "clash").mkdir()
    (root / "clash" / "tasks.workdirs").write_text("a file where the workdirs folder goes\n")
    (root / "empty_run").mkdir()
    step = root / "trunc_run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"PK\x03\x04 truncated")
    (step / "trainable.safetensors").write_bytes(b"\x08\x00")
    lora_step = root / "lora_run" / "checkpoints" / "step_000001"
    lora_step.mkdir(parents=True)
    (lora_step / "state.pt").write_bytes(b"x")
    (lora_step / "trainable.safetensors").write_bytes(b"x")
    (root / "lora_run" / "config.json").write_text(
        json.dumps({"model": {"lora": {"r": 4, "target_modules": ["q_proj"]}}})
    )
    (root / "rcache").mkdir()  # files other commands keep
    (root / "rcache" / "replay-cache.jsonl").write_text('{"key": "k", "row": {}}\n')
    (root / "done_run" / "final_model").mkdir(parents=True)
    (root / "done_run" / "config.json").write_text("{}")
    (root / "done_run" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (root / "grpo.toml").write_text(
        '[[envs]]\nname = "python_functions"\n[envs.algorithm.advantage]\ntype = "grpo"\n'
    )
    (root / "states").mkdir()  # DiLoCo run states that `diloco launch` did not write
    (root / "states" / "keyless.json").write_text('{"run_id": "keyless"}')
    (root / "states" / "garbage.json").write_bytes(b"\xff\xfe not json")
    (root / "states" / "list.json").write_text("[1, 2]")
    (root / "grpo_run.toml").write_text(
        'steps = 1\n[model]\nsource = "tiny"\n[[envs]]\nname = "python_functions"\n'
        '[envs.algorithm.advantage]\ntype = "grpo"\n'
    )
    (root / "sub").mkdir()  # a config whose model path is the working directory's
    (root / "sub" / "rel.toml").write_text('steps = 1\n[model]\nsource = "tiny"\n')
    (root / "gen").mkdir()
    (root / "gen" / "tasks.jsonl").write_text('{"file": "a.py", "task_id": "fd:r:a.py:f"}\n')
    configs = Path(__file__).resolve().parents[1] / "configs" / "runs"
    (root / "agent.toml").write_text((configs / "agent.toml").read_text())
    # a run of the default (python_functions, composer) with one checkpoint
    from composer_replication.config import RunConfig

    pf_step = root / "pf_run" / "checkpoints" / "step_000001"
    pf_step.mkdir(parents=True)
    (pf_step / "state.pt").write_bytes(b"x")
    (pf_step / "trainable.safetensors").write_bytes(b"x")
    recorded = RunConfig.default([f"output_dir={root / 'pf_run'}"]).model_dump(mode="json")
    (root / "pf_run" / "config.json").write_text(json.dumps(recorded))
    (root / "link_dir").symlink_to(root / "a_dir")  # an output folder that is a link
    (root / "linked_lock_run").mkdir()  # a lock file that links to another file
    (root / "linked_lock_run" / ".run.lock").symlink_to(root / "out.jsonl")
    (root / "dir_lock_run" / ".run.lock").mkdir(parents=True)
    (root / "syntax_repo" / "tests").mkdir(parents=True)  # its only module does not parse
    (root / "syntax_repo" / "calc.py").write_text("def add(a, b)\n    return a + b\n")
    (root / "syntax_repo" / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
    )
    return root


PACKAGE_INIT = Path(__file__).resolve().parents[1] / "src" / "composer_replication" / "__init__.py"

# (id, argv with {placeholders} for workspace paths, exit code, text the error line names)
CASES: list[tuple[str, str, int, str]] = [
    # ingest
    ("ingest-into-its-input", "ingest {session.jsonl} -o {session.jsonl}", 2, "is the input"),
    ("ingest-into-input-folder", "ingest {sessions} -o {sessions}/s.jsonl", 2, "input folder"),
    ("ingest-missing-input", "ingest {nothing.jsonl} -o {out.jsonl}", 2, "nothing.jsonl"),
    ("ingest-into-a-dir", "ingest {session.jsonl} -o {a_dir}", 2, "is a directory"),
    ("ingest-into-a-fifo", "ingest {session.jsonl} -o {fifo}", 2, "is a FIFO"),
    ("ingest-into-a-device", "ingest {session.jsonl} -o /dev/null", 2, "character device"),
    ("ingest-into-a-link", "ingest {session.jsonl} -o {link.jsonl}", 2, "symbolic link"),
    ("ingest-under-a-file", "ingest {session.jsonl} -o {a_file}/s.jsonl", 2, "a_file"),
    ("ingest-empty", "ingest {empty.jsonl} -o {out.jsonl}", 1, "empty.jsonl"),
    ("ingest-binary", "ingest {binary.bin} -o {secret.jsonl}", 1, "binary.bin"),
    (
        "ingest-history-0",
        "ingest {session.jsonl} -o {out.jsonl} --max-history-tokens 0",
        2,
        "--max-history-tokens",
    ),
    # replay
    ("replay-into-its-input", "replay {states.jsonl} -o {states.jsonl}", 2, "is the input"),
    ("replay-missing-input", "replay {nothing.jsonl} -o {out.jsonl}", 2, "nothing.jsonl"),
    ("replay-empty", "replay {empty.jsonl} -o {out.jsonl}", 1, "empty.jsonl"),
    ("replay-binary", "replay {binary.bin} -o {out.jsonl}", 1, "binary.bin"),
    (
        "replay-unknown-teacher",
        "replay {states.jsonl} -o {out.jsonl} --teachers no/such",
        2,
        "no/such",
    ),
    (
        "replay-missing-teachers",
        "replay {states.jsonl} -o {out.jsonl} --teachers {t.json}",
        2,
        "t.json",
    ),
    (
        "replay-binary-teachers",
        "replay {states.jsonl} -o {out.jsonl} --teachers {binary.json}",
        2,
        "binary.json",
    ),
    (
        "replay-all-calls-fail",
        "replay {states.jsonl} -o {secret.jsonl} --teachers {dead.json} "
        "--no-cache --max-retries 0 --timeout 2",
        1,
        "every one of the 2 teacher calls failed",
    ),
    (
        "replay-zero-budget",
        "replay {states.jsonl} -o {out.jsonl} --teachers {dead.json} --no-cache --max-usd 0",
        1,
        "every one of the 2 teacher calls failed",
    ),
    ("replay-negative-budget", "replay {states.jsonl} -o {out.jsonl} --max-usd -1", 2, "--max-usd"),
    (
        "replay-nan-budget",
        "replay {states.jsonl} -o {out.jsonl} --teachers {dead.json} --max-usd nan",
        2,
        "--max-usd",
    ),
    (
        "replay-concurrency-0",
        "replay {states.jsonl} -o {out.jsonl} --concurrency 0",
        2,
        "--concurrency",
    ),
    ("replay-into-a-dir", "replay {states.jsonl} -o {a_dir}", 2, "is a directory"),
    ("replay-into-a-fifo", "replay {states.jsonl} -o {fifo}", 2, "is a FIFO"),
    # pairs
    (
        "pairs-into-states",
        "pairs {results.jsonl} --states {states.jsonl} -o {states.jsonl}",
        2,
        "is the input",
    ),
    (
        "pairs-into-results",
        "pairs {results.jsonl} --states {states.jsonl} -o {results.jsonl}",
        2,
        "is the input",
    ),
    (
        "pairs-missing-results",
        "pairs {nothing.jsonl} --states {states.jsonl} -o {out.jsonl}",
        2,
        "nothing.jsonl",
    ),
    (
        "pairs-missing-states",
        "pairs {results.jsonl} --states {nothing.jsonl} -o {out.jsonl}",
        2,
        "nothing.jsonl",
    ),
    (
        "pairs-binary-results",
        "pairs {binary.bin} --states {states.jsonl} -o {out.jsonl}",
        1,
        "binary.bin",
    ),
    (
        "pairs-threshold-0",
        "pairs {results.jsonl} --states {states.jsonl} -o {out.jsonl} --threshold 0",
        2,
        "--threshold",
    ),
    (
        "pairs-none-agree",
        "pairs {results.jsonl} --states {states.jsonl} -o {out.jsonl} --threshold 99",
        1,
        "out.jsonl",
    ),
    (
        "pairs-into-a-link",
        "pairs {results.jsonl} --states {states.jsonl} -o {link.jsonl}",
        2,
        "symbolic link",
    ),
    (
        "pairs-missing-recipe",
        "pairs {results.jsonl} --states {states.jsonl} -o {out.jsonl} "
        "--normalize --recipe {no.yaml}",
        2,
        "no.yaml",
    ),
    (
        "pairs-binary-recipe",
        "pairs {results.jsonl} --states {states.jsonl} -o {out.jsonl} "
        "--normalize --recipe {binary.yaml}",
        2,
        "binary.yaml",
    ),
    (
        "pairs-broken-recipe",
        "pairs {results.jsonl} --states {states.jsonl} -o {out.jsonl} "
        "--normalize --recipe {broken.yaml}",
        2,
        "broken.yaml",
    ),
    # datagen
    ("datagen-missing-repo", "datagen {no_repo} -o {tasks.jsonl}", 2, "no_repo"),
    ("datagen-into-a-dir", "datagen {repo} -o {a_dir}", 2, "is a directory"),
    ("datagen-into-a-device", "datagen {repo} -o /dev/null", 2, "character device"),
    ("datagen-into-a-fifo", "datagen {repo} -o {fifo}", 2, "is a FIFO"),
    ("datagen-into-a-link", "datagen {repo} -o {link.jsonl}", 2, "symbolic link"),
    ("datagen-max-tasks-0", "datagen {repo} -o {tasks.jsonl} --max-tasks 0", 2, "--max-tasks"),
    ("datagen-workdirs-a-file", "datagen {repo} -o {clash}/tasks.jsonl", 2, "tasks.workdirs"),
    ("datagen-no-task-passes", "datagen {repo} -o {tasks.jsonl}", 1, "tasks.jsonl"),
    # eval
    ("eval-typo", "eval embeded", 2, "did you mean 'embedded'"),
    ("eval-not-a-model", "eval {not_a_model}", 2, "not_a_model"),
    ("eval-missing-model", "eval {nowhere}/model", 2, "nowhere"),
    ("eval-corrupt-gguf", "eval {corrupt.gguf}", 2, "corrupt.gguf"),
    ("eval-truncated-gguf", "eval {truncated.gguf}", 2, "truncated.gguf"),
    ("eval-unknown-env", "eval {tiny} --env nosuchenv", 2, "nosuchenv"),
    ("eval-env-without-tasks", "eval {tiny} --env feature_deletion", 2, "feature_deletion"),
    ("eval-bad-split", "eval {tiny} --split bogus", 2, "bogus"),
    ("eval-heldout-fraction-2", "eval {tiny} --heldout-fraction 2", 2, "--heldout-fraction"),
    ("eval-heldout-fraction-nan", "eval {tiny} --heldout-fraction nan", 2, "--heldout-fraction"),
    ("eval-bad-suite", "eval {tiny} --suite bogus", 2, "bogus"),
    ("eval-infinite-temperature", "eval {tiny} --temperature inf", 2, "--temperature"),
    ("eval-samples-0", "eval {tiny} --samples 0", 2, "--samples"),
    ("eval-humaneval-with-env", "eval {tiny} --suite humaneval --env x", 2, "--env"),
    ("eval-into-a-dir", "eval {tiny} -o {a_dir}", 2, "is a directory"),
    ("eval-into-the-model", "eval {tiny} -o {tiny}/config.json", 2, "input folder"),
    # smoke
    ("smoke-missing-model", "smoke --model no/such/dir", 2, "no/such/dir"),
    ("smoke-not-a-model", "smoke --model {not_a_model}", 2, "not_a_model"),
    ("smoke-steps-0", "smoke --steps 0", 2, "--steps"),
    ("smoke-nan-lr", "smoke --model {tiny} --lr nan", 2, "--lr"),
    # train: config and paths
    ("train-binary-config", "train {binary.toml}", 2, "binary.toml"),
    ("train-bad-toml", "train {bad.toml}", 2, "bad.toml"),
    ("train-missing-config", "train {nothing.toml}", 2, "nothing.toml"),
    ("train-set-without-key", "train --set =5", 2, "'=5'"),
    ("train-steps-0", "train --set steps=0", 2, "steps"),
    ("train-infinite-lr", "train --set optim.lr=1e999", 2, "optim.lr"),
    (
        "diloco-status-unknown-run",
        "diloco status nosuchrun --state-dir {empty_run}",
        2,
        "nosuchrun",
    ),
    ("diloco-logs-no-runs", "diloco logs --state-dir {empty_run}", 2, "no DiLoCo runs"),
    ("diloco-status-keyless-state", "diloco status keyless --state-dir {states}", 2, "lacks"),
    ("diloco-cancel-keyless-state", "diloco cancel keyless --state-dir {states}", 2, "lacks"),
    ("diloco-logs-keyless-state", "diloco logs keyless --state-dir {states}", 2, "keyless.json"),
    ("diloco-status-garbage-state", "diloco status garbage --state-dir {states}", 2, "garbage"),
    ("diloco-status-list-state", "diloco status list --state-dir {states}", 2, "JSON object"),
    ("diloco-state-dir-a-file", "diloco status x --state-dir {a_file}", 2, "not a directory"),
    ("diloco-cancel-state-dir-a-file", "diloco cancel --state-dir {a_file}", 2, "not a directory"),
    (
        "diloco-cancel-unknown-run",
        "diloco cancel nosuchrun --state-dir {empty_run}",
        2,
        "nosuchrun",
    ),
    (
        "train-custom-loss-unimportable",
        "train --set loss.type=custom --set loss.import_path=no_such_module:rl",
        2,
        "no_such_module:rl",
    ),
    ("train-custom-loss-without-path", "train --set loss.type=custom", 2, "loss.import_path"),
    ("train-nan-betas", "train --set optim.betas=[NaN,NaN]", 2, "optim.betas"),
    (
        "train-unknown-advantage",
        "train --set advantage.type=nosuch",
        2,
        "advantage: type 'nosuch' is neither a built-in algorithm",
    ),
    ("train-betas-out-of-range", "train --set optim.betas=[5,-1]", 2, "optim.betas"),
    ("train-infinite-weight-decay", "train --set optim.weight_decay=1e999", 2, "weight_decay"),
    ("train-infinite-grad-clip", "train --set optim.grad_clip=1e999", 2, "grad_clip"),
    (
        "train-infinite-eval-temperature",
        "train --set eval.temperature=1e999",
        2,
        "eval.temperature",
    ),
    (
        "train-nan-sampling-temperature",
        "train --set envs.0.algorithm.sampling.temperature=NaN",
        2,
        "sampling.temperature",
    ),
    ("train-cuda-without-gpu", f"train --set {NO_CUDA}", 2, "model.device"),
    ("train-unknown-env", "train --set envs.0.name=nosuchenv", 2, "nosuchenv"),
    ("train-env-module-missing", "train --set envs.0.name=no_such_pkg:make", 2, "no_such_pkg"),
    ("train-missing-model", "train --set model.source=no/such/dir", 2, "no/such/dir"),
    ("train-output-dir-a-file", "train --output-dir {a_file}", 2, "a_file"),
    ("train-output-dir-a-device", "train --output-dir /dev/null", 2, "/dev/null"),
    ("train-pairs-missing", "train {pairs_missing.toml}", 2, "no/pairs.jsonl"),
    ("train-pairs-binary", "train {pairs_binary.toml}", 2, "binary.bin"),
    ("train-pairs-empty", "train {pairs_empty.toml}", 2, "empty.jsonl"),
    ("train-bad-backend", "train --backend bogus", 2, "bogus"),
    (
        "train-resume-and-resume-or-start",
        "train --resume --resume-or-start",
        2,
        "--resume-or-start",
    ),
    ("train-resume-nothing", "train --resume --output-dir {empty_run}", 2, "empty_run"),
    (
        "train-resume-other-lora",
        "train --resume --output-dir {lora_run} --set model.lora.r=8",
        2,
        "model.lora.r: 4 in the checkpoint's run, 8 in this config",
    ),
    # train: found once the run has started (the tiny model loads first)
    (
        "train-resume-truncated",
        "train --resume --output-dir {trunc_run} --set model.source={tiny}",
        2,
        "state.pt",
    ),
    (
        "train-tasks-per-step-1e9",
        "train --output-dir {new_run} --set model.source={tiny} --set envs.0.tasks_per_step=1e9",
        2,
        "tasks_per_step",
    ),
    # export
    ("export-missing-config", "export prime-rl {nothing.toml}", 2, "nothing.toml"),
    ("export-into-a-dir", "export prime-rl {run.toml} -o {a_dir}", 2, "is a directory"),
    ("export-into-its-input", "export prime-rl {run.toml} -o {run.toml}", 2, "is the input"),
    ("export-into-a-device", "export prime-rl {run.toml} -o /dev/null", 2, "character device"),
    ("export-binary-config", "export prime-rl {binary.toml}", 2, "binary.toml"),
    ("export-invalid-value", "export prime-rl {steps0.toml} -o {out.toml}", 2, "steps"),
    ("export-seq-len-0", "export prime-rl {run.toml} --seq-len 0", 2, "seq_len = 0"),
    # settings that cannot work, said in one line
    (
        "train-unknown-env-option",
        "train --output-dir {new_run} --set model.source={tiny} --set envs.0.options.bogus=1",
        2,
        "has no option 'bogus'",
    ),
    (
        "train-missing-fd-task-file",
        "train --output-dir {new_run} --set model.source={tiny} --set envs.0.name=feature_deletion"
        " --set envs.0.options.task_file={nothing.jsonl}",
        2,
        "does not exist",
    ),
    (
        "train-heldout-fraction-leaves-none",
        "train --output-dir {new_run} --set model.source={tiny} --set heldout_fraction=0.0001",
        2,
        "0 held-out tasks",
    ),
    ("train-tracker-not-installed", 'train --set trackers=["wandb"]', 2, "pip install wandb"),
    (
        "train-run-level-advantage-ignored",
        "train {grpo.toml} --set advantage.type=sdpo",
        2,
        "has an advantage of its own",
    ),
    ("train-advantage-field-alone", "train --set advantage.alpha_sdpo=-1", 2, "advantage.type"),
    ("eval-infinite-timeout", "eval {tiny} --timeout inf", 2, "--timeout"),
    ("train-source-relative-to-cwd", "train {sub}/rel.toml", 2, "relative to the file's folder"),
    ("train-name-too-long", "train --output-dir {a_dir}/" + "n" * 300, 2, "path too long"),
    (
        "train-path-too-long",
        "train --output-dir {a_dir}/" + "/".join(["p" * 200] * 25),
        2,
        "path too long (5",
    ),
    # an engine that cannot be had: said before anything loads
    (
        "train-dead-engine-url",
        "train --set inference.engine=vllm --set inference.url=http://127.0.0.1:9",
        2,
        "connection refused",
    ),
    (
        "train-engine-without-its-venv",
        "train --set inference.engine=vllm --set inference.python={nothing}/bin/python",
        2,
        "make vllm-env",
    ),
    # files another command keeps are never an output
    (
        "replay-into-its-cache",
        "replay {states.jsonl} -o {rcache}/replay-cache.jsonl",
        2,
        "teacher-replay cache",
    ),
    ("ingest-into-a-runs-metrics", "ingest {session.jsonl} -o {done_run}/metrics.jsonl", 2, "run"),
    (
        "ingest-into-a-final-model",
        "ingest {session.jsonl} -o {done_run}/final_model/x.jsonl",
        2,
        "record of the run",
    ),
    ("ingest-into-a-task-file", "ingest {session.jsonl} -o {gen}/tasks.jsonl", 2, "generation"),
    ("export-into-the-source", f"export prime-rl {{run.toml}} -o {PACKAGE_INIT}", 2, "own files"),
    # outputs never replace inputs (issue: the repository's own files, the instances file)
    ("datagen-into-its-repository", "datagen {repo} -o {repo}/mod.py", 2, "inside the input"),
    ("datagen-tasks-into-the-repository", "datagen {repo} -o {repo}/t.jsonl", 2, "input folder"),
    (
        "import-tasks-onto-its-instances",
        "import-tasks {states.jsonl} -o {states.jsonl}",
        2,
        "input",
    ),
    (
        "datagen-a-module-that-does-not-parse",
        "datagen {syntax_repo} -o {new_gen}/t.jsonl --environment system",
        1,
        "calc.py does not parse (line 1: expected ':')",
    ),
    ("datagen-unknown-kind", "datagen {repo} -o {new_gen}/t.jsonl --kind bug", 2, "--kind 'bug'"),
    (
        "datagen-unknown-bug-kind",
        "datagen {repo} -o {new_gen}/t.jsonl --kind bugs --bug-kinds flip,off_by_one",
        2,
        "--bug-kinds flip",
    ),
    # a lock file of another kind is never opened, let alone written through
    ("train-lock-file-is-a-link", "train --output-dir {linked_lock_run}", 2, "a symbolic link"),
    ("train-lock-file-is-a-folder", "train --output-dir {dir_lock_run}", 2, "is a directory"),
    ("train-output-dir-is-a-link", "train --output-dir {link_dir}", 2, "is a symbolic link"),
    # resume checks what it resumes
    (
        "train-resume-another-algorithm",
        "train {grpo.toml} --output-dir {pf_run} --resume",
        2,
        "envs.0.algorithm.type: 'composer' in the checkpoint's run, 'grpo' in this config",
    ),
    (
        "train-resume-two-environments",
        "train {agent.toml} --output-dir {pf_run} --resume",
        2,
        "number of envs: 1 in the checkpoint's run, 2 in this config",
    ),
    (
        "train-resume-another-environment",
        "train --output-dir {pf_run} --resume --set envs.0.name=feature_deletion"
        " --set envs.0.options.task_file={gen}/tasks.jsonl",
        2,
        "envs.0.name: 'python_functions' in the checkpoint's run, 'feature_deletion'",
    ),
    (
        "train-resume-other-heldout-split",
        "train --output-dir {pf_run} --resume --set heldout_salt=other",
        2,
        "heldout_salt",
    ),
    # an agent recipe's options, checked before anything loads
    (
        "train-agent-unknown-tool",
        'train {agent.toml} --output-dir {new_run} --set envs.0.options.tools=["read_file","bogus","finish"]',
        2,
        "unknown tools ['bogus']",
    ),
    (
        "train-agent-tools-without-finish",
        'train {agent.toml} --output-dir {new_run} --set envs.0.options.tools=["read_file"]',
        2,
        "have no finish",
    ),
    (
        "train-agent-zero-turns",
        "train {agent.toml} --output-dir {new_run} --set envs.1.options.max_turns=0",
        2,
        "max_turns = 0: give an integer >= 1",
    ),
    (
        "train-agent-repo-nowhere",
        "train {agent.toml} --output-dir {new_run} --set envs.0.options.repo={nothing}",
        2,
        "is neither a folder nor a shipped repository",
    ),
    (
        "train-agent-repo-is-a-file",
        "train {agent.toml} --output-dir {new_run} --set envs.0.options.repo={a_file}",
        2,
        "is a file, not a repository",
    ),
    (
        "train-agent-repo-without-tests",
        "train {agent.toml} --output-dir {new_run} --set envs.0.options.repo={repo}",
        2,
        "no test modules found",
    ),
    (
        "train-agent-unknown-task-kind",
        "train {agent.toml} --output-dir {new_run} --set envs.0.options.kind=bug",
        2,
        "envs.0.options.kind = 'bug': use deletion or bugs",
    ),
    # paths the system cannot hold, folders that are files, settings every rank would refuse
    ("ingest-name-too-long", "ingest {session.jsonl} -o {a_dir}/" + "n" * 300, 2, "path too long"),
    (
        "ingest-path-too-long",
        "ingest {session.jsonl} -o {a_dir}/" + "/".join(["p" * 200] * 25) + "/x.jsonl",
        2,
        "path too long",
    ),
    (
        "replay-cache-dir-is-a-file",
        "replay {states.jsonl} -o {new_out}/r.jsonl --cache-dir {a_file}",
        2,
        "--cache-dir",
    ),
    (
        "replay-cache-dir-unwritable",
        "replay {states.jsonl} -o {new_out}/r.jsonl --cache-dir /proc/1/replay-cache",
        2,
        "is not writable",
    ),
    (
        "diloco-state-dir-is-a-file",
        "diloco launch {grpo.toml} --state-dir {a_file}",
        2,
        "not a directory",
    ),
    (
        "train-ranks-sampling-ahead",
        "train --nproc 2 --set inference.async_level=1 --output-dir {new_run}",
        2,
        "runs in one process only",
    ),
    # numbers bounded before anything loops over them
    (
        "train-steps-astronomical",
        "train --output-dir {new_run} --set steps=99999999999999999999999999",
        2,
        "steps: Input should be less than or equal to 1000000000",
    ),
    (
        "train-group-astronomical",
        "train --output-dir {new_run} --set envs.0.algorithm.sampling.group_size=10000000000",
        2,
        "less than or equal to 1000000",
    ),
    # the top level
    ("unknown-command", "trian", 2, "trian"),
    ("unknown-option", "ingest {session.jsonl} -o {out.jsonl} --bogus", 2, "--bogus"),
]


def _argv(template: str, ws: Path) -> list[str]:
    return [re.sub(r"\{([^}]+)\}", lambda m: str(ws / m[1]), p) for p in template.split()]


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root``: a file's bytes (a digest) and mode, a link's target, a
    FIFO as such, a folder as such; a change anywhere, or a new entry, shows."""
    seen: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        key = str(path.relative_to(root))
        if stat.S_ISLNK(st.st_mode):
            seen[key] = ("link", os.readlink(path))
        elif stat.S_ISREG(st.st_mode) and st.st_size > 1 << 20:  # the model's weights
            seen[key] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode)
        elif stat.S_ISREG(st.st_mode):
            seen[key] = (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mode)
        else:
            seen[key] = ("special", stat.S_IFMT(st.st_mode), st.st_mode)
    return seen


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.lower().startswith("error:")]


@pytest.mark.parametrize(
    ("argv", "code", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_one_line_and_changes_nothing(ws, argv, code, needle):
    if NO_CUDA in argv:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    before = _snapshot(ws)
    cwd = os.getcwd()
    os.chdir(ws)  # relative names (model.source=tiny) resolve in the workspace
    try:
        result = CliRunner().invoke(app, _argv(argv, ws))
    finally:
        os.chdir(cwd)
    shown = result.output + (result.stderr if result.stderr not in result.output else "")
    assert result.exit_code == code, shown
    assert result.exception is None or isinstance(result.exception, SystemExit), shown
    assert "Traceback" not in shown
    errors = _error_lines(result.stderr)
    assert len(errors) == 1, shown
    assert needle in errors[0], errors[0]
    assert _snapshot(ws) == before, "a prepared file changed, or something was created"


@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("COMPOSER_REPLICATION_CACHE", "{a_file}", "is a regular file, not a directory"),
        ("COMPOSER_REPLICATION_CACHE", "/proc/1/cr-cache", "is not writable"),
    ],
)
def test_a_cache_the_embedded_model_cannot_be_kept_in_is_one_line(ws, variable, value, needle):
    before = _snapshot(ws)
    result = CliRunner().invoke(app, ["smoke"], env={variable: value.format(a_file=ws / "a_file")})
    assert result.exit_code == EXIT_USAGE, result.output
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert "Traceback" not in result.output
    assert _snapshot(ws) == before


def test_the_corpus_is_broad():
    commands = {c[1].split()[0] for c in CASES}
    assert len(CASES) >= 60
    assert {"ingest", "replay", "pairs", "datagen", "eval", "smoke", "train", "export"} <= commands
    assert {c[2] for c in CASES} == {EXIT_NO_RESULT, EXIT_USAGE}


def _run(argv: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "composer_replication", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


@pytest.mark.integration
def test_real_processes_exit_with_the_code_and_one_line(ws):
    before = _snapshot(ws)
    for template, code, needle in (
        ("ingest {session.jsonl} -o {session.jsonl}", EXIT_USAGE, "is the input"),
        ("eval embeded", EXIT_USAGE, "did you mean 'embedded'"),
        ("train --set optim.betas=[5,-1]", EXIT_USAGE, "optim.betas"),
        ("ingest {empty.jsonl} -o {out.jsonl}", EXIT_NO_RESULT, "empty.jsonl"),
    ):
        done = _run(_argv(template, ws), ws)
        assert done.returncode == code, done.stderr
        assert "Traceback" not in done.stderr + done.stdout
        errors = _error_lines(done.stderr)
        assert len(errors) == 1 and needle in errors[0], done.stderr
    # an export to a stdout that cannot take it says so, never exit 0 with nothing written
    export = [sys.executable, "-m", "composer_replication", "export", "prime-rl"]
    export.append(str(ws / "grpo_run.toml"))
    closed = subprocess.run(
        ["bash", "-c", 'exec "$@" >&-', "_", *export],
        cwd=ws, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    with open("/dev/full", "w") as full:
        filled = subprocess.run(
            export, cwd=ws, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120
        )
    for done, code, needle in (
        (closed, EXIT_USAGE, "stdout is closed"),
        (filled, EXIT_NO_RESULT, "No space left on device"),
    ):
        assert done.returncode == code, done.stderr
        assert "Traceback" not in done.stderr + (done.stdout or "")
        errors = _error_lines(done.stderr)
        assert len(errors) == 1 and needle in errors[0], done.stderr
    assert _snapshot(ws) == before


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_says_where_the_checkpoint_is_and_how_to_resume(ws, tmp_path):
    run = tmp_path / "run"
    settings = [
        "steps=1000",
        "checkpoint.every=1",
        "eval.at_start=false",
        "eval.every=1000",
        "envs.0.tasks_per_step=1",
        "envs.0.algorithm.sampling.group_size=2",
        "envs.0.algorithm.sampling.max_new_tokens=8",
        "model.lora.r=2",
        f"model.source={ws / 'tiny'}",
    ]
    argv = ["train", *(a for s in settings for a in ("--set", s)), "--output-dir", str(run)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_replication", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it: a test run started in the background by a
        # non-interactive shell inherits SIGINT ignored, and so would the command
        preexec_fn=_sigint_default,
    )
    deadline = time.monotonic() + 120
    # a finished checkpoint (one being written is a step_*.tmp-* sibling until renamed)
    while (
        not [p for p in run.glob("checkpoints/step_*") if ".tmp-" not in p.name]
        and time.monotonic() < deadline
    ):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err + out
    (line,) = [x for x in err.splitlines() if x.startswith("Interrupted")]
    assert f"the last checkpoint is {run}/checkpoints/step_" in line
    assert line.endswith(f"--output-dir {run} --resume")
    # the printed command continues the run (one more step from the checkpoint)
    steps = int(line.split("step_")[1].split(";")[0])
    resume = line.split("continue with: composer-replication ")[1].split()
    done = _run([a if a != "steps=1000" else f"steps={steps + 1}" for a in resume], ws)
    assert done.returncode == 0, done.stderr
    assert (run / "checkpoints" / f"step_{steps + 1:06d}").is_dir()


# ------------------------------------------------------------------ benchmarks
# Every script under benchmarks/ refuses bad command-line input as the commands do: before
# any work (no model loads), one line on stderr naming the option, the value and the fix,
# exit code 2, no traceback, and no output written. In the arguments, {tmp} is the test's
# empty folder (every output pointing there must stay unwritten), {self} the script itself
# and {bench} the benchmarks folder (existing inputs).
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARK_CASES = [
    # gpu.py
    ("gpu-steps-1", "gpu.py --steps 1 --json {tmp}/g.json", "--steps 1: give steps >= 2"),
    ("gpu-steps-negative", "gpu.py --steps -3", "--steps -3: give steps >= 2"),
    ("gpu-out-is-a-link", "gpu.py --out /proc/self/cwd", "--out '/proc/self/cwd' is a symbolic"),
    ("gpu-steps-not-int", "gpu.py --steps two", "argument --steps: invalid int value: 'two'"),
    ("gpu-heldout-nan", "gpu.py --heldout nan", "--heldout nan: give minutes, finite"),
    ("gpu-heldout-inf", "gpu.py --heldout inf", "--heldout inf: give minutes, finite"),
    ("gpu-ablation-negative", "gpu.py --ablation -1", "--ablation -1.0: give minutes"),
    ("gpu-sections-unknown", "gpu.py --sections train,bogus", "unknown 'bogus'; use some of"),
    ("gpu-sections-empty", "gpu.py --sections ,", "--sections ',': names nothing"),
    ("gpu-json-itself", "gpu.py --json {self}", "writing it would destroy what is read"),
    ("gpu-json-directory", "gpu.py --json {tmp}", "is a directory; pass a file path (--json"),
    ("gpu-profile-file", "gpu.py --profile {self}", "--profile '{self}' is a regular file"),
    (
        "gpu-device-unknown",
        "gpu.py --device bogus --profile {tmp}/profile --json {tmp}/g.json",
        "--device 'bogus': use cuda, cuda:N or cpu",
    ),
    (
        "gpu-tokenizer-missing",
        "gpu.py --random-weights --tokenizer {tmp}/tok",
        "--tokenizer '{tmp}/tok': does not exist",
    ),
    ("gpu-tokenizer-file", "gpu.py --quick --tokenizer {self}", "is not a folder"),
    # main_job.py
    ("main-seconds-nan", "main_job.py ablation --seconds nan", "--seconds nan: give seconds"),
    (
        "main-seconds-zero",
        "main_job.py ablation --seconds 0 --out {tmp}/ablation",
        "--seconds 0.0: give seconds, finite and > 0",
    ),
    ("main-seed-negative", "main_job.py ablation --seed -1", "--seed -1: give a seed >= 0"),
    (
        "main-algorithm-unknown",
        "main_job.py ablation --algorithms grpo bogus --out {tmp}/ablation",
        "--algorithms 'bogus': use some of grpo",
    ),
    (
        "main-algorithm-needs-settings",
        "main_job.py ablation --algorithms opd --out {tmp}/ablation",
        "--algorithms 'opd': the default job cannot run it: opd needs a frozen teacher",
    ),
    ("main-seeds-negative", "main_job.py seeds --seeds 0 -2 --out {tmp}/s", "--seeds -2"),
    ("main-config-missing", "main_job.py seeds --config {tmp}/run.toml", "no such file"),
    ("main-out-file", "main_job.py seeds --out {self}", "is a regular file, not a directory"),
    ("main-plot-out-missing", "main_job.py plot --out {tmp}/runs", "no such folder"),
    ("main-plot-png-directory", "main_job.py plot --out {tmp} --png {tmp}", "is a directory"),
    ("main-plot-png-source", "main_job.py plot --out {bench} --png {self}", "is the input"),
    (
        "main-plot-base-greedy",
        "main_job.py plot --out {tmp} --base-greedy 1.5",
        "--base-greedy 1.5: give a pass@1, finite and between 0 and 1",
    ),
    # datagen_sdists.py
    ("datagen-max-tasks", "datagen_sdists.py --max-tasks 0", "--max-tasks 0: give tasks"),
    ("datagen-out-file", "datagen_sdists.py --out {self}", "not a directory"),
    ("datagen-out-link", "datagen_sdists.py --out /proc/self/cwd", "is a symbolic link"),
    ("datagen-kinds-unknown", "datagen_sdists.py --kinds bug", "unknown 'bug'"),
    # bugfix_ceiling.py
    ("ceiling-tasks-missing", "bugfix_ceiling.py --task-file {tmp}/t.jsonl", "no such file"),
    ("ceiling-tasks-folder", "bugfix_ceiling.py --task-file {bench}", "is not a regular file"),
    (
        "ceiling-tokens-zero",
        "bugfix_ceiling.py --task-file {self} --max-new-tokens 0",
        "--max-new-tokens 0: give tokens >= 1",
    ),
    ("ceiling-batch-zero", "bugfix_ceiling.py --task-file {self} --batch 0", "--batch 0"),
    # cpu_threads.py
    ("threads-rows-zero", "cpu_threads.py --rows 0", "--rows 0: give a whole number >= 1"),
    ("threads-rows-huge", "cpu_threads.py --rows 1000", "--rows 1000: give a number"),
    ("threads-tokens-zero", "cpu_threads.py --new-tokens 0", "--new-tokens 0"),
    ("threads-out-link", "cpu_threads.py --out /proc/self/cwd", "is a symbolic link"),
    # cpu_precision.py
    (
        "precision-repeats-zero",
        "cpu_precision.py --repeats 0",
        "--repeats 0: give a whole number >= 1",
    ),
    ("precision-tasks-zero", "cpu_precision.py --tasks 0", "--tasks 0: give a whole number >= 1"),
    ("precision-seed-negative", "cpu_precision.py --seeds -1", "--seeds -1: give seeds >= 0"),
    ("precision-out-link", "cpu_precision.py --job --out /proc/self/cwd", "is a symbolic link"),
    # agent_episodes.py
    ("agent-episodes-zero", "agent_episodes.py --episodes 0", "--episodes 0: give episodes"),
    ("agent-turns-negative", "agent_episodes.py --turns -1", "--turns -1: give tool calls"),
    ("agent-fast-nan", "agent_episodes.py --fast nan", "--fast nan: give seconds, finite"),
    ("agent-slow-negative", "agent_episodes.py --slow -2", "--slow -2.0: give seconds"),
    ("agent-decode-tokens", "agent_episodes.py --decode-tokens 0", "--decode-tokens 0"),
    # data_parallel.py
    ("dp-sequences-one", "data_parallel.py --sequences 1", "one per rank"),
    ("dp-seq-len-short", "data_parallel.py --seq-len 32", "--seq-len 32: give tokens >= 33"),
    ("dp-steps-zero", "data_parallel.py --steps 0", "--steps 0: give timed steps >= 1"),
    # decode_bound.py
    ("decode-rows-zero", "decode_bound.py --rows 0", "--rows 0: give rows >= 1"),
    ("decode-repeats-negative", "decode_bound.py --repeats -1", "--repeats -1"),
    ("decode-threads-zero", "decode_bound.py --threads 0", "--threads 0: give threads >= 1"),
    # losses.py
    ("losses-parts-unknown", "losses.py --parts c", "--parts 'c': use a, b or ab"),
    ("losses-ops-unknown", "losses.py --ops ce,bogus", "use some of logprobs,ce,jsd"),
    ("losses-repeats-zero", "losses.py --repeats 0", "--repeats 0: give timed calls >= 1"),
    # replay.py
    ("replay-states-zero", "replay.py --states 0", "--states 0: give states >= 1"),
    ("replay-teachers-zero", "replay.py --teachers 0", "--teachers 0: give teachers >= 1"),
    ("replay-latency-inf", "replay.py --latency inf", "--latency inf: give seconds, finite"),
    ("replay-latency-zero", "replay.py --latency 0", "--latency 0.0: give seconds"),
    ("replay-concurrency-zero", "replay.py --concurrency 0", "--concurrency 0"),
    ("replay-max-usd-nan", "replay.py --max-usd nan", "--max-usd nan: give a spending cap"),
    # sample_ahead.py
    ("ahead-steps-one", "sample_ahead.py --steps 1", "--steps 1: give steps >= 2"),
    ("ahead-config-missing", "sample_ahead.py --config {tmp}/run.toml", "no such file"),
    ("ahead-out-directory", "sample_ahead.py --out {tmp}", "is a directory"),
    # step_regression.py
    ("regression-steps-one", "step_regression.py --steps 1", "--steps 1: give steps >= 2"),
    ("regression-rounds-zero", "step_regression.py --rounds 0", "--rounds 0: give rounds"),
    ("regression-baseline", "step_regression.py --baseline nosuchrev", "no such revision"),
    # sampling.py
    ("sampling-tokens-zero", "sampling.py --max-new-tokens 0", "--max-new-tokens 0"),
    ("sampling-eval-tasks-zero", "sampling.py --eval-tasks 0", "--eval-tasks 0: give tasks"),
    ("sampling-eval-tasks-many", "sampling.py --eval-tasks 100000", "give at most"),
    ("sampling-eval-batch-zero", "sampling.py --eval-batch 0", "--eval-batch 0: give rows"),
    ("sampling-loop-steps", "sampling.py --loop-steps -1", "--loop-steps -1: give steps >= 0"),
    ("sampling-level", "sampling.py --optimization-level 7", "use 0, 1, 2 or 3"),
    (
        "sampling-engine-python-missing",
        "sampling.py --engine --engine-python {tmp}/python",
        "--engine-python '{tmp}/python': no such file",
    ),
    # train_step.py
    ("train-step-n-seq", "train_step.py --n-seq 0", "--n-seq 0: give sequences >= 1"),
    ("train-step-seq-len", "train_step.py --seq-len 64", "--seq-len 64: give tokens >= 65"),
    ("train-step-repeats", "train_step.py --composer --repeats 0", "--repeats 0"),
    # trl_vs_native.py
    ("trl-steps-zero", "trl_vs_native.py --steps 0", "--steps 0: give steps >= 1"),
    ("trl-group-one", "trl_vs_native.py --group 1", "--group 1: give completions per prompt"),
    ("trl-tokens-zero", "trl_vs_native.py --tokens 0", "--tokens 0: give tokens >= 1"),
    ("trl-micro-batch", "trl_vs_native.py --micro-batch-tokens 0", "--micro-batch-tokens 0"),
    ("trl-mmap-threshold", "trl_vs_native.py --mmap-threshold -2", "give -1 (dynamic) or 0"),
]


@pytest.mark.parametrize(
    ("args", "needle"),
    [pytest.param(args, needle, id=case) for case, args, needle in BENCHMARK_CASES],
)
def test_benchmark_bad_input_is_one_line(tmp_path, args, needle):
    name, *rest = args.split()
    script = str(BENCHMARKS / name)
    where = {"tmp": tmp_path, "self": script, "bench": BENCHMARKS}
    argv = [arg.format(**where) for arg in rest]
    proc = subprocess.run(
        [sys.executable, script, *argv],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert needle.format(**where) in last, proc.stderr
    assert list(tmp_path.iterdir()) == []  # no output was written, no folder made


def test_every_benchmark_with_options_has_bad_input_cases():
    covered = {args.split()[0] for _, args, _ in BENCHMARK_CASES}
    with_options = {
        p.name
        for p in BENCHMARKS.glob("*.py")
        if "type=int" in p.read_text() or "type=float" in p.read_text()
    }
    assert with_options <= covered, sorted(with_options - covered)
