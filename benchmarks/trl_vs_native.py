"""The native training loop vs trl's GRPOTrainer: wall time per step and peak memory.

Run: ``python benchmarks/trl_vs_native.py`` (about 5-10 minutes on 2 CPU cores). Both sides
train the embedded SmolLM2-135M-Instruct (LoRA as in the default run config, or
``--full``) with Dr. GRPO on the python_functions train tasks: ``--prompts`` tasks x
``--group`` completions of exactly ``--tokens`` new tokens per step (EOS is held back with
``min_new_tokens`` and the env's stop strings are off, so both sides generate the same
number of tokens), sandbox-graded rewards, one optimizer step per generation, same
learning rate and clipping. Each side runs in a fresh interpreter; the first step is a
warm-up and is left out of the mean. Peak memory is the process's peak RSS (model load
included, the same model on both sides) and its rise during training.

Printed: seconds per step of each side, native steps/s over trl's, native peak RSS over
trl's (goal: >= 1.3x the steps/s at <= 0.7x the peak memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import (
    check_count,
    current_rss_bytes,
    gib,
    machine_line,
    peak_rss_bytes,
    refuse,
    run_case,
)


def run_config(args: dict, output_dir: str):
    from composer_replication.config import RunConfig

    return RunConfig.model_validate(
        {
            "seed": 0,
            "steps": args["steps"],
            "output_dir": output_dir,
            "model": {"lora": None} if args["full"] else {},
            "envs": [
                {
                    "name": "python_functions",
                    "tasks_per_step": args["prompts"],
                    "algorithm": {
                        "sampling": {
                            "group_size": args["group"],
                            "max_new_tokens": args["tokens"],
                            "temperature": 1.0,
                        },
                        "advantage": {"type": "grpo"},
                    },
                }
            ],
            "eval": {"at_start": False},
            "micro_batch_tokens": args["micro_batch_tokens"],
            "malloc_mmap_threshold": args["mmap_threshold"],
        }
    )


def _fixed_length(policy, tokens: int) -> None:
    """Hold EOS back for ``tokens`` steps and switch the env's stop strings off."""
    import composer_replication.envs.python_functions as pf

    pf.STOP_STRINGS = ()
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    base.generation_config.min_new_tokens = tokens


def native_worker(args: dict) -> dict:
    from composer_replication.training.loop import Trainer

    cfg = run_config(args, tempfile.mkdtemp(prefix="bench-native-"))
    trainer = Trainer(cfg)
    _fixed_length(trainer.policy, args["tokens"])
    rss_before = current_rss_bytes()
    times, lengths, generate_score = [], [], []
    for _ in range(args["steps"]):
        start = time.perf_counter()
        row = trainer.train_one_step()
        times.append(time.perf_counter() - start)
        lengths.append(row["tokens/rl"])
        generate_score.append(row["time/generate_score_s"])
    return {
        "step_s": times,
        "generate_score_s": generate_score,
        "peak_rss": peak_rss_bytes(),
        "rss_before_train": rss_before,
        "tokens": lengths,
        "reward": row["reward/mean"],
    }


def trl_worker(args: dict) -> dict:
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from composer_replication.backends.trl.run import (
        PythonFunctionsReward,
        grpo_config_from_run,
        train_prompt_dataset,
    )
    from composer_replication.envs.python_functions import PythonFunctionsEnv
    from composer_replication.safety import HeldoutSplit
    from composer_replication.training.setup import seed_everything, setup_policy

    cfg = run_config(args, tempfile.mkdtemp(prefix="bench-trl-"))
    seed_everything(cfg.seed)
    policy, tokenizer = setup_policy(cfg.model)
    env = PythonFunctionsEnv()
    grpo_args = grpo_config_from_run(cfg, cfg.output_dir)
    grpo_args.generation_kwargs = {"min_new_tokens": args["tokens"]}
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **kw):
            times.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[PythonFunctionsReward(env)],
        args=grpo_args,
        train_dataset=train_prompt_dataset(env, HeldoutSplit(cfg.heldout_fraction)),
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    rss_before = current_rss_bytes()
    trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    return {
        "step_s": times,
        "peak_rss": peak_rss_bytes(),
        "rss_before_train": rss_before,
        "tokens": [r["completions/mean_length"] * args["prompts"] * args["group"] for r in logs],
        "reward": logs[-1]["reward"],
    }


WORKERS = {"native": native_worker, "trl": trl_worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=sorted(WORKERS))
    parser.add_argument("--args", default="{}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=1024,
        help="native micro-batch budget (the run config's default)",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=-1,
        help="native malloc_mmap_threshold in bytes (-1, the default: glibc's dynamic one)",
    )
    opts = parser.parse_args()
    if opts.worker:
        print(json.dumps(WORKERS[opts.worker](json.loads(opts.args))))
        return
    check_count(opts.steps, "--steps", what="steps")
    check_count(opts.prompts, "--prompts", what="prompts")
    # Dr. GRPO's advantage compares the completions of a prompt: a group of 1 learns nothing
    check_count(opts.group, "--group", minimum=2, what="completions per prompt")
    check_count(opts.tokens, "--tokens", what="tokens")
    check_count(opts.micro_batch_tokens, "--micro-batch-tokens", what="tokens")
    most = 32 * 1024 * 1024  # the run config's malloc_mmap_threshold range
    if not -1 <= opts.mmap_threshold <= most:
        refuse("--mmap-threshold", opts.mmap_threshold, f"give -1 (dynamic) or 0 to {most} bytes")
    keys = ("steps", "prompts", "group", "tokens", "full", "micro_batch_tokens", "mmap_threshold")
    args = {k: getattr(opts, k) for k in keys}
    if args["mmap_threshold"] < 0:
        args["mmap_threshold"] = None
    print(machine_line())
    print(
        f"SmolLM2-135M-Instruct ({'full' if opts.full else 'LoRA r=16'}), Dr. GRPO, "
        f"{opts.prompts} prompts x {opts.group} completions x {opts.tokens} tokens, "
        f"{opts.steps} steps (first = warm-up); native: micro-batches of "
        f"{opts.micro_batch_tokens} tokens, glibc mmap threshold "
        f"{'dynamic' if args['mmap_threshold'] is None else args['mmap_threshold']}"
    )
    results = {}
    for side in ("native", "trl"):
        results[side] = run_case(__file__, side, args)
        r = results[side]
        steady = r["step_s"][1:] or r["step_s"]
        r["mean_s"] = statistics.mean(steady)
        print(
            f"{side:>6}: {r['mean_s']:.2f} s/step (steps {', '.join(f'{t:.1f}' for t in r['step_s'])})"
            f"  peak RSS {gib(r['peak_rss'])} (+{gib(r['peak_rss'] - r['rss_before_train'])} "
            f"in training)  sampled tokens/step {r['tokens']}"
        )
        if "generate_score_s" in r:
            steady_gen = r["generate_score_s"][1:] or r["generate_score_s"]
            print(f"        of which generate + grade: {statistics.mean(steady_gen):.2f} s/step")
    native, trl = results["native"], results["trl"]
    speed = trl["mean_s"] / native["mean_s"]
    memory = native["peak_rss"] / trl["peak_rss"]
    rise = (native["peak_rss"] - native["rss_before_train"]) / max(
        1, trl["peak_rss"] - trl["rss_before_train"]
    )
    print(f"native / trl steps per second: {speed:.2f}x   (goal >= 1.3x)")
    print(f"native / trl peak RSS:         {memory:.2f}x   (goal <= 0.7x)")
    print(f"native / trl RSS rise in training: {rise:.2f}x")


if __name__ == "__main__":
    main()
