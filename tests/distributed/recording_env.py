"""The loop tests' scripted environment, recording on disk which tasks each rank requested
(file ``calls.rank<RANK>.jsonl`` under ``record_dir``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from scripted_env import ScriptedEnv


class RecordingEnv(ScriptedEnv):
    def __init__(self, record_dir: str, **options) -> None:
        super().__init__(**options)
        self.record = Path(record_dir) / f"calls.rank{os.environ.get('RANK', '0')}.jsonl"

    def rollouts(self, policy, tokenizer, task_ids, *, group_size, sampling):
        kind = "eval" if sampling.temperature == 0 else "train"
        with self.record.open("a") as f:
            f.write(json.dumps([kind, list(task_ids)]) + "\n")
        return super().rollouts(
            policy, tokenizer, task_ids, group_size=group_size, sampling=sampling
        )


def make_env(**options) -> RecordingEnv:
    return RecordingEnv(**options)
