"""The policy sampler on the real vLLM engine (CPU build, its own virtualenv) serving the
embedded SmolLM2: token ids in and out with the trainer's log-probs, rollouts that reach
the trainer exactly as sampled, and a versioned weight sync after an optimizer step that
makes the engine's log-probs equal the trainer's again.

Skipped only when the engine's virtualenv is absent (``make vllm-env`` builds it;
``make test`` does so first)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from composer_replication.algo import AlgorithmConfig, build_algorithm
from composer_replication.config.inference import inference_config
from composer_replication.inference.engine import PolicyEngine
from composer_replication.model.loading import embedded_model_dir, load_policy
from composer_replication.samples.generation import SamplingSettings
from composer_replication.samples.wire import pack_samples
from composer_replication.training.step import train_step

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(
    os.environ.get("COMPOSER_REPLICATION_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python")
)
# fp32 on both sides; the engine's CPU attention and matmul kernels differ from torch's
# eager ones in summation order only
LOGPROB_ATOL = 2e-3

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        not ENGINE_PYTHON.exists(),
        reason=f"the engine's virtualenv is absent ({ENGINE_PYTHON}); build it with `make vllm-env`",
    ),
]


@pytest.fixture(scope="module")
def policy_and_tokenizer():
    model, tokenizer = load_policy(None)
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("engine-run")
    config = inference_config(
        engine="vllm",
        python=str(ENGINE_PYTHON),
        max_model_len=1024,
        optimization_level=0,  # no compilation: the tests need a quick start, not throughput
        startup_timeout_s=600,
    )
    with PolicyEngine(config, model_dir=embedded_model_dir(), run_dir=run_dir, seed=11) as eng:
        eng.sampler  # noqa: B018 - starts the server
        yield eng


def _prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _trainer_logprobs(model, prompt, completion, temperature=1.0) -> torch.Tensor:
    """log softmax(logits / T) of each completion token, from one plain forward."""
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _engine_run(
    tmp_path,
    engine,
    *,
    steps: int = 1,
    eval_every: int = 10,
    max_new_tokens: int = 24,
    inference: str = "",
    advantage: str = 'type = "grpo"',
):
    """A run config for the native loop on the embedded model (full fine-tune) that
    samples through ``engine``'s server (by url): one python_functions task x 2 per step."""
    from composer_replication.config import RunConfig

    return RunConfig.from_toml(
        f'''
seed = 0
steps = {steps}
output_dir = "{tmp_path / "run"}"
[model]
source = "embedded"
[optim]
lr = 1e-5
[eval]
at_start = false
every = {eval_every}
max_tasks = 1
samples_per_task = 1
[guard]
min_steps = 100
[checkpoint]
every = 100
[inference]
engine = "vllm"
url = "{engine.server.base_url}"
{inference}
[[envs]]
name = "python_functions"
tasks_per_step = 1
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = {max_new_tokens}
[envs.algorithm.advantage]
{advantage}
''',
        overrides=["model.lora=null"],
    )


def test_sampled_ids_and_logprobs_match_the_trainer(engine, policy_and_tokenizer):
    model, tokenizer = policy_and_tokenizer
    model.eval()
    prompt = _prompt(tokenizer, "Write a Python function that returns the square of x.")
    for temperature in (1.0, 0.7):
        settings = SamplingSettings(max_new_tokens=20, temperature=temperature)
        gens = engine.sampler.sample_batch(tokenizer, [prompt, prompt], settings)
        assert len(gens) == 2
        for gen in gens:
            assert gen.prompt_ids == prompt
            assert 1 <= len(gen.completion_ids) == len(gen.logprobs) <= 20
            assert gen.metadata["policy_version"] == 0
            expected = _trainer_logprobs(model, prompt, gen.completion_ids, temperature)
            got = torch.tensor(gen.logprobs, dtype=torch.float64)
            assert (got - expected).abs().max().item() < LOGPROB_ATOL
    greedy = engine.sampler.sample_batch(
        tokenizer, [prompt], SamplingSettings(max_new_tokens=12, temperature=0.0)
    )[0]
    logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert greedy.completion_ids[0] == int(logits.argmax())


