"""The engine's parts that run without the engine: config checks, the server's command
line and environment, its start-up failure report, and the weights the sync writes."""

from __future__ import annotations

import sys

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from composer_replication.config.inference import inference_config
from composer_replication.config.run import RunConfig
from composer_replication.inference.engine import (
    build_inference_engine,
    build_policy_engine,
    engine_model_dir,
)
from composer_replication.inference.in_process import InProcessEngine
from composer_replication.inference.server import (
    EXTENSION_DIR,
    EngineServer,
    EngineStartError,
    server_argv,
    server_env,
)
from composer_replication.inference.weight_sync import engine_state_dict, write_weights
from composer_replication.model.loading import tiny_model


def test_config_defaults_and_errors():
    assert RunConfig.default().inference.engine == "in_process"
    cfg = RunConfig.default(["inference.engine=vllm", "inference.port=8123"]).inference
    assert (cfg.engine, cfg.port) == ("vllm", 8123)
    with pytest.raises(ValidationError, match="must start with http"):
        inference_config(engine="vllm", url="127.0.0.1:8000")
    with pytest.raises(ValidationError, match="command is empty"):
        inference_config(engine="vllm", command=[])
    with pytest.raises(
        ValidationError,
        match=r"inference\.engine must be 'in_process', 'vllm' or 'package\.module:factory'",
    ):
        inference_config(engine="sglang")


def test_each_engine_keeps_its_own_settings():
    """Shared settings on both, the decode loop's only in process, the server's only on
    vLLM; the other engine's setting is refused in one line naming the engine it is for."""
    from composer_replication.common.errors import user_error

    in_process = RunConfig.default(["inference.decode_loop=static", "inference.async_level=1"])
    assert type(in_process.inference).__name__ == "InProcessInferenceConfig"
    assert (in_process.inference.decode_loop, in_process.inference.async_level) == ("static", 1)
    assert not hasattr(in_process.inference, "url")
    vllm = RunConfig.from_toml('[inference]\nengine = "vllm"\nport = 8123\nasync_level = 2\n')
    assert type(vllm.inference).__name__ == "VllmInferenceConfig"
    assert (vllm.inference.port, vllm.inference.async_level) == (8123, 2)
    assert not hasattr(vllm.inference, "decode_loop")
    assert RunConfig.model_validate(vllm.model_dump()) == vllm  # round trip keeps the engine
    with pytest.raises(ValidationError) as wrong:
        RunConfig.default(["inference.url=http://127.0.0.1:8000"])
    line = user_error(wrong.value)
    assert "\n" not in line
    assert "inference.url is a setting of engine = 'vllm', not of engine = 'in_process'" in line
    with pytest.raises(ValidationError) as wrong:
        RunConfig.default(["inference.engine=vllm", "inference.sync_every=4"])
    line = user_error(wrong.value)
    assert "inference.sync_every is a setting of engine = 'in_process'" in line
    assert "not of engine = 'vllm'" in line


def test_in_process_builds_the_in_process_engine(tmp_path):
    from composer_replication.inference.decoding.generate import DecodeOptions

    policy = tiny_model(seed=0)
    config = inference_config(decode_loop="general", sync_every=5, compile_decode=True)
    engine = build_inference_engine(
        config, policy=policy, model_source="embedded", run_dir=tmp_path
    )
    assert isinstance(engine, InProcessEngine)
    assert engine.sampler.model is policy
    assert engine.sampler.decode == DecodeOptions(loop="general", sync_every=5, compile=True)
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_model_dir_must_be_a_plain_hf_dir(tmp_path):
    with pytest.raises(ValueError, match="plain Hugging Face directory"):
        engine_model_dir(str(tmp_path / "model.gguf"))
    (tmp_path / "config.json").write_text("{}")
    assert engine_model_dir(str(tmp_path)) == tmp_path


