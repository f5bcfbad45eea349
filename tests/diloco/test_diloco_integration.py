"""DiLoCoConfig, diloco_context and the object-store outer step, checked against a
hand-written DiLoCo reference (pseudo-gradient mean + Nesterov SGD, arXiv:2311.08105)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_replication.diloco import DiLoCoConfig, diloco_context
from composer_replication.diloco.integration import NO_SYNC, ObjectStoreDiLoCo, flatten
from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce


def test_config_defaults() -> None:
    cfg = DiLoCoConfig()
    assert (cfg.enabled, cfg.backend, cfg.sync_every) == (False, "object_store", 100)
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.nesterov) == (0.7, 0.9, True)
    with pytest.raises(ValueError, match="extra"):
        DiLoCoConfig(bogus=1)


def test_disabled_is_a_nullcontext() -> None:
    model = torch.nn.Linear(2, 2)
    ctx = diloco_context(DiLoCoConfig(), model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(ctx, contextlib.nullcontext)
    with ctx as sync:
        assert sync is NO_SYNC
        assert sync.after_inner_step() is False
    assert isinstance(diloco_context(None, model, None), contextlib.nullcontext)


def test_rank_and_world_size_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DiLoCoConfig(enabled=True, rendezvous="/tmp/x")
    monkeypatch.delenv("REPLICA_RANK", raising=False)
    with pytest.raises(RuntimeError, match="REPLICA_RANK"):
        cfg.resolve_rank()
    monkeypatch.setenv("REPLICA_RANK", "3")
    monkeypatch.setenv("REPLICA_WORLD_SIZE", "4")
    assert (cfg.resolve_rank(), cfg.resolve_world_size()) == (3, 4)


def test_object_store_backend_needs_a_rendezvous() -> None:
    model = torch.nn.Linear(2, 2)
    cfg = DiLoCoConfig(enabled=True, rank=0, world_size=1)
    with pytest.raises(ValueError, match="rendezvous"), diloco_context(cfg, model, None):
        pass


def reference_diloco(
    starts: list[torch.Tensor], locals_per_sync: list[list[torch.Tensor]], lr: float, mu: float
) -> list[torch.Tensor]:
    """theta_{t+1} = theta_t - lr * (g + mu * b), b = mu * b + g, g = mean_r(theta_t - local_r)."""
    theta, buf, out = starts[0].clone().double(), None, []
    for local in locals_per_sync:
        g = torch.stack([(theta.float() - x).double() for x in local]).mean(0)
        buf = g.clone() if buf is None else mu * buf + g
        theta = theta - lr * (g + mu * buf)
        out.append(theta.float())
    return out


def test_outer_step_matches_the_reference(tmp_path: Path) -> None:
    world, sync_every, syncs = 2, 3, 2
    models = [torch.nn.Linear(4, 3) for _ in range(world)]  # different inits on purpose
    start = flatten(list(models[0].parameters()))
    targets = [torch.randn(3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    locals_seen: list[list[torch.Tensor]] = [[None] * world for _ in range(syncs)]
    results: list[list[torch.Tensor]] = [[] for _ in range(world)]
    barrier = threading.Barrier(world)

    def replica(rank: int) -> None:
        model = models[rank]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        store = ObjectStoreAllReduce(str(tmp_path), rank, world, poll_interval_s=0.01)
        cfg = DiLoCoConfig(enabled=True, sync_every=sync_every)
        with diloco_context(cfg, model, opt, store=store) as sync:
            assert isinstance(sync, ObjectStoreDiLoCo)
            assert torch.equal(flatten(list(model.parameters())), start)  # rank 0 broadcast
            for k in range(sync_every * syncs):
                opt.zero_grad()
                loss = ((model(torch.ones(2, 4)) - targets[rank]) ** 2).mean()
                loss.backward()
                opt.step()
                if (k + 1) % sync_every == 0:
                    locals_seen[k // sync_every][rank] = flatten(list(model.parameters()))
                    barrier.wait()
                synced = sync.after_inner_step()
                assert synced == ((k + 1) % sync_every == 0)
                if synced:
                    results[rank].append(flatten(list(model.parameters())))

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = reference_diloco([start], locals_seen, lr=0.7, mu=0.9)
    for rank in range(world):
        assert len(results[rank]) == syncs
        for got, want in zip(results[rank], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(results[0][-1], results[1][-1])  # replicas identical after each sync


def test_only_trainable_parameters_are_synchronised(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    store = ObjectStoreAllReduce(str(tmp_path), 0, 1)
    sync = ObjectStoreDiLoCo(model, store, sync_every=1)
    assert sync.outer.numel() == 4  # the trainable Linear(3, 1) only
    sync.after_inner_step()
    assert torch.equal(model[0].weight, frozen)


def test_state_dict_round_trip(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    store = ObjectStoreAllReduce(str(tmp_path), 0, 1)
    sync = ObjectStoreDiLoCo(model, store, sync_every=1)
    with torch.no_grad():
        model.weight.add_(1.0)
    sync.after_inner_step()
    state: dict[str, Any] = sync.state_dict()
    other = ObjectStoreDiLoCo(
        torch.nn.Linear(2, 2), ObjectStoreAllReduce(str(tmp_path / "b"), 0, 1), sync_initial=False
    )
    other.load_state_dict(state)
    assert torch.equal(other.outer, sync.outer)
    assert other.store.round_id == state["round_id"] == 2  # broadcast + one sync
    assert other.outer_optimizer.state_dict()["state"][0]["momentum_buffer"] is not None
