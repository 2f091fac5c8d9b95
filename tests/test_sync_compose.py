"""Synchronising less beside expert and pipeline parallelism, on 8 simulated CPU devices.

- An MoE over ``expert=2,data=4``: the step manual over the replicas is manual over data and
  expert, each device with its own rows; the dense weights are reduced over data and expert
  (8 replicas), the expert weights over data (4). Under compression the router's statistics
  are reduced over those rows, so the reference is one device on the whole batch; under local
  SGD each device trains a copy of its own between averages, so the reference is the
  one-device model run on each device's rows (a router loss per device), the dense weights
  averaged over the 8 row blocks, the expert weights over the 4 data replicas.
- ``pipe=2,data=4`` under gpipe and 1f1b: the pipeline's loop runs inside the replicas'
  region and the compressed reduction follows it; the reference is one device (the plain
  GPT's loss is linear in the batch), or its 4 replicas run one by one for local SGD.
- Gradient accumulation inside the pipelined replicas' step.
- Bounded staleness beside a pipeline, and under context parallelism (``seq=2,data=4``),
  where compression and local SGD are refused (tests/test_sync.py): the stale update against
  a hand-run reference (beside an MoE: tests/test_composition_cover.py's combinations).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import copied, params_history
from flax import nnx

from meshtrain import checkpoint as ckpt
from meshtrain.checkpoint import CheckpointManager
from meshtrain.layout import activation_rules, axes_of, batch_shardings, rules_for, shard_batch
from meshtrain.loss import cross_entropy, loss_and_metrics, loss_mask
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh, mesh_sizes
from meshtrain.models import GPTConfig, MoEConfig, build_model
from meshtrain.models.base import call_model
from meshtrain.pipeline import PipelineConfig, pipeline_loss_and_grads
from meshtrain.replicas import (
    Codec,
    SyncConfig,
    federated,
    gossip,
    outer_optimizer,
    reduced_grads,
    replica_sets,
    with_sync,
)
from meshtrain.run import RunSpec
from meshtrain.state import abstract_train_state
from meshtrain.train import TrainConfig

MOE = MoEConfig(
    d_model=32, n_heads=2, n_experts=4, top_k=2, d_expert=16, n_layers=1, vocab_size=64,
    vocab_multiple=16, max_seq_len=16, capacity_factor=4.0,
)  # fmt: skip
B, T, LR = 16, 16, 0.1
TX = optax.sgd(LR)
MOE_MESH = "expert=2,data=4"
# fp32 sums in another order (the codec none against one device): per leaf, as
# tests/test_compression.py, |manual − reference| ≤ 1e-5 · max|g|; a wrong replica share of an
# expert weight (1/4 instead of 1/8) is half of max|g|.
GRAD_RTOL = 1e-5
# Parameters after a few SGD steps: fp32 noise of distributed sums, as tests/test_moe.py.
PARAM_ATOL = 2e-5


def _batches(n, seed, vocab=64):
    """`n` fresh random token batches."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


_GRADS: dict = {}  # (id(graphdef), id(rest)) -> (graphdef, rest, their loss and gradient)


def _loss_fn(graphdef, rest):
    """One device's loss (with the router's losses) of a batch, and its gradient, as numpy;
    jitted once per model, so that each batch shape compiles once in the file."""
    key = id(graphdef), id(rest)
    if key not in _GRADS:  # the entry holds graphdef and rest: their ids stay theirs
        _GRADS[key] = (graphdef, rest, _new_loss_fn(graphdef, rest))
    return _GRADS[key][2]


def _new_loss_fn(graphdef, rest):
    """A new jitted one-device loss and gradient of `graphdef` with `rest`, as numpy."""

    def loss(params, batch):
        model = nnx.merge(graphdef, params, rest)
        out = call_model(model, batch)
        return loss_and_metrics(cross_entropy, out, batch["targets"], loss_mask(batch))[0]

    # The references' updates and means run in numpy: eager jax would compile a program per
    # operation and leaf shape.
    grad = jax.jit(jax.value_and_grad(loss))
    return lambda params, batch: jax.device_get(grad(params, batch))


