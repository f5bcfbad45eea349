"""Every shipped run config loads, validates, and the default one equals the built-in default."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_replication.config import RunConfig

RUNS = sorted((Path(__file__).parents[1] / "configs" / "runs").glob("*.toml"))


def test_a_run_config_for_every_algorithm():
    from composer_replication.algo import ALGORITHMS

    names = {p.stem for p in RUNS}
    assert set(ALGORITHMS) <= names
    assert {"default", "embedded_long"} <= names


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.stem)
def test_run_config_loads(path):
    cfg = RunConfig.from_toml(path)
    assert cfg.envs and cfg.steps >= 1
    # <type>.toml or <type>_<variant>.toml, except the jobs sized for a machine and the
    # agentic recipes (a warm start, then composer)
    if path.stem not in ("default", "embedded_long", "gpu", "agent", "agent_gpu", "agent_bugs"):
        algo = cfg.envs[0].algorithm.type
        assert path.stem == algo or path.stem.startswith(f"{algo}_")


def test_gpu_toml_is_the_composer_recipe_sized_for_one_gpu():
    cfg = RunConfig.from_toml(RUNS[[p.stem for p in RUNS].index("gpu")])
    env = cfg.envs[0]
    assert env.algorithm.type == "composer" and cfg.model.lora is None  # full fine-tune
    assert env.tasks_per_step * env.algorithm.sampling.group_size == 512
    assert env.algorithm.sampling.max_new_tokens == 256
    assert cfg.inference.decode_loop == "auto" and cfg.micro_batch_tokens >= 16384


def test_lora_switch_in_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nlora = false\n")
    assert RunConfig.from_toml(path).model.lora is None
    path.write_text("[model]\nlora = true\n")
    assert RunConfig.from_toml(path).model.lora.r == 16


def test_default_toml_is_the_builtin_default():
    assert RunConfig.from_toml(RUNS[[p.stem for p in RUNS].index("default")]) == RunConfig.default()


def test_overrides_and_errors(tmp_path):
    cfg = RunConfig.default(["steps=3", "optim.lr=0.001", "model.lora=null"])
    assert cfg.steps == 3 and cfg.optim.lr == 0.001 and cfg.model.lora is None
    with pytest.raises(ValueError, match=r"a\.b\.c=value"):
        RunConfig.default(["steps"])
    with pytest.raises(FileNotFoundError):
        RunConfig.from_toml(tmp_path / "missing.toml")
    with pytest.raises(ValueError):
        RunConfig.default(["no_such_field=1"])
    # Overrides inside the default environment list keep the rest of its defaults.
    cfg = RunConfig.default(["envs.0.algorithm.advantage.beta_replay=0.5"])
    default = RunConfig.default()
    assert cfg.envs[0].algorithm.advantage.beta_replay == 0.5
    assert cfg.envs[0].algorithm.sampling == default.envs[0].algorithm.sampling
    assert cfg.envs[0].tasks_per_step == default.envs[0].tasks_per_step
    with pytest.raises(ValueError, match="index 2 is out of range"):
        RunConfig.default(["envs.2.name=x"])


def test_a_star_override_sets_every_entry_of_a_list():
    bugs = Path(__file__).parents[1] / "configs" / "runs" / "agent_bugs.toml"
    cfg = RunConfig.from_toml(bugs, ["envs.*.options.repo=elsewhere", "envs.*.tasks_per_step=3"])
    assert [env.options["repo"] for env in cfg.envs] == ["elsewhere", "elsewhere"]
    assert [env.tasks_per_step for env in cfg.envs] == [3, 3]
    assert [env.options["kind"] for env in cfg.envs] == ["bugs", "bugs"]  # the rest kept
    with pytest.raises(ValueError, match="optim is not a list"):
        RunConfig.default(["optim.*.lr=1"])


def test_paths_in_a_config_are_relative_to_the_config_file(tmp_path, monkeypatch):
    from composer_replication.preflight import check_pairs_files

    monkeypatch.chdir(tmp_path)  # anywhere but the repository root
    shipped = RunConfig.from_toml(
        Path(__file__).parents[1] / "configs" / "runs" / "replay_dpo.toml"
    )
    assert Path(shipped.envs[0].algorithm.advantage.pairs_path).is_file()
    check_pairs_files(shipped)  # readable pairs: train would start from here
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "model").mkdir()
    (folder / "run.toml").write_text(
        'output_dir = "out"\n[model]\nsource = "model"\n[[envs]]\nname = "feature_deletion"\n'
        'options = {task_file = "fd/tasks.jsonl"}\n'
        'algorithm = {advantage = {type = "replay_dpo", pairs_path = "p.jsonl"}}\n'
    )
    cfg = RunConfig.from_toml(folder / "run.toml")
    assert cfg.envs[0].algorithm.advantage.pairs_path == str(folder / "p.jsonl")
    assert cfg.envs[0].options["task_file"] == str(folder / "fd" / "tasks.jsonl")
    assert cfg.model.source == str(folder / "model")  # it exists there
    assert cfg.output_dir == "out"  # where a run writes: the working directory's
    # a command-line override is the shell's, not the file's
    again = RunConfig.from_toml(folder / "run.toml", ["model.source=embedded"])
    assert again.model.source == "embedded"


def test_resume_needs_a_checkpoint_unless_resume_or_start(tmp_path):
    from composer_replication.common.errors import UsageError
    from composer_replication.preflight import check_resume

    cfg = RunConfig.default([f"output_dir={tmp_path / 'typo'}"])
    with pytest.raises(UsageError, match=r"no checkpoint in .*typo.*--resume-or-start"):
        check_resume(cfg)
    assert check_resume(cfg, or_start=True) is False
    step = tmp_path / "typo" / "checkpoints" / "step_000003"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"x")
    (step / "trainable.safetensors").write_bytes(b"x")
    assert check_resume(cfg) is True
    # a run that trained all its steps has nothing to continue: said, its record untouched
    (tmp_path / "typo" / "config.json").write_text('{"steps": 3}')
    finished = RunConfig.default([f"output_dir={tmp_path / 'typo'}", "steps=3"])
    for or_start in (False, True):
        with pytest.raises(UsageError, match=r"already trained 3 of steps = 3; raise steps"):
            check_resume(finished, or_start=or_start)
    assert (tmp_path / "typo" / "config.json").read_text() == '{"steps": 3}'


def test_engine_monarch_without_torchmonarch_is_one_usage_error(monkeypatch):
    import importlib.util

    from composer_replication.common.errors import UsageError
    from composer_replication.preflight import check_engine

    check_engine("monarch")  # installed here: nothing to say
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "monarch" else real(name, *a)
    )
    with pytest.raises(UsageError, match=r"pip install 'composer-replication\[monarch\]'"):
        check_engine("monarch")
    check_engine("in_process")  # needs nothing extra


def test_idle_steps_are_found_from_the_entries_ends_not_by_walking_every_step():
    from composer_replication.config.run import _idle_steps

    def walked(steps, spans):
        covered = [
            s
            for s in range(1, steps + 1)
            if any(a <= s and (b is None or s <= b) for a, b in spans)
        ]
        return [s for s in range(1, steps + 1) if s not in covered][:6]

    for steps, spans in [
        (10, [(1, 3), (6, None)]),
        (10, [(2, 4), (4, 8)]),
        (5, [(7, None)]),
        (12, [(1, 2), (1, None)]),
        (9, [(3, 3), (5, 6)]),
    ]:
        assert _idle_steps(steps, spans) == walked(steps, spans), (steps, spans)
    assert _idle_steps(10**9, [(1, 3)]) == [4, 5, 6, 7, 8, 9]  # instantly
    assert _idle_steps(10**9, [(1, None)]) == []


def test_a_config_sized_for_a_gpu_says_so_at_once_on_a_cpu():
    import torch

    from composer_replication.preflight import cpu_notice

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    gpu = RunConfig.from_toml(RUNS[[p.stem for p in RUNS].index("gpu")])
    notice = cpu_notice(gpu)
    assert notice is not None and "131,072 tokens a step" in notice and "\n" not in notice
    assert cpu_notice(RunConfig.default()) is None  # the default job is sized for a CPU
