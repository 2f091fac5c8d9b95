"""The planner weighs host offload: host links in the profiles, what the transfers cost and
hide behind, the memory each offload frees, and the plans it changes (and those it does not)."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from meshtrain.cli import main
from meshtrain.comm.expect import param_layouts
from meshtrain.costmodel import PROFILES, HostTransfer, Link, exposed_time, profile, transfer_time
from meshtrain.layout import rules_for
from meshtrain.plan.analytic import model_candidate
from meshtrain.plan.command import gpt_config, reasoning
from meshtrain.plan.search import PlanError, plan
from meshtrain.plan.space import Candidate
from meshtrain.state import abstract_model

SEVEN_B = gpt_config("7b", 2048, "bfloat16")


def _modelled(cand, cfg=SEVEN_B, batch=128, device="h100"):
    graphdef, abstract = abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))
    params = nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)[1]
    layouts = param_layouts(params, rules_for(cand.strategy), cand.sizes)
    return model_candidate(
        cand,
        layouts,
        dataclasses.replace(cfg, remat=cand.remat),
        batch=batch,
        seq_len=cfg.max_seq_len,
        device=profile(device),
    )


def test_every_gpu_profile_names_its_host_link_and_host_memory():
    for name, p in PROFILES.items():
        if p.platform == "tpu":
            assert p.host is None  # no published figure: offload is not planned there
            continue
        assert p.host is not None and p.host.bandwidth > 0 and p.host_memory > 0, name
    # PCIe 5.0 x16 each way, and NVLink-C2C each way
    assert PROFILES["h100"].host.bandwidth == 64e9
    assert PROFILES["gh200"].host.bandwidth == 450e9


def test_host_transfers_cost_only_what_exceeds_their_window():
    rng = np.random.default_rng()
    link = Link(float(rng.uniform(1e-6, 1e-4)), float(rng.uniform(1e9, 1e11)))
    w, f, compute = (float(x) for x in rng.uniform(1e9, 1e10, 3))
    t = [
        HostTransfer("residuals", "to host", w, 1 / 3, 4),
        HostTransfer("residuals", "to device", f, 2 / 3, 4),
    ]
    for seconds in (1e-3, 1.0, 100.0):  # nothing hidden, some, all
        want = max(0, 4 * link.alpha + w / link.bandwidth - seconds / 3)
        want += max(0, 4 * link.alpha + f / link.bandwidth - 2 * seconds / 3)
        assert exposed_time(t, link, seconds) == pytest.approx(want, rel=1e-12)
    # a window of 0 hides nothing
    o = HostTransfer("optimizer", "to device", compute)
    assert exposed_time([o], link, 1e9) == transfer_time(o, link)
    assert transfer_time(HostTransfer("x", "to host", 0.0), link) == 0.0


def test_offload_dots_keeps_full_remats_device_memory_at_save_dots_flops():
    base = Candidate(1, 8, 8, 1, "hsdp")
    none, dots, full, host = (
        _modelled(dataclasses.replace(base, remat=r))
        for r in ("none", "save-dots", "full", "offload-dots")
    )
    assert host.memory["activations"] == full.memory["activations"]
    assert host.host["activations"] == pytest.approx(dots.memory["activations"], rel=1e-12)
    assert host.flops_per_device == dots.flops_per_device < full.flops_per_device
    # every residual goes to host in the forward and comes back in the backward
    link = PROFILES["h100"].host
    moved = host.host["activations"]
    each_way = 32 * link.alpha + moved / link.bandwidth
    assert host.estimate.host_s["residuals to host"] == pytest.approx(each_way, rel=1e-12)
    assert host.estimate.host_s["residuals to device"] == pytest.approx(each_way, rel=1e-12)
    c = host.estimate.compute_s
    want = max(0, each_way - c / 3) + max(0, each_way - 2 * c / 3)
    assert host.estimate.host_exposed_s == pytest.approx(want, rel=1e-9)
    assert host.estimate.total_s == pytest.approx(
        dots.estimate.total_s + host.estimate.host_exposed_s, rel=1e-9
    )
    assert none.host == {} == dots.host


def test_the_optimizer_on_host_leaves_the_larger_of_moments_and_activations():
    for cand, batch in (
        (Candidate(1, 1, 8, 1, "fsdp", "full"), 512),
        (Candidate(1, 8, 1, 1, "dp"), 8),
    ):
        on_device = _modelled(cand, batch=batch)
        on_host = _modelled(dataclasses.replace(cand, offload=True), batch=batch)
        m = on_device.memory
        rest = m["parameters"] + m["gradients"]
        want = rest + max(m["optimizer"], m["activations"] + m["logits"])
        assert on_host.peak == pytest.approx(want, rel=1e-12)
        assert on_host.peak < on_device.peak
        assert on_host.host == {"optimizer": m["optimizer"]}
        # fetched after the backward and written back after the update: both exposed
        link = PROFILES["h100"].host
        leaves = on_host.estimate.host_s
        assert on_host.estimate.host_exposed_s == pytest.approx(sum(leaves.values()), rel=1e-12)
        assert sum(leaves.values()) > 2 * m["optimizer"] / link.bandwidth


def test_a_7b_on_8_h100s_fits_only_with_the_optimizer_on_host(capsys):
    with pytest.raises(PlanError, match="no layout of 8 devices fits"):
        plan(SEVEN_B, devices=8, batch=512, seq_len=2048, device=profile("h100"),
             memory_cap=80e9, confirm=0, offload=False)  # fmt: skip
    p = plan(SEVEN_B, devices=8, batch=512, seq_len=2048, device=profile("h100"),
             memory_cap=80e9, confirm=0)  # fmt: skip
    assert p.best.candidate.offload and p.best.modelled.peak <= 80e9
    assert p.without_offload is None
    lines = reasoning(p, 1)
    assert lines[1].startswith("offload: no layout fits in device memory without it")
    assert "the best keeps the optimizer state in host memory" in lines[1]
    assert any(line.strip().startswith("host memory optimizer") for line in lines)
    argv = "plan --model 7b --devices 8 --batch 512 --confirm 0".split()
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["train_flags"]["offload"] == "optimizer" and out["host_bytes"]["optimizer"] > 0
    assert main([*argv, "--no-offload"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no layout of 8 devices fits" in err[0]


def test_a_7b_on_64_gh200s_runs_faster_with_its_residuals_on_host():
    gh200 = profile("gh200")
    kw = dict(devices=64, batch=1024, seq_len=2048, device=gh200, memory_cap=gh200.memory)
    p = plan(SEVEN_B, confirm=0, **kw)
    off = plan(SEVEN_B, confirm=0, offload=False, **kw)
    assert p.best.candidate.remat == "offload-dots"
    assert p.without_offload.candidate == off.best.candidate
    assert p.best.modelled.estimate.total_s < off.best.modelled.estimate.total_s
    assert reasoning(p, 1)[1].startswith("offload: keeping the remat residuals in host memory is")


def test_a_7b_on_64_h100s_gains_nothing_from_offload():
    """The sharded optimizer state is small (1/64 of it per device) and PCIe cannot carry a
    7B step's residuals during its forward: the plan is the one without offload."""
    h100 = profile("h100")
    for batch, seq in ((128, 2048), (128, 4096)):
        cfg = dataclasses.replace(SEVEN_B, max_seq_len=seq)
        kw = dict(devices=64, batch=batch, seq_len=seq, device=h100, memory_cap=80e9, confirm=0)
        p, off = plan(cfg, **kw), plan(cfg, offload=False, **kw)
        assert p.offload and p.best.candidate == off.best.candidate
        lines = reasoning(p, 1)
        assert " · offload not needed · " in lines[0]
        assert not any(line.startswith("offload:") for line in lines)
    best = p.best.candidate
    host = _modelled(dataclasses.replace(best, remat="offload-dots"), cfg, batch=128)
    assert host.estimate.host_exposed_s > 0  # the forward is shorter than the writes


