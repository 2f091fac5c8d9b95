"""Several features at once against one device: each case trains a tiny GPT or MoE for 2 steps
on 8 simulated devices with a combination of features and compares losses and parameters
with the same run on one device, so one case proves every pair it combines (its ``pair``
marks, checked against its features below). The cases cover the cells of the composition
matrix that no feature's own tests cover, chosen by a set cover weighted by each case's
measured cost (compiling dominates it: fp8 and pipelines cost most).

Tolerances: float32 as the context-parallel GPT tests (loss 1e-5, parameters 5e-5 absolute
after plain SGD steps of lr 0.1, which move them by ~1e-2); bf16 compute as the
context-parallel CLI test (2e-2 on the loss) and, on the parameters, each leaf's update within
8% in relative Frobenius norm (bf16 rounds each product to ~0.4% and the 8-device run sums in
another order; in an MoE a token near a routing tie may pick another expert); fp16 likewise,
2e-3 and 3% (it rounds to 2⁻¹¹; tests/test_precision.py measures ~1e-5 and 0.1% on plain
layouts); fp8 2e-2 and 15% (its gradients are rounded to 2⁻³, and another summation order
moves entries across that grid: ~7% measured on plain layouts); the bf16 codec
of gradient compression rounds the exchanged gradient twice (<= 0.8% of it), so each entry of
an update is held to 2% of the leaf's largest. With ``resume``, the 8-device state is saved and
restored onto another layout (one device, or the same replicas where compression or local
SGD keep per-replica state), bit-equal, and its next step equals the one-device run's third.

The one-device reference of a feature whose reference is not one device: staleness runs the
same way on one device; gradient compression is compared with the uncompressed run (its
codec's tolerance); local SGD and DiLoCo synchronise every step (H = 1), which is synchronous
SGD (DiLoCo: the inner update passed through the outer Nesterov SGD).
"""

from __future__ import annotations

import dataclasses
import math
from itertools import combinations

import jax
import numpy as np
import optax
import pytest
from _cudnn import cudnn_stand_in
from _helpers import initial_values, model_from, packed_layout

from meshtrain.check import check_run
from meshtrain.checkpoint import CheckpointManager, restore
from meshtrain.layout import batch_shardings, rules_for, shard_batch
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh, mesh_sizes
from meshtrain.models import DataSpec, GPTConfig, MoEConfig
from meshtrain.offload import Offload, with_offload
from meshtrain.optim import OptimConfig, make_optimizer
from meshtrain.pipeline import PipelineConfig
from meshtrain.pipeline.schedules import CHUNKED
from meshtrain.precision import Precision, with_loss_scale
from meshtrain.replicas import SyncConfig, with_sync
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.state import abstract_target

B, T, STEPS = 16, 16, 2
MICROBATCHES = 2  # a pipeline's (pipe = 2)
LR = 0.1
# Plain SGD (no momentum, decay or clipping): the update is -lr · gradient, so the parameters'
# difference bounds the gradients', and a replica's clipping cannot differ from the whole's.
OPTIM = OptimConfig(
    optimizer="sgd", lr=LR, momentum=0.0, weight_decay=0.0, clip_norm=0.0, warmup_steps=0
)
TX = make_optimizer(OPTIM, 10)
# Qwen3's attention: heads wider than d_model / n_heads (4 × 16 on 32) and query/key norms, so
# every cell is proven with them.
GPT = GPTConfig(
    style="llama", n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True,
    max_seq_len=T, vocab_size=64, vocab_multiple=16,
)  # fmt: skip
# The Pallas kernels' head width is 64: two heads, one key/value head.
PALLAS = dataclasses.replace(
    GPT, n_layers=2, d_model=128, n_heads=2, n_kv_heads=1, head_dim=64, attention_impl="pallas",
    norm_impl="pallas",
)  # fmt: skip
MOE = MoEConfig(
    d_model=32, n_heads=2, head_dim=24, qk_norm=True, n_experts=4, top_k=2, d_expert=16,
    n_layers=2, vocab_size=64, vocab_multiple=16, max_seq_len=T, capacity_factor=4.0,
)  # fmt: skip
LOSS_ATOL, PARAM_ATOL = 1e-5, 5e-5  # float32
# (loss atol, update relative Frobenius) of the lower precisions
LOW = {"bf16": (2e-2, 8e-2), "fp16": (2e-3, 3e-2), "fp8": (2e-2, 0.15)}
# A token whose top-k choice sits within the precision's rounding of a tie picks another expert
# in one layout than in the other, moving its share of the update between two experts. That
# share does not shrink with the precision: one such choice moved 4.9% of the stacked experts'
# update (fp16, 2 steps of the test MoE), so expert and router leaves are held to 12% (two),
# in Frobenius norm, with a lossy codec; under a lower precision that share adds to the
# precision's own error as independent errors do, in quadrature (fp8: 19%; an fp8 MoE with
# cuDNN's bfloat16 attention has come out at 15.04%, over fp8's 15% alone).
ROUTING_FLIP_RTOL = 0.12
LOSS_SCALE = 2.0**10  # float16's first loss scale here: no overflow on these tiny models
CODEC_UPDATE_RTOL = 2e-2