@functools.cache
def _model(cfg):
    """A model on one device, built once per config: graph, parameters, other variables."""
    graphdef, params, rest = nnx.split(build_model(cfg, seed=0), nnx.Param, ...)
    return graphdef, jax.device_get(nnx.to_pure_dict(params)), nnx.to_pure_dict(rest)


def _moe(dispatch="capacity", **fields):
    """The MoE on one device: config, graph, parameters, other variables."""
    cfg = dataclasses.replace(MOE, dispatch=dispatch, **fields)
    return cfg, *_model(cfg)


@functools.cache
def _expert_leaves(cfg):
    """True for the leaves split over expert (by the layout the run uses; nothing compiles)."""
    mesh = make_mesh(MOE_MESH)
    target = abstract_train_state(lambda: build_model(cfg, seed=0), TX, mesh, rules_for("dp", mesh))
    return jax.tree.map(
        lambda x: "expert" in {a for e in x.sharding.spec for a in axes_of(e)}, target.params
    )


def _blocks(batch, n):
    """The `n` devices' rows of `batch`, in the order the batch is split."""
    rows = B // n
    return [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(n)]


def _mean(trees):
    return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


class _Replicas:
    """The one-device reference of a model over ``expert=E,data=D``: one copy of the dense
    weights per device (D·E), one of the expert weights per data replica (D); each device
    takes the gradient of its own rows' loss, an expert copy the mean over its E devices.
    With E = 1 (no experts) the D replicas of plain data parallelism."""

    def __init__(self, cfg, params, rest, graphdef, d=4, e=2):
        self.d, self.e = d, e
        self.is_expert = _expert_leaves(cfg) if e > 1 else jax.tree.map(lambda _: False, params)
        self.grad = _loss_fn(graphdef, rest)
        self.dense = [params] * (d * e)
        self.expert = [params] * d

    def params_of(self, k):
        """Device k's parameters: its dense copy and its data replica's expert copy."""
        pick = lambda x, dense, expert: expert if x else dense  # noqa: E731
        return jax.tree.map(pick, self.is_expert, self.dense[k], self.expert[k // self.e])

    def grads(self, batch):
        """Each device's loss and gradient of its own rows."""
        return [
            self.grad(self.params_of(k), b) for k, b in enumerate(_blocks(batch, self.d * self.e))
        ]

    def mean_grad(self, batch):
        """The mean over the devices of their gradients (what the codec none gives)."""
        return _mean([g for _, g in self.grads(batch)])

    def inner_step(self, batch, lr=LR):
        """One SGD step on every copy."""
        grads = [g for _, g in self.grads(batch)]
        step = lambda p, g: p - lr * g  # noqa: E731
        self.dense = [jax.tree.map(step, p, g) for p, g in zip(self.dense, grads, strict=True)]
        for r in range(self.d):
            g = _mean(grads[r * self.e : (r + 1) * self.e])
            self.expert[r] = jax.tree.map(step, self.expert[r], g)

    def average(self):
        """θ: each leaf averaged over its own replicas."""
        dense, expert = _mean(self.dense), _mean(self.expert)
        return jax.tree.map(lambda x, a, b: b if x else a, self.is_expert, dense, expert)

    def restart(self, params):
        self.dense = [params] * (self.d * self.e)
        self.expert = [params] * self.d


_STEPS: dict = {}  # (cfg, mesh, sync, pipeline, accum) -> its jitted step


@functools.cache
def _initial(cfg, mesh_str):
    """(graph, initial state, shardings) of `cfg` over `mesh_str` under dp, built once in the
    file (the step donates its state: `_train` takes a copy)."""
    mesh = make_mesh(mesh_str)
    return init_train_state(lambda: build_model(cfg, seed=0), TX, mesh, rules_for("dp", mesh))


def _train(cfg, mesh_str, sync, batches, pipeline=None, accum=1):
    """`jit_train_step` with `sync` over `batches` (one jitted step per setting in the file);
    the parameters after each step, the state."""
    mesh = make_mesh(mesh_str)
    rules = rules_for("dp", mesh)
    graphdef, state, sh = _initial(cfg, mesh_str)
    state = copied(state)
    state, sh = with_sync(sync, TX, state, sh, mesh, rules)
    extra = {"train": TrainConfig(accum_steps=accum)}
    extra |= {} if pipeline is None else {"pipeline": pipeline}
    run = RunSpec(mesh=mesh, rules=rules, sync=sync, **extra)
    key = cfg, mesh_str, sync, pipeline, accum
    if key not in _STEPS:
        batch_sh = batch_shardings(batches[0], mesh, rules)
        _STEPS[key] = jit_train_step(run, graphdef, TX, sh, batch_sh)
    step = _STEPS[key]
    return params_history(step, state, batches, mesh, rules)


def _moved(before, after) -> float:
    """The largest change of any parameter."""
    pairs = zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in pairs)


def _close(got, want, atol, what=""):
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=atol, err_msg=f"{what} {jax.tree_util.keystr(where)}")


