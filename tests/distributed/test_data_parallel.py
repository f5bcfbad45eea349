"""Data parallelism on 2 gloo ranks (real processes, real FSDP2) against one process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("dp_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank: int, world: int, port: int, mode: str, out: Path, die_at: int = -1):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(WORKER), str(rank), str(world), str(port), mode, str(out)]
    return subprocess.Popen(
        [*args, str(die_at)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(procs, bound_s: float = 300):
    """Wait for every process (bounded: a hang fails the test instead of the suite)."""
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=bound_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a rank hung")
        results.append((proc.returncode, err))
    return results


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_two_ranks_equal_one_process_after_two_steps(tmp_path, mode):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    port = _free_port()
    procs = [_start(0, 1, 0, mode, one)] + [_start(r, 2, port, mode, two) for r in (0, 1)]
    for code, err in _finish(procs):
        assert code == 0, err[-3000:]
    reference = torch.load(f"{one}.rank0")
    sys.path.insert(0, str(WORKER.parent))
    from dp_worker import build_policy

    initial = dict(build_policy(mode == "lora").named_parameters())
    moved = 0
    for rank in (0, 1):
        sharded = torch.load(f"{two}.rank{rank}")
        assert set(sharded) <= set(reference)
        for name, value in sharded.items():
            assert torch.allclose(value, reference[name], atol=1e-6, rtol=0), name
            if initial[name].requires_grad:
                moved += int((value - initial[name].detach()).abs().max() > 1e-4)
    assert moved > 0  # the steps changed the trainable weights (the check is not vacuous)
    shares = [json.loads(Path(f"{two}.rank{r}.tasks").read_text()) for r in (0, 1)]
    everything = json.loads(Path(f"{one}.rank0.tasks").read_text())
    assert shares[0] and shares[1]
    assert not {tuple(s) for s in shares[0]} & {tuple(s) for s in shares[1]}
    assert sorted(shares[0] + shares[1]) == sorted(everything)


def test_a_killed_rank_makes_the_other_fail_with_a_clear_error(tmp_path):
    port = _free_port()
    procs = [
        _start(0, 2, port, "full", tmp_path / "x.pt"),
        _start(1, 2, port, "full", tmp_path / "x.pt", die_at=1),
    ]
    (code0, err0), (code1, _) = _finish(procs, bound_s=240)
    assert code1 == -signal.SIGKILL
    assert code0 != 0
    assert "summing the step's token counts with the other ranks failed" in err0