@dataclasses.dataclass(frozen=True)
class Case:
    """One combination of features (see `features`)."""

    mesh: str
    strategy: str
    model: str = "gpt"  # gpt, pallas (the GPT with the Pallas kernels), moe-capacity, moe-dropless
    pallas: bool = False  # an MoE with the Pallas attention
    cudnn: bool = False  # the GPT or MoE with cuDNN's attention
    context: str | None = None  # ring, allgather, ulysses (with seq > 1 in `mesh`)
    # gpipe, circular, 1f1b, interleaved-1f1b, zb-h1 (with pipe > 1 in `mesh`); circular and
    # interleaved-1f1b hold two chunks of layers per stage
    schedule: str | None = None
    packed: bool = False
    sync: SyncConfig = SyncConfig()
    remat: bool = False
    offload: bool = False  # the optimizer state in host memory (Offload(optimizer=True))
    offload_acts: bool = False  # a remat policy that moves residuals to host memory
    accum: int = 1
    precision: str = "fp32"  # bf16, fp16 or fp8: the precision policy
    resume: bool = False
    # Where to resume: one device, or (mesh, strategy) with the same replicas, for the
    # per-replica state of compression and local SGD.
    resume_onto: tuple[str, str] | None = None

    def features(self) -> set[str]:
        """The matrix feature ids this case combines."""
        parts = self.strategy.split("+")
        out = {parts[0] if parts[0] != "tp" else "dp", *(["tp"] if "tp" in parts else [])}
        out |= {f for f in (self.context, self.schedule) if f}
        out |= {self.model} if self.model.startswith("moe") else set()
        out |= {"pallas"} if self.model == "pallas" or self.pallas else set()
        out |= {"cudnn"} if self.cudnn else set()
        sync = self.sync
        own = sync.local and not (sync.gossips or sync.federates)  # local SGD or DiLoCo
        flags = {
            "packed": self.packed,
            "compression": sync.compresses,
            "local-sgd": own and sync.outer_optimizer == "average",
            "diloco": own and sync.outer_optimizer != "average",
            "gossip": sync.gossips,
            "federated": sync.federates,
            "staleness": bool(sync.staleness),
            "remat": self.remat,
            "offload-optimizer": self.offload,
            "offload-activations": self.offload_acts,
            "accumulation": self.accum > 1,
            "resume-relayout": self.resume,
        }
        out |= {self.precision} if self.precision != "fp32" else set()
        return out | {f for f, on in flags.items() if on}

    def config(self):
        """The model config."""
        base = {"gpt": GPT, "pallas": PALLAS}.get(self.model)
        if base is PALLAS and self.schedule in CHUNKED:  # 2 stages × 2 chunks of layers
            base = dataclasses.replace(base, n_layers=4)
        if base is None:
            dispatch = self.model.removeprefix("moe-")
            base = dataclasses.replace(MOE, dispatch=dispatch)
            if dispatch == "dropless":  # its capacity factor would have no effect
                base = dataclasses.replace(base, capacity_factor=MoEConfig.capacity_factor)
            if self.schedule in CHUNKED:  # 2 stages × 2 chunks of layers
                base = dataclasses.replace(base, n_layers=4)
            if self.pallas:
                base = dataclasses.replace(base, d_model=128, head_dim=64, attention_impl="pallas")
        if self.cudnn:  # cuDNN's head width: 64 (the Pallas GPT's shape)
            # Without query/key norms: with them, hsdp+tp-cudnn-remat-bf16 deadlocks XLA's CPU
            # runtime (an all-gather over 2 devices waits on a permute over 8).
            shape = {"d_model": 128, "head_dim": 64, "qk_norm": False}
            if self.model == "gpt":
                shape |= {"n_heads": 2, "n_kv_heads": 1}
            base = dataclasses.replace(base, attention_impl="cudnn", **shape)
        remat = "full" if self.remat else "offload-dots" if self.offload_acts else "none"
        return Precision(policy=self.precision).applied(dataclasses.replace(base, remat=remat))