# ---- gradient compression on an MoE -------------------------------------------------------


HSDP_MOE = "data=2,fsdp=2,expert=2"


CAPACITY, DROPLESS = {"dispatch": "capacity"}, {"dispatch": "dropless"}


def _reduced_with_codec_none(compute, state, batch, mesh, rules, sets, specs):
    """The gradient `reduced_grads` gives over the replicas `sets` with the codec none."""

    @jax.jit
    def run(params, rest, batch):
        with activation_rules(mesh, rules):
            return reduced_grads(
                compute, params, rest, batch, None, sets=sets, codec=Codec(name="none"),
                error_feedback=False, param_specs=specs,
            )  # fmt: skip

    return run(state.params, state.rest, shard_batch(batch, mesh, rules))[1]


def _assert_each_leaf_close(grads, want):
    """Each leaf of `grads` within `GRAD_RTOL` of `want`'s, relative to the leaf's scale."""
    for (where, g), w in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want), strict=True
    ):
        scale = float(np.abs(w).max())
        assert scale > 0, where
        np.testing.assert_allclose(
            g, w, atol=GRAD_RTOL * scale, err_msg=jax.tree_util.keystr(where)
        )


@pytest.mark.parametrize(
    ("mesh_str", "strategy", "d", "moe"),
    [
        # with transformers' Mixtral load-balancing loss, pooled over the rows of every replica
        # (the hsdp run has the default router losses)
        pytest.param(
            MOE_MESH, "dp", 4, {**DROPLESS, "router_losses": "mixtral"},
            marks=pytest.mark.pair("compression", "moe-dropless"), id="dp-dropless-mixtral",
        ),
        pytest.param(
            HSDP_MOE, "hsdp", 2, CAPACITY, marks=pytest.mark.pair("compression", "moe-capacity"),
            id="hsdp-capacity",
        ),
    ],
)  # fmt: skip
def test_codec_none_on_an_moe_reduces_each_leaf_over_its_own_replicas(mesh_str, strategy, d, moe):
    """Under hsdp the replicas are data (fsdp splits the weights) and expert as under dp."""
    cfg, graphdef, params, rest = _moe(**moe)
    batch = _batches(1, seed=11)[0]
    want = _loss_fn(graphdef, rest)(params, batch)[1]  # one device, the whole batch
    mesh = make_mesh(mesh_str)
    rules = rules_for(strategy, mesh)
    _, state, sh = init_train_state(lambda: build_model(cfg, seed=0), TX, mesh, rules)
    sets = replica_sets(rules, mesh_sizes(mesh), mesh=mesh)
    assert sets.axes == ("data", "expert") and sets.split == ("expert",)
    specs = jax.tree.map(lambda s: s.spec, sh.params)
    model_graph = graphdef

    def compute(params, rest, batch):
        def loss(p):
            out = call_model(nnx.merge(model_graph, p, rest), batch)
            loss, extra = loss_and_metrics(cross_entropy, out, batch["targets"], loss_mask(batch))
            return loss, (rest, extra)

        return jax.value_and_grad(loss, has_aux=True)(params)

    grads = _reduced_with_codec_none(compute, state, batch, mesh, rules, sets, specs)
    _assert_each_leaf_close(grads, want)