def test_environment_rollouts_reach_the_trainer_exactly_as_sampled(engine, policy_and_tokenizer):
    from composer_replication.envs.python_functions import PythonFunctionsEnv

    _, tokenizer = policy_and_tokenizer
    sampled = []

    class Recording:  # the real engine sampler, with a record of what it returned
        samples_from_live_policy = True

        def sample_batch(self, tok, prompts, settings, *, max_rows=None, on_row_done=None):
            gens = engine.sampler.sample_batch(
                tok, prompts, settings, max_rows=max_rows, on_row_done=on_row_done
            )
            sampled.extend(gens)
            return gens

    env = PythonFunctionsEnv()
    task_id = env.task_ids()[0]
    (group,) = env.rollouts(
        Recording(),
        tokenizer,
        [task_id],
        group_size=2,
        sampling=SamplingSettings(max_new_tokens=48, temperature=1.0),
    )
    assert len(group) == len(sampled) == 2
    for rollout, gen in zip(group, sampled):
        assert rollout.prompt_ids == gen.prompt_ids
        assert rollout.completion_ids == gen.completion_ids
        assert rollout.inference_logprobs == gen.logprobs
    group[0].reward, group[1].reward = 1.0, 0.0
    samples = build_algorithm(AlgorithmConfig(advantage={"type": "grpo"})).process_group(group)
    (batch,) = pack_samples(samples, max_tokens=4096, pad_id=tokenizer.pad_token_id, split=None)
    for row, gen in enumerate(sampled):
        n = len(gen.prompt_ids) + len(gen.completion_ids)
        assert batch.input_ids[row, :n].tolist() == [*gen.prompt_ids, *gen.completion_ids]
        mask = batch.loss_mask[row, :n].bool()
        assert batch.input_ids[row, :n][mask].tolist() == gen.completion_ids
        assert batch.inference_logprobs[row, :n][mask].tolist() == pytest.approx(gen.logprobs)


def test_weight_sync_makes_engine_logprobs_equal_the_trained_policy(engine, policy_and_tokenizer):
    model, tokenizer = policy_and_tokenizer
    prompt = _prompt(tokenizer, "Write a Python function that reverses a list.")
    gens = engine.sampler.sample_batch(
        tokenizer, [prompt] * 4, SamplingSettings(max_new_tokens=24, temperature=1.0)
    )
    fixed = gens[0].completion_ids
    model.eval()
    trainer_before = _trainer_logprobs(model, prompt, fixed)
    engine_before = torch.tensor(engine.sampler.score(prompt, fixed), dtype=torch.float64)
    assert (engine_before - trainer_before).abs().max().item() < LOGPROB_ATOL

    # one optimizer step of grpo on the engine's own rollouts
    from composer_replication.samples.rollouts import Rollout

    group = [
        Rollout("t", g.prompt_ids, g.completion_ids, g.logprobs, reward=float(i % 2 == 0))
        for i, g in enumerate(gens)
    ]
    samples = build_algorithm(AlgorithmConfig(advantage={"type": "grpo"})).process_group(group)
    batches = pack_samples(samples, max_tokens=4096, pad_id=tokenizer.pad_token_id, split=None)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer.zero_grad(set_to_none=True)
    train_step(model, batches)
    optimizer.step()
    model.eval()
    trainer_after = _trainer_logprobs(model, prompt, fixed)
    assert (trainer_after - trainer_before).abs().max().item() > 20 * LOGPROB_ATOL

    stale = torch.tensor(engine.sampler.score(prompt, fixed), dtype=torch.float64)
    assert (stale - trainer_after).abs().max().item() > 20 * LOGPROB_ATOL  # not synced yet

    metrics = engine.after_step(model, 1)
    assert metrics["engine/policy_version"] == 1.0
    assert engine.sampler.served_version() == 1
    synced = torch.tensor(engine.sampler.score(prompt, fixed), dtype=torch.float64)
    assert (synced - trainer_after).abs().max().item() < LOGPROB_ATOL
    again = engine.sampler.sample_batch(
        tokenizer, [prompt], SamplingSettings(max_new_tokens=8, temperature=1.0)
    )[0]
    assert again.metadata["policy_version"] == 1
    expected = _trainer_logprobs(model, prompt, again.completion_ids)
    assert (torch.tensor(again.logprobs, dtype=torch.float64) - expected).abs().max() < LOGPROB_ATOL
    written = list(engine.weights_dir.glob("policy-v*.safetensors"))
    assert [p.name for p in written] == ["policy-v1.safetensors"]


def test_training_loop_samples_through_the_engine_and_syncs_each_step(engine, tmp_path):
    """The native loop with ``[inference] engine = "vllm"`` (the server above, by url): the
    rollouts come from the engine, each step's weights reach it, versions are recorded."""
    from composer_replication.training.loop import Trainer

    config = _engine_run(tmp_path, engine)
    trainer = Trainer(config)
    assert trainer.engine is not None
    collected = []
    real_rollouts = trainer.runtimes[0].env.rollouts

    def recording_rollouts(policy, *args, **kwargs):  # the real environment, recorded
        groups = real_rollouts(policy, *args, **kwargs)
        collected.append((policy, groups))
        return groups

    trainer.runtimes[0].env.rollouts = recording_rollouts
    row = trainer.train_one_step()
    ((sampler, groups),) = collected
    assert sampler is trainer.engine.sampler  # the environment sampled through the engine
    assert [r.metadata["policy_version"] for r in groups[0]] == [0, 0]
    assert row["engine/policy_version"] == 1.0
    assert engine.sampler.served_version() == 1
    trainer.engine.stop()  # a server given by url is left running
    assert engine.server.healthy()


