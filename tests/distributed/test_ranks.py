"""RankGroup: task shares, gathering them back in order, rank 0's decisions, and which
rank writes the run directory, over a real two-process gloo group."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from composer_replication.config import RunConfig
from composer_replication.distributed.ranks import RankGroup
from composer_replication.training.lifecycle import RunLifecycle


def test_one_process_is_rank_0_of_1_and_every_method_is_the_identity():
    group = RankGroup.current()
    assert (group.rank, group.world_size, group.is_writer, group.distributed) == (0, 1, True, False)
    assert group.share(list("abc")) == ["a", "b", "c"]
    assert group.gather_shares(["a", "b", "c"], 3) == ["a", "b", "c"]
    assert group.agree({"fire": True}) == {"fire": True}


def test_shares_are_disjoint_balanced_and_cover_every_item():
    items = list(range(11))
    shares = [RankGroup(r, 3).share(items) for r in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert sorted(i for share in shares for i in share) == items


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (0, 0)])
def test_an_impossible_rank_is_refused(rank, world):
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        RankGroup(rank, world)


def test_a_share_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="holds 1 results for its share of 3 items"):
        RankGroup(0, 2).gather_shares(["x"], 3)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = RankGroup.current()
        tasks = [f"task-{i}" for i in range(7)]
        mine = group.share(tasks)
        results = group.gather_shares([f"{t}@rank{rank}" for t in mine], len(tasks))
        decision = group.agree(f"decided by rank {rank}")
        config = RunConfig(output_dir=str(Path(out_dir) / "run"))
        life = RunLifecycle(config, backend="native")
        life.begin(resumed=False)
        life.append({"step": 1, "reward/mean": float(rank)})
        record = {
            "rank": group.rank,
            "world": group.world_size,
            "mine": mine,
            "results": results,
            "decision": decision,
            "rows": life.metrics.rows(),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_two_gloo_ranks_share_gather_agree_and_only_rank_0_writes(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["mine"] for r in records] == [
        ["task-0", "task-2", "task-4", "task-6"],
        ["task-1", "task-3", "task-5"],
    ]
    expected = [f"task-{i}@rank{i % 2}" for i in range(7)]
    assert all(r["results"] == expected for r in records)  # every rank, task order
    assert all(r["decision"] == "decided by rank 0" for r in records)
    # rank 0 alone writes the run directory; rank 1 keeps its rows in memory
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows == [
        {
            "memory/peak_rss_gb": rows[0]["memory/peak_rss_gb"],
            "reward/mean": 0.0,
            "step": 1,
            "time/total_s": rows[0]["time/total_s"],
        }
    ]
    assert records[1]["rows"][0]["reward/mean"] == 1.0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json", "metrics.jsonl"]