@pytest.mark.pair("compression", "moe-capacity")
def test_int8_with_error_feedback_on_an_moe_is_within_the_codec_bound(tmp_path):
    """Step 1 moves each leaf by LR × the int8 mean, within two quantisations of the exact
    mean (each replica's block rounded to max|x|/254, the mean's again); the next step keeps
    int8's rounding and carries what it dropped, 2e-3 as the hsdp accumulation test. The
    residuals, one per replica of each leaf, survive a checkpoint."""
    cfg, graphdef, params, rest = _moe()
    batches = _batches(2, seed=12)
    ref = _Replicas(cfg, params, rest, graphdef)
    grads = [g for _, g in ref.grads(batches[0])]
    exact = _loss_fn(graphdef, rest)(params, batches[0])[1]  # one device, the whole batch
    got, state = _train(cfg, MOE_MESH, SyncConfig(grad_compression="int8"), batches)
    flat_is_expert = jax.tree.leaves(ref.is_expert)
    per_device = [jax.tree.leaves(g) for g in grads]
    for i, (p0, p1, g) in enumerate(
        zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1]), jax.tree.leaves(exact), strict=True)
    ):
        # what each replica sends: a dense leaf's own gradient, an expert leaf's pair mean
        sends = [d[i] for d in per_device]
        if flat_is_expert[i]:
            sends = [(sends[2 * r] + sends[2 * r + 1]) / 2 for r in range(4)]
        bound = 2 * max(float(np.abs(s).max()) for s in sends) / 254 + 1e-7
        moved = (np.asarray(p0) - np.asarray(p1)) / LR
        assert float(np.abs(moved - g).max()) <= bound
    want = [params]
    for b in batches:
        grad = _loss_fn(graphdef, rest)(want[-1], b)[1]
        want.append(jax.tree.map(lambda p, g: p - LR * g, want[-1], grad))
    _close(got[-1], want[-1], 2e-3, "step 2")
    assert _moved(got[0], got[-1]) > 1e-3  # the steps really moved the parameters
    # one residual per replica: 8 for a dense weight, 4 for an expert weight
    counts = {r.shape[0] for r in jax.tree.leaves(state.comm["residual"])}
    assert counts == {8, 4}
    for r, x in zip(jax.tree.leaves(state.comm["residual"]), flat_is_expert, strict=True):
        assert r.shape[0] == (4 if x else 8)
    assert max(float(jnp.abs(r).max()) for r in jax.tree.leaves(state.comm["residual"])) > 0
    # the per-leaf residuals go through a checkpoint onto the target with_sync builds
    mesh = make_mesh(MOE_MESH)
    rules = rules_for("dp", mesh)
    target = abstract_train_state(lambda: build_model(cfg, seed=0), TX, mesh, rules)
    shardings = jax.tree.map(lambda x: x.sharding, target)
    like, like_sh = with_sync(
        SyncConfig(grad_compression="int8"), TX, target, shardings, mesh, rules
    )
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(2, state)
    restored = ckpt.restore(tmp_path / "ck", like).state
    pairs = zip(*map(jax.tree.leaves, (restored.comm, state.comm, like_sh.comm)), strict=True)
    for got, want, sh in pairs:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == sh == want.sharding


# ---- local SGD and DiLoCo on an MoE -------------------------------------------------------


def _local_reference(cfg, params, rest, graphdef, batches, outer, h, d=4, e=2):
    """θ̄ after `batches` of local SGD with every `h` steps the `outer` step, one device."""
    ref = _Replicas(cfg, params, rest, graphdef, d, e)

    @jax.jit
    def outer_step(theta, state, average):
        updates, state = outer.update(jax.tree.map(jnp.subtract, theta, average), state, theta)
        return optax.apply_updates(theta, updates), state

    theta, state = params, jax.jit(outer.init)(params)
    for t, b in enumerate(batches):
        ref.inner_step(b)
        if (t + 1) % h == 0:
            theta, state = jax.device_get(outer_step(theta, state, ref.average()))
            ref.restart(theta)
    return theta


# Each outer optimizer, by the feature it makes: local SGD averages, DiLoCo steps Nesterov SGD.
OUTER = (("average", "local-sgd"), ("nesterov", "diloco"))