def test_server_command_line_binds_loopback_and_loads_the_extension(tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    cfg = inference_config(engine="vllm", python=str(python), extra_args=["--seed", "3"])
    argv = server_argv(cfg, "/models/m", 8555)
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "8555"
    assert flags["--model"] == "/models/m"
    assert flags["--worker-extension-cls"] == "composer_weight_sync.WeightSyncExtension"
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert argv[-2:] == ["--seed", "3"]
    env = server_env(cfg)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(EXTENSION_DIR)
    assert (EXTENSION_DIR / "composer_weight_sync.py").is_file()


def test_missing_engine_python_names_the_fix(tmp_path):
    cfg = inference_config(engine="vllm", python=str(tmp_path / "nope" / "python"))
    with pytest.raises(FileNotFoundError, match="make vllm-env"):
        server_argv(cfg, "/m", 1)


def test_server_that_dies_reports_its_log_tail(tmp_path):
    script = "import sys; print('engine failed: no such model', flush=True); sys.exit(3)"
    cfg = inference_config(
        engine="vllm", command=[sys.executable, "-c", script], startup_timeout_s=60
    )
    server = EngineServer(cfg, tmp_path, log_path=tmp_path / "engine.log")
    with pytest.raises(EngineStartError, match="exited with code 3") as info:
        server.start()
    assert "engine failed: no such model" in str(info.value)
    assert server.process is None


def test_server_that_never_answers_times_out_and_is_killed(tmp_path):
    script = "import time; print('loading', flush=True); time.sleep(600)"
    cfg = inference_config(
        engine="vllm", command=[sys.executable, "-c", script], startup_timeout_s=2
    )
    server = EngineServer(cfg, tmp_path, log_path=tmp_path / "engine.log")
    with pytest.raises(EngineStartError, match="not healthy after 2 s") as info:
        server.start()
    assert "loading" in str(info.value)
    assert server.process is None


def test_engine_state_dict_plain_model_drops_tied_duplicate():
    model = tiny_model()  # tied embeddings, as SmolLM2
    state = engine_state_dict(model)
    assert "lm_head.weight" not in state
    assert torch.equal(state["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert len(state) == len(model.state_dict()) - 1


def test_engine_state_dict_of_lora_policy_is_merged_under_hf_names(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = tiny_model()
    plain_names = set(engine_state_dict(base))
    lora = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    with torch.no_grad():  # a non-zero adapter, so merging changes q_proj
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    before = layer.base_layer.weight.detach().clone()
    expected = before + layer.get_delta_weight("default")
    path = write_weights(lora, tmp_path, version=3)
    assert path.name == "policy-v3.safetensors"
    state = load_file(str(path))
    assert set(state) == plain_names
    torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.weight"], expected)
    assert torch.equal(layer.base_layer.weight, before)  # the trainer's weights are untouched


def test_adapter_sync_turns_on_runtime_lora_at_a_supported_rank(tmp_path):
    cfg = inference_config(engine="vllm", command=["serve"], lora_sync="adapter", max_lora_rank=12)
    server = EngineServer(cfg, tmp_path, log_path=tmp_path / "log")
    argv = server_argv(cfg, tmp_path, 1, lora_rank=server.lora_rank)
    i = argv.index("--enable-lora")
    assert argv[i : i + 5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"]
    merged = inference_config(engine="vllm", command=["serve"])
    assert EngineServer(merged, tmp_path, log_path=tmp_path / "log").lora_rank is None
    assert "--enable-lora" not in server_argv(merged, tmp_path, 1)


def test_write_adapter_checks_rank_and_needs_a_lora_policy(tmp_path):
    from peft import LoraConfig, get_peft_model

    from composer_replication.inference.weight_sync import write_adapter

    with pytest.raises(ValueError, match="needs a LoRA policy"):
        write_adapter(tiny_model(), tmp_path, 1, max_rank=16)
    lora = get_peft_model(tiny_model(), LoraConfig(r=32, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"r=32 is above inference\.max_lora_rank=16"):
        write_adapter(lora, tmp_path, 1, max_rank=16)
    path = write_adapter(lora, tmp_path, 4, max_rank=32)
    assert path.name == "policy-v4"
    assert {p.name for p in path.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}


def _build_on_rank(rank: int, store_path: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    # both ranks connected before either can fail fast and close its end of the mesh
    dist.barrier()
    try:
        cfg = inference_config(engine="vllm")
        build_policy_engine(cfg, model_source=model_dir, run_dir=out_dir)
        message = "built"
    except ValueError as err:
        message = str(err)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.txt", "w") as fh:
        fh.write(message)


def test_engine_refuses_several_training_ranks(tmp_path):
    import torch.multiprocessing as mp

    (tmp_path / "config.json").write_text("{}")
    mp.spawn(
        _build_on_rank,
        args=(str(tmp_path / "store"), str(tmp_path), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "with 2 training ranks" in text, text


def test_frozen_models_given_by_local_path_are_found_once(tmp_path):
    from composer_replication.config.run import RunConfig
    from composer_replication.inference.frozen import FrozenEngines, local_frozen_paths

    toml = f"""
output_dir = "{tmp_path}"
[inference]
engine = "vllm"
[[envs]]
name = "python_functions"
[envs.algorithm.advantage]
type = "opd"
model = {{ name = "t", local_path = "embedded" }}
[[envs]]
name = "feature_deletion"
[envs.algorithm.sampling]
source = {{ name = "t", local_path = "embedded" }}
[envs.algorithm.advantage]
type = "sft"
"""
    config = RunConfig.from_toml(toml)
    assert local_frozen_paths(config.envs) == ["embedded"]
    assert FrozenEngines.wanted(config.inference, config.envs)
    in_process = RunConfig.from_toml(
        toml.replace('engine = "vllm"', 'engine = "vllm"\nserve_frozen = false')
    )
    assert not FrozenEngines.wanted(in_process.inference, in_process.envs)
    gguf = RunConfig.from_toml(toml.replace('"embedded"', f'"{tmp_path / "m.gguf"}"'))
    with pytest.raises(ValueError, match="serve_frozen = false"):
        FrozenEngines(gguf.inference, gguf.envs, log_dir=tmp_path).start()