def test_a_seeded_batch_larger_than_one_steps_token_budget(engine, policy_and_tokenizer):
    """More prompt tokens than one engine step takes (a held-out evaluation's batch): on a
    CPU build a partial prefill of a seeded request used to kill the engine ("CPU Generator
    does not use offset"); whole prefills keep it serving."""
    _, tokenizer = policy_and_tokenizer
    prompts = [
        _prompt(tokenizer, f"Write a long docstring for function number {i}. " * 12)
        for i in range(80)
    ]
    assert sum(map(len, prompts)) > 8192
    settings = SamplingSettings(max_new_tokens=3, temperature=1.0)
    generations = engine.sampler.sample_batch(tokenizer, prompts, settings)
    assert len(generations) == 80 and all(g.completion_ids for g in generations)
    assert engine.server.healthy()


def test_async_level_one_samples_the_next_step_while_the_trainer_trains(engine, tmp_path):
    """``async_level = 1``: step n+1's rollouts are sampled (by the engine, with the weights
    before step n) while step n trains; each step trains on rollouts one version old, every
    batch is sampled by one version, and held-out evaluation samples through the engine."""
    import threading
    import time

    from composer_replication.training.loop import Trainer

    config = _engine_run(
        tmp_path,
        engine,
        steps=3,
        eval_every=3,
        max_new_tokens=16,
        inference="async_level = 1\nmax_off_policy_steps = 1",
    )
    trainer = Trainer(config)
    calls, updates = [], []
    real_rollouts = trainer.runtimes[0].env.rollouts
    real_update = trainer.learner.update
    # sampled_ahead[k]: the queue's thread has started sampling training batch k
    sampled_ahead = [threading.Event() for _ in range(8)]
    batches_started = []

    def recording_rollouts(policy, tokenizer, task_ids, *, group_size, sampling):
        start = time.perf_counter()
        if threading.current_thread().name.startswith("rollouts"):
            batches_started.append(start)
            sampled_ahead[len(batches_started) - 1].set()
        groups = real_rollouts(
            policy, tokenizer, task_ids, group_size=group_size, sampling=sampling
        )
        thread = threading.current_thread().name  # the queue samples in its own thread
        calls.append((thread, policy, start, time.perf_counter(), groups))
        return groups

    def recording_update(batches, step):
        start = time.perf_counter()
        out = real_update(batches, step)
        # Step n's update does not end before batch n+1 is being sampled: with the queue
        # sampling ahead that happens at once; without it, never (the wait times out).
        n = len(updates)
        overlapped = sampled_ahead[n + 1].wait(timeout=120) if n < 2 else True
        updates.append((start, time.perf_counter(), overlapped))
        return out

    trainer.runtimes[0].env.rollouts = recording_rollouts
    trainer.learner.update = recording_update
    result = trainer.run()
    assert result.steps == 3
    train_calls = [c for c in calls if c[0].startswith("rollouts")]
    eval_calls = [c for c in calls if c[0] == "MainThread"]
    assert len(train_calls) + len(eval_calls) == len(calls)
    assert len(train_calls) == 4  # steps 1-3 plus step 4's batch, sampled ahead
    from composer_replication.inference.sampler import EngineSampler

    samplers = {id(c[1]) for c in calls}
    assert len(samplers) == 1 and all(isinstance(c[1], EngineSampler) for c in calls)
    assert eval_calls  # held-out evaluation went through the engine too
    # the batch of step n+1 was sampled while step n trained (it started before it ended)
    for n in (0, 1):
        assert updates[n][2] and train_calls[n + 1][2] < updates[n][1]
    # each batch is one policy version: 0, 0, 1, 2 (sampled before steps 1, 1, 2, 3 trained)
    versions = [{r.metadata["policy_version"] for g in c[4] for r in g} for c in train_calls]
    assert versions == [{0}, {0}, {1}, {2}]
    rows = [r for r in result.metrics if r.get("step", 0) > 0 and "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["rollouts/stale_dropped"] == 0 for r in rows)
    assert [r["engine/policy_version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all("kl/inference" in r for r in rows)


def test_a_frozen_opd_teacher_is_served_by_an_engine_of_its_own(engine, tmp_path):
    """opd with a frozen teacher given by local_path: the run serves it with its own engine
    server (never synced), the algorithm scores through it, and its prefill log-probs equal
    the same model's in process."""
    import asyncio

    from composer_replication.algo.scoring import EndpointPrefillScorer, LocalPrefillScorer
    from composer_replication.training.loop import Trainer

    config = _engine_run(
        tmp_path,
        engine,
        max_new_tokens=12,
        inference=f'python = "{ENGINE_PYTHON}"\noptimization_level = 0\nstartup_timeout_s = 600',
        advantage='type = "opd"\nmodel = { name = "teacher", local_path = "embedded" }',
    )
    trainer = Trainer(config)
    try:
        (server,) = trainer.frozen_engines.servers.values()
        assert server.process is not None and server.healthy()
        scorer = trainer.runtimes[0].algorithm.scorer
        assert isinstance(scorer, EndpointPrefillScorer)
        assert scorer.url == f"{server.base_url}/v1/completions"
        assert server.base_url != engine.server.base_url  # not the policy's server
        captured = []
        real_update = trainer.learner.update

        def recording_update(batches, step):
            captured.extend(batches)
            return real_update(batches, step)

        trainer.learner.update = recording_update
        row = trainer.train_one_step()
        assert row["tokens/ref_kl"] > 0
        teacher, _ = load_policy(None)
        local = LocalPrefillScorer(teacher)
        for mb in captured:
            for r in range(mb.n_rows):
                weights = mb.ref_kl_weights[r, 1:]
                if not bool((weights != 0).any()):
                    continue
                ids = mb.input_ids[r][mb.attention_mask[r] != 0].tolist()
                start = int((weights != 0).nonzero()[0]) + 1
                (want,) = asyncio.run(local.score([ids], [start]))
                got = mb.ref_logprobs[r, start : len(ids)].tolist()
                assert got == pytest.approx(want, abs=LOGPROB_ATOL)
    finally:
        trainer.engine.stop()
        trainer._stop_frozen_engines()
    assert server.process is None  # stopped with the run


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora-engine-run")
    config = inference_config(
        engine="vllm",
        python=str(ENGINE_PYTHON),
        max_model_len=1024,
        optimization_level=0,
        startup_timeout_s=600,
        lora_sync="adapter",
        max_lora_rank=8,
    )
    with PolicyEngine(config, model_dir=embedded_model_dir(), run_dir=run_dir, seed=5) as eng:
        eng.sampler  # noqa: B018 - starts the server
        yield eng


def test_lora_adapter_sync_serves_the_adapter_policy(lora_engine):
    """A LoRA policy synced as an adapter (/v1/load_lora_adapter): the engine samples with
    the adapter, and its log-probs equal the peft model's (adapters unmerged)."""
    import httpx
    from peft import LoraConfig, get_peft_model

    base, tokenizer = load_policy(None)
    policy = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():  # a trained adapter: lora_B moved off zero
        gen = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    policy.eval()
    prompt = _prompt(tokenizer, "Write a Python function that counts vowels.")
    (gen0,) = lora_engine.sampler.sample_batch(
        tokenizer, [prompt], SamplingSettings(max_new_tokens=16, temperature=1.0)
    )
    fixed = gen0.completion_ids
    adapted = _trainer_logprobs(policy, prompt, fixed)
    base_scores = torch.tensor(lora_engine.sampler.score(prompt, fixed), dtype=torch.float64)
    assert (base_scores - adapted).abs().max().item() > 20 * LOGPROB_ATOL

    metrics = lora_engine.after_step(policy, 1)
    assert metrics["engine/policy_version"] == 1.0
    assert lora_engine.sampler.model == "policy-v1"
    synced = torch.tensor(lora_engine.sampler.score(prompt, fixed), dtype=torch.float64)
    assert (synced - adapted).abs().max().item() < LOGPROB_ATOL
    (gen1,) = lora_engine.sampler.sample_batch(
        tokenizer, [prompt], SamplingSettings(max_new_tokens=8, temperature=1.0)
    )
    assert gen1.metadata["policy_version"] == 1
    expected = _trainer_logprobs(policy, prompt, gen1.completion_ids)
    assert (torch.tensor(gen1.logprobs, dtype=torch.float64) - expected).abs().max() < LOGPROB_ATOL

    lora_engine.after_step(policy, 2)  # the next version replaces the previous adapter
    served = httpx.get(f"{lora_engine.server.base_url}/v1/models").json()["data"]
    names = {m["id"] for m in served}
    assert "policy-v2" in names and "policy-v1" not in names
    assert sorted(p.name for p in lora_engine.weights_dir.iterdir()) == ["policy-v2"]