def _every_two(name):
    """Local SGD or DiLoCo (outer optimizer `name`) every 2 steps, and the outer optimizer
    the one-device reference applies."""
    sync = SyncConfig(sync_every=2, outer_optimizer=name, outer_lr=0.7, outer_momentum=0.9)
    return sync, outer_optimizer(name, 0.7, 0.9)


@pytest.mark.parametrize(
    ("name", "dispatch"),
    [
        pytest.param(name, d, marks=pytest.mark.pair(scheme, f"moe-{d}"))
        for name, scheme in OUTER
        for d in ("capacity", "dropless")
    ],
)
def test_local_sgd_and_diloco_on_an_moe_equal_their_replicas_run_on_one_device(name, dispatch):
    cfg, graphdef, params, rest = _moe(dispatch)
    batches = _batches(4, seed=13)
    sync, outer = _every_two(name)
    want = _local_reference(cfg, params, rest, graphdef, batches, outer, 2)
    got, state = _train(cfg, MOE_MESH, sync, batches)
    _close(got[-1], want, PARAM_ATOL, name)
    assert _moved(got[0], got[-1]) > 1e-3  # the steps really moved the parameters
    local = state.comm["local"]["params"]
    for r, x in zip(jax.tree.leaves(local), jax.tree.leaves(_expert_leaves(cfg)), strict=True):
        assert r.shape[0] == (4 if x else 8)


