"""Training progress in a log: one plain line per step; the libraries' bars kept quiet."""

from __future__ import annotations

import io

from rich.console import Console

from composer_replication.training.setup import ProgressBar, quiet_library_progress_bars


def test_a_console_that_is_not_a_terminal_gets_one_plain_line_per_step():
    out = io.StringIO()
    bar = ProgressBar(Console(file=out, force_terminal=False, width=200), total=6, done=0)
    bar.update({"step": 1, "reward/mean": 0.25, "loss": 0.0123, "time/step_s": 31.04})
    bar.update({"step": 2, "reward/mean": 0.5, "loss": 0.01, "heldout/pass@1": 0.125})
    bar.update({"step": 3, "heldout/pass@1": 0.25, "heldout/greedy_pass@1": 0.0898876})
    # demonstrations beside the policy's rollouts: the policy's reward; alone: their count
    both = {"rollouts/count": 8.0, "rollouts/demonstrations": 16.0, "reward/mean": 0.125}
    bar.update({"step": 4, "loss": 0.5, **both})
    alone = {"rollouts/count": 0.0, "rollouts/demonstrations": 16.0, "reward/mean": 0.0}
    bar.update({"step": 5, "loss": 0.5, **alone})
    bar.close()
    assert out.getvalue().splitlines() == [
        "step 1/6 reward 0.250 loss 0.0123 31.0 s",
        "step 2/6 reward 0.500 loss 0.0100 held-out 0.125",
        "step 3/6 reward 0.000 loss 0.0000 held-out 0.250 greedy 0.090",
        "step 4/6 reward 0.125 loss 0.5000",
        "step 5/6 demonstrations 16 loss 0.5000",
    ]


def test_a_terminal_gets_the_live_bar_and_no_console_nothing():
    out = io.StringIO()
    bar = ProgressBar(Console(file=out, force_terminal=True, width=120), total=2, done=0)
    bar.update({"step": 1, "reward/mean": 0.0, "loss": 1.0})
    bar.close()
    assert "step 1/2" not in out.getvalue() and "reward 0.000 loss 1.0000" in out.getvalue()
    silent = ProgressBar(None, total=2, done=0)
    silent.update({"step": 1})  # no console: nothing to write to, nothing raised
    silent.close()


def test_library_bars_are_turned_off_only_off_a_terminal(monkeypatch):
    from transformers.utils import logging as hf_logging

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    assert quiet_library_progress_bars(Tty()) is False
    assert hf_logging.is_progress_bar_enabled()
    try:
        assert quiet_library_progress_bars(io.StringIO()) is True
        assert not hf_logging.is_progress_bar_enabled()
        import os

        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    finally:
        hf_logging.enable_progress_bar()


def test_long_work_in_a_log_says_it_is_alive_at_least_every_interval():
    import re
    import time

    from composer_replication.common.progress import heartbeat

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with heartbeat(console, "held-out evaluation (start)", every=0.05):
        time.sleep(0.32)
    lines = out.getvalue().splitlines()
    assert lines[0] == "held-out evaluation (start) ..."
    beats = [line for line in lines if line.endswith("s so far")]
    assert len(beats) >= 4 and all(
        re.fullmatch(r"held-out evaluation \(start\): \d+ s so far", line) for line in beats
    )
    assert re.fullmatch(r"held-out evaluation \(start\): done in \d+ s", lines[-1])
    # quick work that is not announced says nothing; a terminal shows its own bars
    quiet = io.StringIO()
    with heartbeat(
        Console(file=quiet, force_terminal=False), "setting up", every=5, announce=False
    ):
        pass
    with heartbeat(Console(file=quiet, force_terminal=True), "evaluation", every=0.01):
        time.sleep(0.05)
    assert quiet.getvalue() == ""
