"""Golden run: five steps of the composer recipe, every loss number checked in.

The native loop trains the tiny random Llama (``tiny_policy(seed=0)``, LoRA r=4) with the
``composer`` algorithm (configs/algorithms/composer.toml: ``alpha_sdpo = 0.1``,
``beta_replay = 0.05``, teacher = live policy) on the scripted environment of the fast loop
tests, sampling in process with ``seed = 0``. Per step it records ``loss``, ``loss/<c>``
and ``tokens/<c>`` for the five components, plus ``grad_norm``, and compares them with
``golden/composer_5_steps.json`` (rel 1e-4; an expected exact zero must stay within 1e-12).

What each component sees:

- ``rl``: Dr.GRPO on every sampled token. The second rollout of each group is cut one token
  short (an attempt that stopped earlier): with equal lengths the group-centred advantages
  cancel and the on-policy ``loss/rl`` is float noise around 0, with uneven ones it is a
  real number. ``grad_norm`` is where rl's gradient shows in the step that computes it.
- ``jsd``: SDPO at error sites. The scripted environment fails every second rollout with
  feedback, so each group has one error site, taught by its better sibling's completion.
- ``dpo``: one trace-replay pair per group from the ``pairs_file`` fixture.
- ``ce`` and ``ref_kl`` are zero by design, not by size: composer routes no token to them
  (``ComposerAlgorithm.components`` is rl, jsd, dpo; ce comes from sft / echo, ref_kl from
  opd). The test checks that they stay exactly zero.

Blind spots: the loop samples in process and trains on those samples before the next
step, so the importance ratio is 1 (up to float noise) and the settings that act only
off-policy, rl's log-ratio penalty ``kl_tau`` and the DPPO trust region ``mask_low`` /
``mask_high``, leave these numbers unchanged; the rl component's unit tests check them on
hand-built off-policy batches.

Updating the golden file is deliberate; after a change that is meant to move the numbers::

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/training/test_golden_run.py

rewrites it (the test then reports itself skipped, naming the file); commit the new file
with the change that explains it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from composer_replication.config import RunConfig
from composer_replication.training.loop import train

sys.path.insert(0, str(Path(__file__).parent))
from scripted_env import ScriptedEnv

GOLDEN = Path(__file__).parent / "golden" / "composer_5_steps.json"
UPDATE_COMMAND = "UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/training/test_golden_run.py"
COMPONENTS = ("rl", "ce", "jsd", "ref_kl", "dpo")
KEYS = (
    "loss",
    *(f"loss/{c}" for c in COMPONENTS),
    *(f"tokens/{c}" for c in COMPONENTS),
    "grad_norm",
)
STEPS = 5
REL = 1e-4
ZERO_ABS = 1e-12


class UnevenEnv(ScriptedEnv):
    """ScriptedEnv whose k-th rollout of a group stops k tokens early."""

    def rollouts(self, *args, **kwargs):
        groups = super().rollouts(*args, **kwargs)
        for group in groups:
            for k, r in enumerate(group):
                n = max(1, len(r.completion_ids) - k)
                r.completion_ids = r.completion_ids[:n]
                r.inference_logprobs = r.inference_logprobs[:n]
                r.completion_mask = r.completion_mask[:n]
        return groups


def _config(tmp_path: Path, model_dir: str, pairs_path: str) -> RunConfig:
    return RunConfig.from_toml(f'''
seed = 0
steps = {STEPS}
output_dir = "{tmp_path / "run"}"
[model]
source = "{model_dir}"
dtype = "float32"  # the float32 path is the golden one, on every CPU
[model.lora]
r = 4
alpha = 8
[optim]
lr = 1e-2
[eval]
at_start = false
every = 100
max_tasks = 1
samples_per_task = 1
greedy = false
[guard]
min_steps = 100
[checkpoint]
every = 100
[[envs]]
name = "scripted"
tasks_per_step = 2
[envs.algorithm.sampling]
group_size = 2
[envs.algorithm.advantage]
type = "composer"
alpha_sdpo = 0.1
beta_replay = 0.05
teacher = "policy"
pairs_path = "{pairs_path}"
''')


def golden_rows(config: RunConfig) -> list[dict[str, float]]:
    """The run's per-step values of ``KEYS``."""
    result = train(config, environments={"scripted": UnevenEnv()})
    rows = [r for r in result.metrics if r.get("step", 0) > 0 and "loss" in r]
    return [{"step": r["step"], **{k: float(r[k]) for k in KEYS}} for r in rows]


def mismatches(expected: list[dict], actual: list[dict]) -> list[str]:
    """One line per value outside the tolerance (rel ``REL``; ``ZERO_ABS`` around 0)."""
    if [r["step"] for r in expected] != [r["step"] for r in actual]:
        return [f"steps {[r['step'] for r in actual]} != golden {[r['step'] for r in expected]}"]
    out = []
    for want, got in zip(expected, actual):
        for key in KEYS:
            if key not in want:
                out.append(f"step {want['step']}: {key} missing from the golden file")
                continue
            w, g = want[key], got[key]
            if g != pytest.approx(w, rel=REL, abs=ZERO_ABS if w == 0 else 0.0):
                out.append(f"step {want['step']} {key}: got {g!r}, golden {w!r}")
    return out


def test_composer_five_steps_match_the_golden_losses(tmp_path, tiny_dir, pairs_file):
    rows = golden_rows(_config(tmp_path, tiny_dir, pairs_file))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # the recipe's three channels train every step, the other two never
        assert min(r["tokens/rl"], r["tokens/jsd"], r["tokens/dpo"]) > 0, r
        assert r["tokens/ce"] == r["tokens/ref_kl"] == 0, r
        assert min(abs(r["loss/rl"]), r["loss/jsd"], r["loss/dpo"]) > 1e-6, r
        # coefficients are 1: the objective is the sum of the component means
        parts = sum(r[f"loss/{c}"] for c in COMPONENTS)
        assert r["loss"] == pytest.approx(parts, rel=1e-5, abs=1e-9), r
        # by hand, on-policy (ratio 1): step s rewards each group (0.1 s, 0) with 6 and 5
        # tokens, Dr.GRPO advantages (+0.05 s, -0.05 s), so rl = -2 * 0.05 s * (6 - 5) / 22
        assert r["tokens/rl"] == 22 and r["tokens/jsd"] == 10 and r["tokens/dpo"] == 2, r
        assert r["loss/rl"] == pytest.approx(-0.1 * r["step"] / 22, rel=1e-4), r
    # before the first update the policy is its own DPO reference: beta_replay * ln 2
    assert rows[0]["loss/dpo"] == pytest.approx(0.05 * math.log(2), rel=1e-5)

    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        payload = {"regenerate": UPDATE_COMMAND, "steps": rows}
        GOLDEN.write_text(json.dumps(payload, indent=1) + "\n")
        pytest.skip(f"UPDATE_GOLDEN=1: rewrote {GOLDEN}")

    assert GOLDEN.exists(), f"{GOLDEN} is missing; create it with {UPDATE_COMMAND}"
    expected = json.loads(GOLDEN.read_text())["steps"]
    bad = mismatches(expected, rows)
    assert not bad, (
        "the composer golden run moved:\n"
        + "\n".join(bad)
        + f"\nif the change is intended, rerun with {UPDATE_COMMAND} and commit the file"
    )