def test_host_memory_bounds_what_offload_may_move():
    small = dataclasses.replace(profile("h100"), host_memory=1e9)
    with pytest.raises(PlanError, match="no layout of 8 devices fits"):
        plan(SEVEN_B, devices=8, batch=512, seq_len=2048, device=small, memory_cap=80e9,
             confirm=0)  # fmt: skip


def test_a_profile_without_a_host_link_plans_no_offload():
    tpu = profile("tpu-v5e")
    cfg = gpt_config("125m", 1024, "bfloat16")
    p = plan(cfg, devices=8, batch=16, seq_len=1024, device=tpu, memory_cap=tpu.memory, confirm=0)
    assert not p.offload
    assert all(not c.modelled.offloads for c in p.ranked)


def test_the_planners_compile_counts_an_offloaded_optimizer_as_host_memory():
    """On as many simulated devices as the plan, the planner confirms a candidate by compiling
    its real train step; with the optimizer state on host, the device bytes it reads fall by
    the moments' bytes (Adam's two per parameter, at least 0.9 of them)."""
    from meshtrain.models.base import DataSpec
    from meshtrain.plan.search import _default_compile

    cfg = gpt_config("tiny", 64, "float32")
    compile_peak = _default_compile(cfg, DataSpec("lm", 16, 64, cfg.vocab_size, None), 8)
    assert compile_peak is not None  # the suite simulates 8 devices
    dp = Candidate(1, 8, 1, 1, "dp", "full")
    on_device, on_host = compile_peak(dp), compile_peak(dataclasses.replace(dp, offload=True))
    moments = _modelled(dp, cfg, batch=16, device="cpu-sim").memory["optimizer"]
    assert moments > 0 and on_device - on_host >= 0.9 * moments


def test_host_transfers_on_a_profile_without_a_host_link_are_refused():
    from meshtrain.costmodel import step_time

    with pytest.raises(ValueError, match="device='tpu-v5e': no host-link figure"):
        step_time(
            flops=1e12,
            hbm_bytes=0.0,
            comm=[],
            sizes={"data": 8},
            device=profile("tpu-v5e"),
            host=[HostTransfer("optimizer", "to device", 1e9)],
        )
