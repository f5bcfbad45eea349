"""One torchft DiLoCo replica for test_diloco_torchft.py (run as a script).

argv: rank lighthouse_addr steps out_json. Waits for ``<out_dir>/go`` after joining so both
replicas start stepping together; records the parameter checksum after every inner step.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from composer_replication.diloco import make_diloco_outer_loop, make_torchft_manager
from composer_replication.model.loading import tiny_model


def main() -> None:
    rank, lighthouse, steps, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
    model = tiny_model(seed=0, vocab_size=128, hidden_size=32, intermediate_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = make_torchft_manager(
        replica_id=f"replica_{rank}", lighthouse_addr=lighthouse, timeout_s=10, quorum_timeout_s=20
    )
    open(out + ".ready", "w").close()
    while not os.path.exists(os.path.join(os.path.dirname(out), "go")):
        time.sleep(0.05)
    g = torch.Generator().manual_seed(rank + 1)  # each replica sees different data
    rows = []
    with make_diloco_outer_loop(manager, [model], opt, sync_every=5):
        for step in range(1, steps + 1):
            ids = torch.randint(0, 128, (2, 16), generator=g)
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            time.sleep(step_sleep)
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            rows.append(
                {
                    "step": step,
                    "checksum": float(flat.double().sum()),
                    "commits": manager.current_step(),
                }
            )
            with open(out + ".tmp", "w") as fh:
                json.dump(rows, fh)
            os.replace(out + ".tmp", out)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    # torchft's native teardown (store/Gloo) can take ~20 s at interpreter exit
    os._exit(0)


if __name__ == "__main__":
    main()