@pytest.mark.parametrize(
    "dispatch",
    [
        pytest.param("capacity", marks=pytest.mark.pair("federated", "moe-capacity")),
        pytest.param("dropless", marks=pytest.mark.pair("federated", "moe-dropless")),
    ],
)
def test_federated_rounds_on_an_moe_average_the_sampled_clients_devices(dispatch):
    """A client is a data replica with its expert devices: its dense copies (one per device)
    and its expert copy count, weighted alike, only when its round samples it."""
    cfg, graphdef, params, rest = _moe(dispatch)
    batches = _batches(4, seed=17)
    seed = int(np.random.default_rng().integers(1000))
    sync = SyncConfig(client_fraction=0.5, sync_every=2, client_seed=seed)
    ref = _Replicas(cfg, params, rest, graphdef)
    theta = params
    for t, b in enumerate(batches):
        ref.inner_step(b)
        if (t + 1) % 2 == 0:
            chosen = federated.sampled_clients(t // 2, ref.d, 0.5, seed)
            dense = _mean([ref.dense[k] for k in range(ref.d * ref.e) if k // ref.e in chosen])
            expert = _mean([ref.expert[r] for r in chosen])
            theta = jax.tree.map(lambda x, a, b: b if x else a, ref.is_expert, dense, expert)
            everyone = ref.average()  # what counting every client would have given
            ref.restart(theta)
    got, _ = _train(cfg, MOE_MESH, sync, batches)
    _close(got[-1], theta, PARAM_ATOL, dispatch)
    assert _moved(everyone, theta) > 1e-4  # the unsampled clients' work was left out
    assert _moved(got[0], got[-1]) > 1e-3


def _mixed(copies, w):
    """One gossip mixing step of `copies` by the matrix `w`: copy r ← Σ_j w[r, j] copy j."""
    n = len(copies)
    return [
        jax.tree.map(lambda *xs, r=r: sum(w[r, j] * xs[j] for j in range(n)), *copies)
        for r in range(n)
    ]


@pytest.mark.parametrize(
    "dispatch",
    [
        pytest.param("capacity", marks=pytest.mark.pair("gossip", "moe-capacity")),
        pytest.param("dropless", marks=pytest.mark.pair("gossip", "moe-dropless")),
    ],
)
def test_gossip_on_an_moe_mixes_each_leaf_among_its_own_copies(dispatch):
    """Beside expert > 1 each leaf gossips on a ring of its own copies: the dense weights over
    the eight devices of data and expert, the expert weights over the four data replicas; θ̄
    is each leaf's mean over its copies at every synchronisation."""
    cfg, graphdef, params, rest = _moe(dispatch)
    batches = _batches(4, seed=19)
    sync = SyncConfig(gossip="ring", sync_every=2)
    ref = _Replicas(cfg, params, rest, graphdef)
    dense_w = gossip.matrix("ring", {"data": ref.d, "expert": ref.e})
    expert_w = gossip.matrix("ring", {"data": ref.d})
    for t, b in enumerate(batches):
        ref.inner_step(b)
        ref.dense, ref.expert = _mixed(ref.dense, dense_w), _mixed(ref.expert, expert_w)
        if (t + 1) % 2 == 0:
            theta = ref.average()
    got, state = _train(cfg, MOE_MESH, sync, batches)
    _close(got[-1], theta, PARAM_ATOL, dispatch)
    assert _moved(got[0], got[-1]) > 1e-3
    assert float(state.comm["consensus"]) > 0  # the replicas went on apart


# ---- bounded staleness ----------------------------------------------------------------------


def _stale_reference(grad, params, batches, s):
    """One-device SGD whose update at step t applies the gradient of step t - s."""
    history, grads = [params], []
    for t, b in enumerate(batches):
        grads.append(grad(history[t], b)[1])
        if t >= s:
            params = jax.tree.map(lambda p, g: p - LR * g, params, grads[t - s])
        history.append(params)
    return history


# ---- pipelines ------------------------------------------------------------------------------

GPT = GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=64)
PIPE_MESH = "pipe=2,data=4"
SCHEDULES = ("gpipe", "1f1b")


def _gpt():
    """The GPT on one device: graph, parameters, other variables."""
    return _model(GPT)


def _pipeline(schedule):
    return PipelineConfig(schedule=schedule, microbatches=2)


@pytest.mark.parametrize(
    "schedule", [pytest.param(s, marks=pytest.mark.pair("compression", s)) for s in SCHEDULES]
)
def test_codec_none_after_the_pipeline_loop_equals_one_device(schedule):
    """The pipeline's loop runs inside the replicas' region; the replicas' gradients leave it
    unreduced and the codec reduces them once, after the loop."""
    graphdef, params, rest = _gpt()
    batch = _batches(1, seed=21)[0]
    want = _loss_fn(graphdef, rest)(params, batch)[1]
    mesh = make_mesh(PIPE_MESH)
    rules = rules_for("dp", mesh)
    _, state, sh = init_train_state(lambda: build_model(GPT, seed=0), TX, mesh, rules)
    sets = replica_sets(rules, mesh_sizes(mesh), mesh=mesh)
    assert sets.axes == ("data",) and sets.stages == ("pipe",)
    specs = jax.tree.map(lambda s: s.spec, sh.params)

    def compute(params, rest, batch):
        loss, grads = pipeline_loss_and_grads(
            graphdef, params, rest, batch, config=_pipeline(schedule), mesh=mesh,
            loss_fn=cross_entropy,
        )  # fmt: skip
        return (loss, (rest, {})), grads

    grads = _reduced_with_codec_none(compute, state, batch, mesh, rules, sets, specs)
    _assert_each_leaf_close(grads, want)


# gpipe: the codec follows the loop whatever the schedule (the codec none test above runs
# both); the accumulation test below compares with this step.
@pytest.mark.pair("compression", "gpipe")
def test_int8_with_error_feedback_on_a_pipeline_is_within_the_codec_bound():
    """As on the MoE: step 1 within two quantisations of the replicas' exact mean, three steps
    within int8's rounding; one residual per data replica, each stage holding its layers'."""
    schedule = "gpipe"
    graphdef, params, rest = _gpt()
    batches = _batches(3, seed=22)
    ref = _Replicas(GPT, params, rest, graphdef, d=4, e=1)
    sends = [jax.tree.leaves(g) for _, g in ref.grads(batches[0])]
    exact = _loss_fn(graphdef, rest)(params, batches[0])[1]  # one device, the whole batch
    got, state = _train(
        GPT, PIPE_MESH, SyncConfig(grad_compression="int8"), batches, _pipeline(schedule)
    )
    for i, (p0, p1, g) in enumerate(
        zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1]), jax.tree.leaves(exact), strict=True)
    ):
        bound = 2 * max(float(np.abs(d[i]).max()) for d in sends) / 254 + 1e-7
        moved = (np.asarray(p0) - np.asarray(p1)) / LR
        assert float(np.abs(moved - g).max()) <= bound
    want = params
    for b in batches:
        want = jax.tree.map(lambda p, g: p - LR * g, want, ref.mean_grad(b))
    _close(got[-1], want, 2e-3, "step 3")
    assert _moved(got[0], got[-1]) > 1e-3  # the steps really moved the parameters
    residual = state.comm["residual"]
    assert {r.shape[0] for r in jax.tree.leaves(residual)} == {4}
    blocks = jax.tree.leaves(residual["blocks"])[0]
    assert blocks.sharding.spec[:2] == ("data", "pipe")
    assert max(float(jnp.abs(r).max()) for r in jax.tree.leaves(residual)) > 0


