"""The replicas' own exchange, priced: the inspector reads gossip's permutes and the mean's
all-reduce from the compiled step at the share of steps that run them, beside the α-β model;
gossip's bytes per step stay put as replicas are added; `meshtrain plan` prices gossip and
federated averaging when asked, and never otherwise."""

import json

import jax
import pytest

import meshtrain as mt
from meshtrain.cli import main
from meshtrain.costmodel import ReplicaExchange, ideal_round_bytes, profile
from meshtrain.models import DataSpec
from meshtrain.plan.command import gpt_config, reasoning
from meshtrain.plan.search import plan

GPT = mt.GPTConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)
DATA = DataSpec("lm", 16, 32, 256)


def _inspect(n, sync):
    mesh = mt.make_mesh(f"data={n}", devices=jax.devices()[:n])
    run = mt.RunSpec(model=GPT, data=DATA, mesh=mesh, rules=mt.rules_for("dp", mesh), sync=sync)
    return mt.inspect(run)


@pytest.mark.pair("dp", "gossip")
def test_the_inspector_reads_gossips_bytes_per_step_constant_in_the_replicas():
    ring = [_inspect(n, mt.SyncConfig(gossip="ring", sync_every=10)) for n in (4, 8)]
    for r in ring:
        assert r.flags == [], r.flags  # every collective is the exchange's
        ex = r.exchange
        assert ex["permutes_per_step"] == 2 and ex["sync_every"] == 10
        # the compiled program against the model: only the metrics' scalar means differ
        assert abs(ex["compiled_bytes"] - ex["modelled_bytes"]) < 64, ex
        assert ex["modelled_s"] > 0 and ex["device"] == "h100"
    params = ring[0].param_bytes
    # the mixing's two permutes of the parameters are the same at 4 and 8 replicas; only the
    # mean's all-reduce, a tenth of it per step, grows from 2·3/4 to 2·7/8 of the parameters
    mixing = [
        r.exchange["modelled_bytes"] - 2 * (n - 1) / n * params / 10
        for r, n in zip(ring, (4, 8), strict=True)
    ]
    assert mixing[0] == pytest.approx(2 * params, rel=1e-4) == pytest.approx(mixing[1], rel=1e-4)
    # each instruction once: two permutes and the all-reduce of every parameter
    assert ring[1].measured["replica exchange"] == pytest.approx(3 * params, rel=1e-3)
    assert ring[1].expectation.bytes["replica exchange"] == pytest.approx(3 * params, rel=1e-3)
    assert ring[1].measured["gradient reduction"] == 0  # no gradient crosses the replicas


@pytest.mark.pair("dp", "federated")
def test_the_inspector_says_a_federated_round_is_a_full_exchange_and_what_sampling_would_save(
    capsys,
):
    r = _inspect(8, mt.SyncConfig(client_fraction=0.25, sync_every=4))
    ex = r.exchange
    assert r.flags == [] and ex["permutes_per_step"] == 0
    full = ReplicaExchange(("data",), 8, r.param_bytes, 0, 4).sent_per_step()
    assert abs(ex["compiled_bytes"] - full) < 64
    assert ex["ideal_bytes"] == round(ideal_round_bytes(r.param_bytes, 8, 0.25) / 4)
    assert ex["ideal_bytes"] == pytest.approx(0.25 * full, rel=1e-3)
    r.print()
    out = capsys.readouterr().out
    assert "replica exchange per step" in out and "the unsampled add zeros" in out
    assert json.loads(r.to_json())["replica_exchange"]["ideal_bytes"] == ex["ideal_bytes"]


def test_plan_prices_gossip_and_federated_averaging_only_when_asked(capsys):
    cfg = gpt_config("125m", 1024, "bfloat16")
    kw = dict(devices=64, batch=128, seq_len=1024, device=profile("h100"), memory_cap=80e9)
    plain = plan(cfg, confirm=0, **kw)
    assert all("replica exchange" not in c.modelled.estimate.comm_s for c in plain.ranked)
    assert plain.sync is None and not any("exchange, as asked" in x for x in reasoning(plain, 1))
    for sync in (
        mt.SyncConfig(gossip="exponential", sync_every=50),
        mt.SyncConfig(client_fraction=0.25, sync_every=8),
    ):
        priced = plan(cfg, confirm=0, sync=sync, **kw)
        assert priced.sync == sync
        for c in priced.ranked:
            assert c.modelled.estimate.comm_s["replica exchange"] > 0
            assert c.modelled.memory["replica state"] > 0  # each replica's own parameters
            # the strategies with replicas (a fully sharded layout has none)
            assert c.candidate.strategy.split("+")[0] in ("dp", "zero1", "hsdp")
        assert reasoning(priced, 1)[1].startswith("exchange, as asked: ")
    argv = "plan --model 125m --devices 64 --confirm 0 --json".split()
    assert main([*argv, "--gossip", "ring", "--sync-every", "50"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["train_flags"]["gossip"] == "ring" and out["train_flags"]["sync-every"] == 50
    assert main([*argv, "--gossip", "star", "--sync-every", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gossip='star'" in err[0]