def _batches(case, vocab, n):
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    out = []
    for _ in range(n):  # noqa: B007
        tokens = rng.integers(0, vocab, (B, T + 1), np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        if case.packed:
            batch["segment_ids"], batch["positions"] = packed_layout(rng, B, T, longest=T // 3)
        out.append(batch)
    return out


def _reference(case):
    """The one-device run's sync settings and optimizer: staleness as the case (it needs no
    replicas); no compression (its codec's tolerance applies); for local SGD with H = 1,
    synchronous SGD, and for DiLoCo with H = 1, the inner step's change applied through the
    outer Nesterov SGD (the outer gradient θ̄ − mean θ_r is minus the mean inner update)."""
    sync = case.sync
    tx = TX
    if sync.local and sync.outer_optimizer == "nesterov":
        assert sync.sync_every == 1
        outer = optax.sgd(sync.outer_lr, momentum=sync.outer_momentum, nesterov=True)
        tx = optax.chain(TX, optax.scale(-1.0), outer)
    return SyncConfig(staleness=sync.staleness), tx


def _setup(case, mesh_str, strategy, devices, accum, sync=None, tx=TX, offload=False):
    """State, shardings and the jitted step of `case` on one layout (`sync`: the case's;
    `offload`: the optimizer state in host memory)."""
    sync = case.sync if sync is None else sync
    cfg = case.config()
    mesh = make_mesh(mesh_str, devices=devices)
    split = mesh.shape.get("seq", 1) > 1  # an algorithm on seq = 1 would have no effect
    rules = rules_for(strategy, mesh, context_parallel=(split and case.context) or "ring")
    values = initial_values(dataclasses.replace(cfg, remat="none"))  # remat makes no parameter

    scaled = {"loss_scale_init": LOSS_SCALE} if case.precision == "fp16" else {}
    precision = Precision(policy=case.precision, **scaled)
    if precision.loss_scaling(cfg):  # float16: the scale rides in the optimizer state
        tx = with_loss_scale(tx, LOSS_SCALE)
    graphdef, state, shardings = init_train_state(model_from(cfg, values), tx, mesh, rules)
    state, shardings = with_sync(sync, tx, state, shardings, mesh, rules)
    state, shardings = with_offload(Offload(optimizer=offload), state, shardings)
    pipeline = PipelineConfig(
        schedule=case.schedule or "gpipe",
        microbatches=MICROBATCHES,
        repeats=2 if case.schedule in CHUNKED else 1,
    )
    if mesh.shape.get("pipe", 1) == 1:  # pipeline settings would have no effect
        pipeline = PipelineConfig()
    train = TrainConfig(accum_steps=accum, run_dir="")
    run = RunSpec(
        mesh=mesh,
        rules=rules,
        train=train,
        optim=OPTIM,
        pipeline=pipeline,
        sync=sync,
        precision=precision,
        offload=Offload(optimizer=offload),
    )
    data = DataSpec("lm", B, T, cfg.vocab_size, packed=case.packed)
    # the run check accepts the combination: nothing refused is run here
    assert check_run(run.replace(model=cfg, data=data, mesh=mesh_sizes(mesh))) == []
    example = _batches(case, cfg.vocab_size, 1)[0]
    step = jit_train_step(run, graphdef, tx, shardings, batch_shardings(example, mesh, rules))
    return state, shardings, lambda s, b: step(s, shard_batch(b, mesh, rules))


def _train(case, state, step, batches):
    """Losses and host parameters after each of `batches`; the final state."""
    losses, params = [], []
    for b in batches:
        state, m = step(state, b)
        assert int(m["skipped"]) == 0 and int(m.get("overflow", 0)) == 0
        losses.append(float(m["loss"]))
        params.append(jax.tree.map(np.asarray, state.params))
    return np.array(losses), params, state


def _assert_same(case, loss, params, want_loss, want_params, start):
    """Losses and parameters agree (float32); under bf16, fp16 or fp8, each leaf's update in
    relative Frobenius norm (a token near a routing tie may pick another expert, moving a few
    entries: `ROUTING_FLIP_RTOL` for the experts and the router); under a lossy codec, each
    entry of each update (with a lower precision, the Frobenius norm again, at least bf16's
    tolerance)."""
    low = LOW.get(case.precision)
    atol = low[0] if low else LOSS_ATOL
    if case.sync.compresses:
        atol = max(atol, 1e-3)
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=atol)
    leaves = jax.tree_util.tree_leaves_with_path(want_params)
    got, flat_start = jax.tree.leaves(params), jax.tree.leaves(start)
    updates = [np.asarray(w - s, np.float64) for (_, w), s in zip(leaves, flat_start, strict=True)]
    largest = max(float(np.abs(u).max()) for u in updates)
    largest_norm = max(float(np.linalg.norm(u)) for u in updates)
    for (path, w), g, s, u in zip(leaves, got, flat_start, updates, strict=True):
        name = jax.tree_util.keystr(path)
        assert g.shape == w.shape, name
        flips = "['moe']" in name and bool(low or case.sync.compresses)  # routing ties
        if low or flips:
            # a leaf whose updates are tiny is held to a share of the largest leaf's
            err = float(np.linalg.norm((g - s) - u))
            rtol = low[1] if low else 0.0
            rtol = max(rtol, LOW["bf16"][1]) if case.sync.compresses else rtol
            if flips:  # a lossy codec's flips alone; a lower precision's with its own error
                rtol = math.hypot(low[1], ROUTING_FLIP_RTOL) if low else ROUTING_FLIP_RTOL
            bound = rtol * max(float(np.linalg.norm(u)), 0.02 * largest_norm)
            assert err <= bound, f"{name}: |Δ got − Δ want| = {err:.2e} > {bound:.2e}"
        elif case.sync.compresses:
            bound = CODEC_UPDATE_RTOL * max(float(np.abs(u).max()), 0.02 * largest)
            np.testing.assert_allclose(g - s, u, rtol=0, atol=bound, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=PARAM_ATOL, err_msg=name)
    assert largest > 20 * PARAM_ATOL  # it trained: the comparison is not of two idle runs


def _check(case, tmp_path):
    """Trains `case` on 8 devices and on one; compares; resumes onto one device if asked."""
    cfg = case.config()
    one_accum = case.accum
    if case.schedule and case.model.startswith("moe"):
        one_accum *= MICROBATCHES  # the router losses are per microbatch
    batches = _batches(case, cfg.vocab_size, STEPS + 1)
    one = jax.devices()[:1]
    # Rematerialisation and activation offload recompute or move values, not the math: the
    # one-device run goes without, so cases differing only there share its compiled step.
    plain = dataclasses.replace(case, remat=False, offload_acts=False)
    ref_state, ref_shardings, ref_step = _setup(
        plain, "data=1", "dp", one, one_accum, *_reference(case)
    )
    target, next_step = abstract_target(ref_state, ref_shardings), ref_step
    if case.resume_onto:
        other, other_shardings, next_step = _setup(case, *case.resume_onto, None, case.accum)
        target = abstract_target(other, other_shardings)
    start = jax.tree.map(np.asarray, ref_state.params)
    # the one-device run's third step is the resumed run's reference
    want_loss, want_params, _ = _train(case, ref_state, ref_step, batches[: STEPS + case.resume])

    state, _, step = _setup(case, case.mesh, case.strategy, None, case.accum, offload=case.offload)
    loss, params, state = _train(case, state, step, batches[:STEPS])
    _assert_same(case, loss, params[-1], want_loss[:STEPS], want_params[STEPS - 1], start)
    if not case.resume:
        return
    saved = jax.device_get(state)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(STEPS, state)
    restored = restore(tmp_path / "ck", target)
    assert restored.step == STEPS
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    loss3, params3, _ = _train(case, restored.state, next_step, batches[STEPS:])
    _assert_same(case, loss3, params3[-1], want_loss[STEPS:], want_params[STEPS], start)


def _pairs(features) -> set[tuple[str, str]]:
    from meshtrain.composition.matrix import cell

    return {cell(a, b) for a, b in combinations(sorted(features), 2)}


pair = pytest.mark.pair


def _case(case: Case, features: tuple[str, ...], id: str):
    """`case` with a pair mark for every two of its `features` (the test checks them against
    the case's own `features()`)."""
    return pytest.param(case, marks=[pair(a, b) for a, b in combinations(features, 2)], id=id)


# Written out from the weighted cover. Each case names its features once (in the matrix's
# order) and carries a pair mark for every two of them; the test checks that list against the
# case's own `features()`.
CASES = [
    # float32
    _case(
        Case("data=2,seq=2,tensor=2", "dp+tp", model="moe-dropless", context="allgather", accum=2),
        ("dp", "tp", "allgather", "moe-dropless", "accumulation"),
        "dp+tp-moe-dropless-allgather-accum",
    ),
    _case(
        Case("pipe=2,data=2,tensor=2", "dp+tp", model="pallas", schedule="1f1b", packed=True,
             sync=SyncConfig(client_fraction=1.0, sync_every=1), offload=True, accum=2),
        ("dp", "tp", "1f1b", "packed", "federated", "pallas", "offload-optimizer", "accumulation"),
        "dp+tp-pallas-1f1b-packed-federated-offload-opt-accum",
    ),
    _case(
        Case("pipe=2,data=2,fsdp=2", "hsdp", schedule="gpipe",
             sync=SyncConfig(gossip="ring", sync_every=1), remat=True, accum=2),
        ("hsdp", "gpipe", "gossip", "remat", "accumulation"),
        "hsdp-gpipe-gossip-remat-accum",
    ),
    _case(
        Case("data=2,fsdp=2,seq=2", "hsdp", context="ring", offload_acts=True, accum=2),
        ("hsdp", "ring", "offload-activations", "accumulation"),
        "hsdp-ring-offload-acts-accum",
    ),
    _case(
        Case("pipe=2,data=2,expert=2", "dp", model="moe-capacity", pallas=True, schedule="zb-h1",
             offload_acts=True),
        ("dp", "zb-h1", "moe-capacity", "pallas", "offload-activations"),
        "dp-moe-capacity-pallas-zb-h1-offload-acts",
    ),
    _case(
        Case("pipe=2,data=2,fsdp=2", "hsdp", schedule="gpipe", sync=SyncConfig(staleness=1)),
        ("hsdp", "gpipe", "staleness"),
        "hsdp-gpipe-staleness",
    ),
    # context parallelism inside pipeline stages: every schedule with every algorithm, with
    # packed documents, the MoE (over expert) and the 4-D layouts
    _case(
        Case("pipe=2,data=2,seq=2", "dp", schedule="gpipe", context="ring", packed=True),
        ("dp", "gpipe", "ring", "packed"),
        "dp-gpipe-ring-packed",
    ),
    _case(
        Case("pipe=2,seq=2,tensor=2", "dp+tp", schedule="gpipe", context="allgather",
             offload=True),
        ("dp", "tp", "gpipe", "allgather", "offload-optimizer"),
        "dp+tp-gpipe-allgather-offload-opt",
    ),
    _case(
        Case("pipe=2,seq=2,expert=2", "zero1", model="moe-capacity", schedule="gpipe",
             context="ulysses"),
        ("zero1", "gpipe", "ulysses", "moe-capacity"),
        "zero1-moe-capacity-gpipe-ulysses",
    ),
    _case(
        Case("pipe=2,data=2,seq=2", "zero1", schedule="1f1b", context="ring", offload_acts=True),
        ("zero1", "1f1b", "ring", "offload-activations"),
        "zero1-1f1b-ring-offload-acts",
    ),
    _case(
        Case("pipe=2,data=2,seq=2", "dp", schedule="1f1b", context="allgather", packed=True,
             accum=2),
        ("dp", "1f1b", "allgather", "packed", "accumulation"),
        "dp-1f1b-allgather-packed-accum",
    ),
    _case(
        Case("pipe=2,data=2,seq=2", "dp", schedule="1f1b", context="ulysses", remat=True),
        ("dp", "1f1b", "ulysses", "remat"),
        "dp-1f1b-ulysses-remat",
    ),
    _case(
        Case("pipe=2,data=2,seq=2", "dp", schedule="zb-h1", context="ring", packed=True),
        ("dp", "zb-h1", "ring", "packed"),
        "dp-zb-h1-ring-packed",
    ),
    _case(
        Case("pipe=2,data=2,seq=2", "zero1", schedule="zb-h1", context="allgather", remat=True),
        ("zero1", "zb-h1", "allgather", "remat"),
        "zero1-zb-h1-allgather-remat",
    ),
    _case(
        Case("pipe=2,seq=2,expert=2", "dp", model="moe-dropless", schedule="zb-h1",
             context="ulysses"),
        ("dp", "zb-h1", "ulysses", "moe-dropless"),
        "dp-moe-dropless-zb-h1-ulysses",
    ),
    _case(
        Case("pipe=2,seq=2,tensor=2", "dp+tp", schedule="circular", context="ring", packed=True),
        ("dp", "tp", "circular", "ring", "packed"),
        "dp+tp-circular-ring-packed",
    ),
    _case(
        Case("pipe=2,fsdp=2,seq=2", "fsdp", schedule="circular", context="allgather", accum=2),
        ("fsdp", "circular", "allgather", "accumulation"),
        "fsdp-circular-allgather-accum",
    ),
    _case(
        Case("pipe=2,fsdp=2,seq=2", "fsdp", schedule="circular", context="ulysses", remat=True),
        ("fsdp", "circular", "ulysses", "remat"),
        "fsdp-circular-ulysses-remat",
    ),
    _case(
        Case("pipe=2,data=2,seq=2", "dp", model="moe-capacity", schedule="interleaved-1f1b",
             context="ring"),
        ("dp", "interleaved-1f1b", "ring", "moe-capacity"),
        "dp-moe-capacity-interleaved-1f1b-ring",
    ),
    _case(
        Case("pipe=2,data=2,seq=2", "dp", schedule="interleaved-1f1b", context="allgather",
             packed=True),
        ("dp", "interleaved-1f1b", "allgather", "packed"),
        "dp-interleaved-1f1b-allgather-packed",
    ),
    _case(
        Case("pipe=2,data=2,seq=2", "zero1", schedule="interleaved-1f1b", context="ulysses",
             accum=2),
        ("zero1", "interleaved-1f1b", "ulysses", "accumulation"),
        "zero1-interleaved-1f1b-ulysses-accum",
    ),
    # bf16 compute
    _case(
        Case("fsdp=8", "fsdp", cudnn=True, offload_acts=True, offload=True, precision="bf16"),
        ("fsdp", "cudnn", "offload-optimizer", "offload-activations", "bf16"),
        "fsdp-cudnn-offload-acts-offload-opt-bf16",
    ),
    _case(
        Case("data=2,fsdp=2,tensor=2", "hsdp+tp", cudnn=True, remat=True, precision="bf16"),
        ("hsdp", "tp", "cudnn", "remat", "bf16"),
        "hsdp+tp-cudnn-remat-bf16",
    ),
    _case(
        Case("pipe=2,data=2,fsdp=2", "hsdp", cudnn=True, schedule="circular", packed=True,
             precision="bf16"),
        ("hsdp", "circular", "packed", "cudnn", "bf16"),
        "hsdp-circular-packed-cudnn-bf16",
    ),
    _case(
        Case("pipe=2,data=2,tensor=2", "dp+tp", model="pallas", schedule="zb-h1", packed=True,
             sync=SyncConfig(gossip="ring", sync_every=1), offload_acts=True, offload=True,
             precision="bf16"),
        ("dp", "tp", "zb-h1", "packed", "gossip", "pallas", "offload-optimizer",
         "offload-activations", "bf16"),
        "dp+tp-pallas-zb-h1-packed-gossip-offload-acts-offload-opt-bf16",
    ),
    _case(
        Case("data=2,fsdp=2,seq=2", "hsdp", model="moe-capacity", context="allgather",
             sync=SyncConfig(staleness=1), remat=True, precision="bf16", resume=True),
        ("hsdp", "allgather", "moe-capacity", "staleness", "remat", "bf16", "resume-relayout"),
        "hsdp-moe-capacity-allgather-staleness-remat-bf16-resume",
    ),
    _case(
        Case("pipe=2,data=2,fsdp=2", "hsdp", model="moe-dropless", pallas=True, schedule="zb-h1",
             packed=True, sync=SyncConfig(grad_compression="bf16", staleness=1),
             offload_acts=True, precision="bf16"),
        ("hsdp", "zb-h1", "moe-dropless", "packed", "compression", "staleness", "pallas",
         "offload-activations", "bf16"),
        "hsdp-moe-dropless-pallas-zb-h1-packed-compression-staleness-offload-acts-bf16",
    ),
    _case(
        Case("pipe=2,data=2,fsdp=2", "hsdp", cudnn=True, schedule="zb-h1",
             sync=SyncConfig(sync_every=1, outer_optimizer="nesterov"), offload_acts=True,
             accum=2, precision="bf16"),
        ("hsdp", "zb-h1", "diloco", "cudnn", "offload-activations", "accumulation", "bf16"),
        "hsdp-zb-h1-diloco-cudnn-offload-acts-accum-bf16",
    ),
    _case(
        Case("pipe=2,data=2,expert=2", "zero1", model="moe-capacity", schedule="circular",
             sync=SyncConfig(staleness=1), offload=True, accum=2, precision="bf16"),
        ("zero1", "circular", "moe-capacity", "staleness", "offload-optimizer", "accumulation",
         "bf16"),
        "zero1-moe-capacity-circular-staleness-offload-opt-accum-bf16",
    ),
    _case(
        Case("data=2,expert=2,seq=2", "zero1", model="moe-capacity", context="ulysses",
             sync=SyncConfig(staleness=1), offload=True, precision="bf16"),
        ("zero1", "ulysses", "moe-capacity", "staleness", "offload-optimizer", "bf16"),
        "zero1-moe-capacity-ulysses-staleness-offload-opt-bf16",
    ),
    _case(
        Case("data=4,expert=2", "zero1", model="moe-dropless", cudnn=True,
             sync=SyncConfig(staleness=1), accum=2, precision="bf16"),
        ("zero1", "moe-dropless", "staleness", "cudnn", "accumulation", "bf16"),
        "zero1-moe-dropless-cudnn-staleness-accum-bf16",
    ),
    _case(
        Case("data=8", "zero1", model="pallas", packed=True, sync=SyncConfig(sync_every=1),
             offload_acts=True, precision="bf16"),
        ("zero1", "packed", "local-sgd", "pallas", "offload-activations", "bf16"),
        "zero1-pallas-packed-local-sgd-offload-acts-bf16",
    ),
    _case(
        Case("pipe=2,data=4", "zero1", schedule="zb-h1",
             sync=SyncConfig(client_fraction=1.0, sync_every=1), offload_acts=True,
             precision="bf16", resume=True, resume_onto=("pipe=2,data=4", "dp")),
        ("zero1", "zb-h1", "federated", "offload-activations", "bf16", "resume-relayout"),
        "zero1-zb-h1-federated-offload-acts-bf16-resume",
    ),
    # float16 with loss scaling
    _case(
        Case("pipe=2,data=4", "dp", schedule="1f1b", precision="fp16"),
        ("dp", "1f1b", "fp16"),
        "dp-1f1b-fp16",
    ),
    _case(
        Case("pipe=2,data=2,expert=2", "dp", model="moe-capacity", schedule="interleaved-1f1b",
             packed=True, precision="fp16", resume=True),
        ("dp", "interleaved-1f1b", "moe-capacity", "packed", "fp16", "resume-relayout"),
        "dp-moe-capacity-interleaved-1f1b-packed-fp16-resume",
    ),
    _case(
        Case("fsdp=2,seq=2,tensor=2", "fsdp+tp", context="ring", precision="fp16"),
        ("fsdp", "tp", "ring", "fp16"),
        "fsdp+tp-ring-fp16",
    ),
    _case(
        Case("pipe=2,fsdp=4", "fsdp", schedule="circular", precision="fp16"),
        ("fsdp", "circular", "fp16"),
        "fsdp-circular-fp16",
    ),
    _case(
        Case("data=2,fsdp=2,seq=2", "hsdp", model="moe-dropless", context="ulysses", remat=True,
             accum=2, precision="fp16", resume=True),
        ("hsdp", "ulysses", "moe-dropless", "remat", "accumulation", "fp16", "resume-relayout"),
        "hsdp-moe-dropless-ulysses-remat-accum-fp16-resume",
    ),
    _case(
        Case("data=4,seq=2", "zero1", context="allgather", offload_acts=True, precision="fp16"),
        ("zero1", "allgather", "offload-activations", "fp16"),
        "zero1-allgather-offload-acts-fp16",
    ),
    _case(
        Case("pipe=2,data=4", "zero1", schedule="gpipe", sync=SyncConfig(grad_compression="int8"),
             offload=True, precision="fp16", resume=True, resume_onto=("pipe=2,data=4", "dp")),
        ("zero1", "gpipe", "compression", "offload-optimizer", "fp16", "resume-relayout"),
        "zero1-gpipe-compression-offload-opt-fp16-resume",
    ),
    _case(
        Case("pipe=2,data=4", "zero1", schedule="zb-h1", precision="fp16"),
        ("zero1", "zb-h1", "fp16"),
        "zero1-zb-h1-fp16",
    ),
    # fp8 matmuls
    _case(
        Case("data=4,expert=2", "dp", model="moe-capacity", cudnn=True, precision="fp8",
             resume=True),
        ("dp", "moe-capacity", "cudnn", "fp8", "resume-relayout"),
        "dp-moe-capacity-cudnn-fp8-resume",
    ),
    _case(
        Case("data=4,seq=2", "dp", context="ulysses", packed=True, cudnn=True, offload_acts=True,
             precision="fp8"),
        ("dp", "ulysses", "packed", "cudnn", "offload-activations", "fp8"),
        "dp-ulysses-packed-cudnn-offload-acts-fp8",
    ),
    _case(
        Case("fsdp=4,seq=2", "fsdp", context="allgather", offload=True, precision="fp8"),
        ("fsdp", "allgather", "offload-optimizer", "fp8"),
        "fsdp-allgather-offload-opt-fp8",
    ),
    _case(
        Case("data=2,fsdp=4", "hsdp", cudnn=True, sync=SyncConfig(grad_compression="int8"),
             remat=True, precision="fp8"),
        ("hsdp", "compression", "cudnn", "remat", "fp8"),
        "hsdp-compression-cudnn-remat-fp8",
    ),
    _case(
        Case("pipe=2,data=2,fsdp=2", "hsdp", cudnn=True, schedule="gpipe",
             sync=SyncConfig(client_fraction=1.0, sync_every=1), remat=True, precision="fp8"),
        ("hsdp", "gpipe", "federated", "cudnn", "remat", "fp8"),
        "hsdp-gpipe-federated-cudnn-remat-fp8",
    ),
    _case(
        Case("pipe=2,data=2,fsdp=2", "hsdp", cudnn=True, schedule="zb-h1",
             sync=SyncConfig(sync_every=1), remat=True, offload=True, precision="fp8", resume=True,
             resume_onto=("pipe=2,data=2,tensor=2", "dp+tp")),
        ("hsdp", "zb-h1", "local-sgd", "cudnn", "remat", "offload-optimizer", "fp8",
         "resume-relayout"),
        "hsdp-zb-h1-local-sgd-cudnn-remat-offload-opt-fp8-resume",
    ),
    _case(
        Case("data=4,tensor=2", "zero1+tp", model="pallas", packed=True,
             sync=SyncConfig(sync_every=1, outer_optimizer="nesterov"), remat=True, offload=True,
             precision="fp8", resume=True, resume_onto=("data=4,tensor=2", "dp+tp")),
        ("zero1", "tp", "packed", "diloco", "pallas", "remat", "offload-optimizer", "fp8",
         "resume-relayout"),
        "zero1+tp-pallas-packed-diloco-remat-offload-opt-fp8-resume",
    ),
    _case(
        Case("pipe=2,data=4", "zero1", cudnn=True, schedule="1f1b",
             sync=SyncConfig(gossip="complete", sync_every=1), precision="fp8", resume=True,
             resume_onto=("pipe=2,data=4", "dp")),
        ("zero1", "1f1b", "gossip", "cudnn", "fp8", "resume-relayout"),
        "zero1-1f1b-gossip-cudnn-fp8-resume",
    ),
    _case(
        Case("pipe=2,data=4", "zero1", schedule="circular", remat=True, precision="fp8",
             resume=True),
        ("zero1", "circular", "remat", "fp8", "resume-relayout"),
        "zero1-circular-remat-fp8-resume",
    ),
    _case(
        Case("pipe=2,data=2,expert=2", "zero1", model="moe-dropless", cudnn=True,
             schedule="interleaved-1f1b",
             sync=SyncConfig(staleness=1), offload=True, accum=2, precision="fp8"),
        ("zero1", "interleaved-1f1b", "moe-dropless", "staleness", "cudnn", "offload-optimizer",
         "accumulation", "fp8"),
        "zero1-moe-dropless-interleaved-1f1b-staleness-cudnn-offload-opt-accum-fp8",
    ),
    _case(
        Case("data=4,seq=2", "zero1", context="ring", offload=True, precision="fp8"),
        ("zero1", "ring", "offload-optimizer", "fp8"),
        "zero1-ring-offload-opt-fp8",
    ),
    # issue 47: the replicas' own step beside context parallelism
    _case(
        Case("data=4,seq=2", "dp", context="ring", packed=True,
             sync=SyncConfig(grad_compression="int8")),
        ("dp", "ring", "packed", "compression"),
        "dp-ring-packed-compression",
    ),
    _case(
        Case("data=2,fsdp=2,seq=2", "hsdp", context="allgather",
             sync=SyncConfig(grad_compression="bf16"), accum=2),
        ("hsdp", "allgather", "compression", "accumulation"),
        "hsdp-allgather-compression-accum",
    ),
    _case(
        Case("data=4,seq=2", "zero1", context="ulysses", sync=SyncConfig(grad_compression="int8"),
             remat=True),
        ("zero1", "ulysses", "compression", "remat"),
        "zero1-ulysses-compression-remat",
    ),
    _case(
        Case("data=2,fsdp=2,seq=2", "hsdp", context="ring", sync=SyncConfig(sync_every=1),
             remat=True),
        ("hsdp", "ring", "local-sgd", "remat"),
        "hsdp-ring-local-sgd-remat",
    ),
    _case(
        Case("data=4,seq=2", "dp", context="allgather", packed=True, sync=SyncConfig(sync_every=1)),
        ("dp", "allgather", "packed", "local-sgd"),
        "dp-allgather-packed-local-sgd",
    ),
    _case(
        Case("data=4,seq=2", "zero1", context="ulysses", sync=SyncConfig(sync_every=1),
             precision="bf16"),
        ("zero1", "ulysses", "local-sgd", "bf16"),
        "zero1-ulysses-local-sgd-bf16",
    ),
    _case(
        Case("data=4,seq=2", "zero1", context="ring",
             sync=SyncConfig(sync_every=1, outer_optimizer="nesterov"), accum=2),
        ("zero1", "ring", "diloco", "accumulation"),
        "zero1-ring-diloco-accum",
    ),
    _case(
        Case("data=2,fsdp=2,seq=2", "hsdp", context="allgather",
             sync=SyncConfig(sync_every=1, outer_optimizer="nesterov"), precision="bf16"),
        ("hsdp", "allgather", "diloco", "bf16"),
        "hsdp-allgather-diloco-bf16",
    ),
    _case(
        Case("data=4,seq=2", "dp", context="ulysses", packed=True,
             sync=SyncConfig(sync_every=1, outer_optimizer="nesterov")),
        ("dp", "ulysses", "packed", "diloco"),
        "dp-ulysses-packed-diloco",
    ),
    _case(
        Case("data=2,fsdp=2,seq=2", "hsdp", context="ring",
             sync=SyncConfig(gossip="ring", sync_every=1), accum=2),
        ("hsdp", "ring", "gossip", "accumulation"),
        "hsdp-ring-gossip-accum",
    ),
    _case(
        Case("data=4,seq=2", "dp", context="allgather",
             sync=SyncConfig(gossip="complete", sync_every=1), remat=True),
        ("dp", "allgather", "gossip", "remat"),
        "dp-allgather-gossip-remat",
    ),
    _case(
        Case("data=4,seq=2", "zero1", context="ulysses", packed=True,
             sync=SyncConfig(gossip="complete", sync_every=1), precision="bf16"),
        ("zero1", "ulysses", "packed", "gossip", "bf16"),
        "zero1-ulysses-packed-gossip-bf16",
    ),
    _case(
        Case("data=4,seq=2", "dp", context="ring", packed=True,
             sync=SyncConfig(client_fraction=1.0, sync_every=1)),
        ("dp", "ring", "packed", "federated"),
        "dp-ring-packed-federated",
    ),
    _case(
        Case("data=2,fsdp=2,seq=2", "hsdp", context="allgather",
             sync=SyncConfig(client_fraction=1.0, sync_every=1), remat=True),
        ("hsdp", "allgather", "federated", "remat"),
        "hsdp-allgather-federated-remat",
    ),
    _case(
        Case("data=4,seq=2", "zero1", context="ulysses",
             sync=SyncConfig(client_fraction=1.0, sync_every=1), accum=2),
        ("zero1", "ulysses", "federated", "accumulation"),
        "zero1-ulysses-federated-accum",
    ),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_combination_equals_one_device(case, request, tmp_path, monkeypatch):
    from meshtrain.composition.matrix import cell

    marked = {cell(*m.args) for m in request.node.iter_markers("pair")}
    assert marked == _pairs(case.features())  # the marks say what the case combines
    calls = cudnn_stand_in(monkeypatch) if case.cudnn else None
    _check(case, tmp_path)
    if calls is not None:
        assert calls  # the model's attention went through the cuDNN path
        assert ("cudnn-packed" in calls) == case.packed  # through its packed layout if packed