@pytest.mark.parametrize(
    ("name", "schedule"),
    [
        pytest.param(name, s, marks=pytest.mark.pair(scheme, s))
        for name, scheme in OUTER
        for s in ("gpipe", "1f1b")
    ],
)
def test_local_sgd_and_diloco_on_a_pipeline_equal_their_replicas_run_on_one_device(name, schedule):
    graphdef, params, rest = _gpt()
    batches = _batches(4, seed=23)
    sync, outer = _every_two(name)
    want = _local_reference(GPT, params, rest, graphdef, batches, outer, 2, d=4, e=1)
    got, _ = _train(GPT, PIPE_MESH, sync, batches, _pipeline(schedule))
    _close(got[-1], want, PARAM_ATOL, f"{name} {schedule}")
    assert _moved(got[0], got[-1]) > 1e-3  # the steps really moved the parameters


@pytest.mark.pair("local-sgd", "accumulation")
@pytest.mark.pair("compression", "accumulation")
@pytest.mark.parametrize(
    "sync",
    [SyncConfig(sync_every=2), SyncConfig(grad_compression="int8")],
    ids=["local-sgd", "int8"],
)
def test_accumulation_inside_the_replicas_pipelined_step_changes_nothing(sync):
    """Two accumulated microbatches of each replica's rows (the plain GPT's loss is linear in
    them): local SGD equals its replicas' run on one device; int8 equals the unaccumulated
    int8 run within int8's rounding (2e-3, as the hsdp accumulation test)."""
    graphdef, params, rest = _gpt()
    batches = _batches(2, seed=26)
    got, _ = _train(GPT, PIPE_MESH, sync, batches, _pipeline("gpipe"), accum=2)
    if sync.local:
        _, outer = _every_two("average")
        want = _local_reference(GPT, params, rest, graphdef, batches, outer, 2, d=4, e=1)
        _close(got[-1], want, PARAM_ATOL, "local SGD")
    else:
        one, _ = _train(GPT, PIPE_MESH, sync, batches, _pipeline("gpipe"))
        _close(got[-1], one[-1], 2e-3, "int8")
    assert _moved(got[0], got[-1]) > 1e-3


# 1f1b, whose backward the schedule runs by hand; staleness with gpipe is
# tests/test_composition_cover.py's.
@pytest.mark.pair("staleness", "1f1b")
def test_staleness_on_a_pipeline_applies_the_gradient_of_s_steps_before():
    schedule = "1f1b"
    graphdef, params, rest = _gpt()
    batches = _batches(4, seed=24)
    want = _stale_reference(_loss_fn(graphdef, rest), params, batches, 2)
    got, _ = _train(GPT, PIPE_MESH, SyncConfig(staleness=2), batches, _pipeline(schedule))
    for t in range(len(batches) + 1):
        _close(got[t], want[t], PARAM_ATOL, f"step {t}")


# ---- context parallelism --------------------------------------------------------------------


@pytest.mark.pair("staleness", "ring")
def test_staleness_under_context_parallelism_applies_the_gradient_of_s_steps_before():
    graphdef, params, rest = _gpt()
    batches = _batches(3, seed=25)
    want = _stale_reference(_loss_fn(graphdef, rest), params, batches, 1)
    got, _ = _train(GPT, "seq=2,data=4", SyncConfig(staleness=1), batches)
    for t in range(len(batches) + 1):
        _close(got[t], want[t], PARAM_ATOL, f"step {t}")
