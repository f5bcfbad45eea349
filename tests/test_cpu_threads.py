"""Idle CPU threads sleep after a short spin: set by the commands before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

from composer_replication.model.cpu_threads import SPIN_COUNT, limit_thread_spinning


def test_the_short_spin_is_set_unless_the_user_chose_a_wait_policy():
    environ: dict[str, str] = {}
    assert limit_thread_spinning(environ) is True
    assert environ == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    theirs = {"GOMP_SPINCOUNT": "50"}
    assert limit_thread_spinning(theirs) is False and theirs == {"GOMP_SPINCOUNT": "50"}
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert limit_thread_spinning(passive) is False and "GOMP_SPINCOUNT" not in passive


def test_a_command_sets_it_before_torch_loads_and_not_after():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    script = (
        "import os, sys\n"
        "from composer_replication.cli import main\n"
        "main(['--help'])\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[-2:] == [str(SPIN_COUNT), "False"]
    late = "import torch\nfrom composer_replication.model.cpu_threads import limit_thread_spinning\nprint(limit_thread_spinning())\n"
    out = subprocess.run(
        [sys.executable, "-c", late], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[-1] == "False"  # too late: the OpenMP runtime has read its settings
