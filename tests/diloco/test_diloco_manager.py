"""ObjectStoreManager: the torchft Manager surface, and real torchft DiLoCo driven by it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from composer_replication.diloco.serverless import MockManager, ObjectStoreManager
from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce


def test_manager_surface(tmp_path: Path) -> None:
    assert MockManager is ObjectStoreManager
    manager = ObjectStoreManager(ObjectStoreAllReduce(str(tmp_path), 0, 1))
    assert (manager.num_participants, manager.rank, manager.is_leader()) == (1, 0, True)
    t = torch.tensor([1.0, 2.0])
    work = manager.allreduce(t, should_quantize=False)
    assert work.wait() is True
    assert torch.equal(work.get_future().wait(), t)
    manager.start_quorum()
    assert manager.current_step() == 1  # the quorum begins the step
    assert manager.wait_quorum() == 1  # the quorum's size
    assert manager.should_commit() is True
    assert manager.current_step() == 1
    manager.disallow_state_dict_read()
    manager.allow_state_dict_read()
    seen = {}
    manager.register_state_dict_fn("k", lambda s: seen.update(s), lambda: {"x": 1})
    with pytest.raises(ValueError, match="already registered"):
        manager.register_state_dict_fn("k", lambda s: None, lambda: {})
    state = manager.state_dict()
    assert state == {"step": 1, "batches_committed": 1, "round_id": 1, "user": {"k": {"x": 1}}}
    manager.load_state_dict(state)
    assert seen == {"x": 1}
    with pytest.raises(ValueError, match="only averages"):
        manager.allreduce(t, reduce_op="SUM")


def test_torchft_diloco_over_the_object_store(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    from composer_replication.diloco import make_diloco_outer_loop
    from composer_replication.model.loading import tiny_model

    world, sync_every, steps = 2, 3, 6
    snapshots: list[dict[int, torch.Tensor]] = [{} for _ in range(world)]
    errors: list[BaseException] = []
    # built here, not in the threads: model init seeds the process-global RNG
    models = [
        tiny_model(seed=0, vocab_size=64, hidden_size=16, intermediate_size=32)
        for _ in range(world)
    ]

    def replica(rank: int) -> None:
        try:
            model = models[rank]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            store = ObjectStoreAllReduce(str(tmp_path), rank, world, poll_interval_s=0.01)
            manager = ObjectStoreManager(store)
            g = torch.Generator().manual_seed(rank)
            with make_diloco_outer_loop(manager, [model], opt, sync_every=sync_every):
                for step in range(1, steps + 1):
                    ids = torch.randint(0, 64, (2, 8), generator=g)
                    opt.zero_grad()
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                    snapshots[rank][step] = flat.clone()
            # bucketized: one store round per sync, not one per parameter
            assert store.round_id == steps // sync_every
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for step in range(1, steps + 1):
        same = torch.equal(snapshots[0][step], snapshots[1][step])
        assert same == (step % sync_every == 0), step
