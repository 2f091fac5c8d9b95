"""Tests for meshtrain.layout: preset layouts, batches, custom rules, the one divisibility
policy, regions manual over some axes, and validation.

The intended layouts here are written out independently of the library: each parameter's
logical names come from a hand-written table of the models, and each preset's mapping from
its definition (the `meshtrain.layout.rules` module docstring), so a change in either shows up.
"""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import count_compiles
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain import layout as S
from meshtrain.layout import batch_shardings
from meshtrain.lower import RunSpec, init_train_state, jit_train_step, make_optimizer
from meshtrain.mesh import make_mesh, mesh_sizes
from meshtrain.models import GPTConfig, MLPConfig, build_model
from meshtrain.state import create_sharded_model
from meshtrain.train import OptimConfig

GPT = {
    "gpt2": GPTConfig(style="gpt2", n_layers=2, d_model=64, n_heads=4, max_seq_len=16),
    "llama": GPTConfig(
        style="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=16
    ),
}
MLP = MLPConfig(num_features=16, num_classes=10, d_model=64, d_hidden=128, n_layers=2)
TX = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)

# Preset definitions, as the sharding module documents them.
BATCH = ("data", "fsdp")
DATA_PRESETS = {  # data strategy -> (params table, optimizer table)
    "dp": ({}, {}),
    "fsdp": ({"embed": BATCH}, {"embed": BATCH}),
    "hsdp": ({"embed": ("fsdp",)}, {"embed": ("fsdp",)}),
    "zero1": ({}, {"embed": BATCH}),
}
TP = {"heads": ("tensor",), "kv_heads": ("tensor",), "mlp": ("tensor",), "vocab": ("tensor",)}


def gpt_param_names(style: str) -> dict[str, tuple[str, ...]]:
    """Logical names of every GPT parameter, written out from the model's definition."""
    L = ("layers",)
    names = {
        "embed/embedding": ("vocab", "embed"),
        "head/kernel": ("embed", "vocab"),
        "norm/scale": ("embed",),
        "blocks/norm1/scale": (*L, "embed"),
        "blocks/norm2/scale": (*L, "embed"),
        "blocks/attn/q/kernel": (*L, "embed", "heads", "kv"),
        "blocks/attn/k/kernel": (*L, "embed", "kv_heads", "kv"),
        "blocks/attn/v/kernel": (*L, "embed", "kv_heads", "kv"),
        "blocks/attn/o/kernel": (*L, "heads", "kv", "embed"),
        "blocks/mlp/up/kernel": (*L, "embed", "mlp"),
        "blocks/mlp/down/kernel": (*L, "mlp", "embed"),
    }
    if style == "llama":
        names["blocks/mlp/gate/kernel"] = (*L, "embed", "mlp")
    else:
        names.update(
            {
                "pos": ("pos", "embed"),
                "norm/bias": ("embed",),
                "blocks/norm1/bias": (*L, "embed"),
                "blocks/norm2/bias": (*L, "embed"),
                "blocks/attn/q/bias": (*L, "heads", "kv"),
                "blocks/attn/k/bias": (*L, "kv_heads", "kv"),
                "blocks/attn/v/bias": (*L, "kv_heads", "kv"),
                "blocks/attn/o/bias": (*L, "embed"),
                "blocks/mlp/up/bias": (*L, "mlp"),
                "blocks/mlp/down/bias": (*L, "embed"),
            }
        )
    return names


def intended_spec(names, table, mesh) -> P:
    """PartitionSpec from logical names and a {name: mesh axes} table; size-1 axes dropped."""
    sizes = mesh_sizes(mesh)
    spec = []
    for name in names:
        axes = tuple(a for a in table.get(name, ()) if sizes[a] > 1)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def flat(tree) -> dict[str, jax.Array]:
    """{'a/b/c': leaf} for a nested dict of arrays."""
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


@functools.cache
def sharded_state(strategy: str, mesh_str: str, style: str):
    """(mesh, train state) of a GPT under a preset; cached so the layout tests share it."""
    mesh = make_mesh(mesh_str)
    rules = S.rules_for(strategy, mesh)
    _, state, _ = init_train_state(lambda: build_model(GPT[style]), TX, mesh, rules)
    return mesh, state


LAYOUTS = [
    ("dp", "data=8", "gpt2"),
    ("fsdp", "data=2,fsdp=4", "llama"),
    ("fsdp", "data=8", "gpt2"),
    ("fsdp", "data=4,tensor=2", "llama"),  # tensor rules apply whenever tensor > 1
    ("hsdp", "data=2,fsdp=4", "gpt2"),
    ("zero1", "data=8", "llama"),
    ("tp", "data=2,tensor=4", "gpt2"),
    ("fsdp+tp", "data=2,fsdp=2,tensor=2", "llama"),
    ("hsdp+tp", "data=2,fsdp=2,tensor=2", "gpt2"),
    ("zero1+tp", "data=4,tensor=2", "llama"),
]


def _tables(strategy: str):
    data = next((p for p in strategy.split("+") if p != "tp"), "dp")
    params, optimizer = DATA_PRESETS[data]
    return {**TP, **params}, {**TP, **optimizer}


def _assert_follows(leaves, names, table, mesh, what):
    """Every leaf of the flat `leaves` (the parameters' paths, no other) is laid out as
    `table` places its logical axes (`names`)."""
    assert set(leaves) == set(names), what
    for path, array in leaves.items():
        want = NamedSharding(mesh, intended_spec(names[path], table, mesh))
        assert array.sharding.is_equivalent_to(want, array.ndim), (what, path, array.sharding.spec)


@pytest.mark.parametrize("strategy, mesh_str, style", LAYOUTS)
def test_parameters_follow_the_preset(strategy, mesh_str, style):
    mesh, state = sharded_state(strategy, mesh_str, style)
    table, _ = _tables(strategy)
    _assert_follows(flat(state.params), gpt_param_names(style), table, mesh, "params")


@pytest.mark.parametrize("strategy, mesh_str, style", LAYOUTS)
def test_optimizer_state_follows_the_preset(strategy, mesh_str, style):
    mesh, state = sharded_state(strategy, mesh_str, style)
    _, table = _tables(strategy)
    for moment in ("mu", "nu"):
        leaves = flat(optax.tree_utils.tree_get(state.opt_state, moment))
        _assert_follows(leaves, gpt_param_names(style), table, mesh, moment)


@functools.cache
def single_device_init(style: str) -> dict[str, np.ndarray]:
    """The GPT's initial parameters built on one device, without any mesh."""
    state = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(GPT[style]), nnx.Param)))()
    return {path: np.asarray(a) for path, a in flat(state).items()}


@pytest.mark.parametrize("strategy, mesh_str, style", LAYOUTS)
def test_sharded_init_gives_the_single_device_values(strategy, mesh_str, style):
    _, state = sharded_state(strategy, mesh_str, style)
    want = single_device_init(style)
    got = flat(state.params)
    assert set(got) == set(want)
    for path, array in got.items():  # bitwise: the same initialisers, only laid out
        np.testing.assert_array_equal(np.asarray(array), want[path], err_msg=path)


def test_zero1_replicates_params_and_shards_moments_over_batch_axes():
    mesh, state = sharded_state("zero1", "data=8", "llama")
    for path, array in flat(state.params).items():
        assert array.sharding.is_fully_replicated, path
    mu = flat(optax.tree_utils.tree_get(state.opt_state, "mu"))
    emb = mu["embed/embedding"]  # (vocab, embed): embed split over data
    assert emb.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), 2)
    assert emb.addressable_shards[0].data.shape == (256, 64 // 8)
    sharded = [p for p, a in mu.items() if not a.sharding.is_fully_replicated]
    assert len(sharded) == len(mu)  # every GPT parameter has an embed dim


def test_fsdp_optimizer_state_matches_params():
    _, state = sharded_state("fsdp", "data=2,fsdp=4", "llama")
    params = flat(state.params)
    for moment in ("mu", "nu"):
        for path, array in flat(optax.tree_utils.tree_get(state.opt_state, moment)).items():
            assert array.sharding.is_equivalent_to(params[path].sharding, array.ndim), path
            assert (
                array.addressable_shards[0].data.shape
                == params[path].addressable_shards[0].data.shape
            )
    q = params["blocks/attn/q/kernel"]  # (layers, embed, heads, kv), embed over data × fsdp
    assert q.addressable_shards[0].data.shape == (2, 64 // 8, 4, 16)


def test_tp_replicates_kv_heads_that_tensor_does_not_divide_and_splits_the_padded_vocab():
    """llama with 2 kv heads on tensor=4: k/v kernels whole on every tensor shard, q split; a
    vocabulary of 1000 is 1024 rows (vocab_multiple=128), split 4 ways."""
    config = GPTConfig(
        style="llama", vocab_size=1000, n_layers=1, d_model=64, n_heads=8, n_kv_heads=2
    )
    mesh = make_mesh("data=2,tensor=4")
    rules = S.rules_for("fsdp+tp", mesh)
    assert rules.params["kv_heads"] == rules.activations["kv_heads"] == ["tensor", None]
    _, state, _ = init_train_state(lambda: build_model(config), TX, mesh, rules)
    params = flat(state.params)
    want = {
        "blocks/attn/q/kernel": P("pipe", "data", "tensor", None),
        "blocks/attn/k/kernel": P("pipe", "data", None, None),
        "blocks/attn/v/kernel": P("pipe", "data", None, None),
        "embed/embedding": P("tensor", "data"),
        "head/kernel": P("data", "tensor"),
    }
    for path, spec in want.items():
        array = params[path]
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), path
    assert params["embed/embedding"].addressable_shards[0].data.shape == (1024 // 4, 64 // 2)


def test_resolve_drops_size_one_axes_and_reused_axes():
    mesh = make_mesh("data=2,fsdp=4")
    table = {"embed": ("data", "fsdp", "tensor"), "mlp": "fsdp", "vocab": None}
    assert S.resolve(("embed", "mlp"), table, mesh) == P(("data", "fsdp"), None)
    assert S.resolve(("mlp", "embed"), table, mesh) == P("fsdp", "data")
    assert S.resolve(("vocab", None), table, mesh) == P(None, None)


# --- batches ------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_str", ["data=8", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2"])
def test_shard_batch_splits_rows_over_data_and_fsdp(mesh_str):
    mesh = make_mesh(mesh_str)
    rules = S.rules_for("dp", mesh)
    rng = np.random.default_rng(0)
    batch = {
        "inputs": rng.integers(0, 256, (16, 8)).astype(np.int32),
        "targets": rng.integers(0, 10, (16,)).astype(np.int32),
    }
    sharded = S.shard_batch(batch, mesh, rules)
    sizes = mesh_sizes(mesh)
    ways = sizes["data"] * sizes["fsdp"]
    for key, x in sharded.items():
        np.testing.assert_array_equal(np.asarray(x), batch[key])
        spec = P(tuple(a for a in ("data", "fsdp") if sizes[a] > 1), *[None] * (x.ndim - 1))
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
        for shard in x.addressable_shards:
            assert shard.data.shape[0] == 16 // ways
            np.testing.assert_array_equal(np.asarray(shard.data), batch[key][shard.index])
        # devices that differ only along tensor hold the same rows
        assert len({s.index[0] for s in x.addressable_shards}) == ways


def test_shard_batch_rows_not_divisible_is_a_clear_error():
    mesh = make_mesh("data=8")
    batch = {"inputs": np.zeros((12, 16), np.int32)}
    with pytest.raises(
        ValueError,
        match=r"batch\['inputs'\] with global shape \(12, 16\).*\(batch=12\) is not divisible "
        r"by mesh data=8 = 8.*multiple of the data-parallel devices",
    ):
        S.shard_batch(batch, mesh, S.rules_for("dp", mesh))


def test_batch_shardings_match_shard_batch():
    mesh = make_mesh("data=4,fsdp=2")
    rules = S.rules_for("fsdp", mesh)
    batch = {"inputs": np.zeros((8, 4), np.int32), "targets": np.zeros((8, 4), np.int32)}
    want = batch_shardings(batch, mesh, rules)
    got = S.shard_batch(batch, mesh, rules)
    for key in batch:
        assert got[key].sharding.is_equivalent_to(want[key], 2)


# --- custom modules and rules -------------------------------------------------------------


class TwoParams(nnx.Module):
    """One annotated parameter and one plain one."""

    def __init__(self, names=("embed", None)):
        self.named_w = nnx.Param(jnp.ones((16, 4)), out_sharding=names)
        self.plain_w = nnx.Param(jnp.ones((4, 16)))
        self.scalar = nnx.Param(jnp.ones(()))  # a scalar is never worth a warning

    def __call__(self, x):
        return x @ self.named_w @ self.plain_w * self.scalar


def test_unannotated_parameters_are_replicated_with_one_warning():
    mesh = make_mesh("fsdp=8")
    rules = S.rules_for("fsdp", mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = create_sharded_model(TwoParams, mesh, rules)
    ours = [w for w in caught if "meshtrain" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "plain_w" in message and "named_w" not in message and "scalar" not in message
    assert model.plain_w.sharding.is_fully_replicated
    assert model.named_w.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", None)), 2)


def test_unknown_logical_axis_names_the_parameter_before_compiling():
    mesh = make_mesh("fsdp=8")
    rules = S.rules_for("fsdp", mesh)
    with (
        count_compiles() as compiles,
        pytest.raises(
            ValueError, match=r"parameter 'named_w' \(16, 4\): unknown logical axis 'bogus'"
        ),
    ):
        create_sharded_model(lambda: TwoParams(("bogus", None)), mesh, rules)
    assert compiles == []


def test_unknown_mesh_axis_in_user_rules():
    with pytest.raises(
        ValueError, match=r"rules.params\['embed'\]='model': unknown mesh axis 'model'"
    ):
        S.Rules(params={"embed": "model"}, activations={})
    with pytest.raises(ValueError, match=r"rules.optimizer\['mlp'\].*unknown mesh axis 'dp'"):
        S.Rules(params={}, activations={}, optimizer={"mlp": ("data", "dp")})


def test_user_rules_map_mlp_to_fsdp():
    mesh = make_mesh("data=2,fsdp=4")
    table = {name: None for name in S.LOGICAL_AXES}
    rules = S.Rules(
        params={**table, "mlp": "fsdp"},
        activations={**table, "batch": ("data", "fsdp")},
        name="mlp-over-fsdp",
    )
    graphdef, state, shardings = init_train_state(lambda: build_model(MLP), TX, mesh, rules)
    params = flat(state.params)
    for path, array in params.items():
        if path.startswith("ups/") and path.endswith("kernel"):  # (embed, mlp)
            want = P(None, "fsdp")
        elif path.startswith("ups/"):  # bias (mlp,)
            want = P("fsdp")
        elif path.startswith("downs/") and path.endswith("kernel"):  # (mlp, embed)
            want = P("fsdp", None)
        else:
            want = P()
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, want), array.ndim), path

    # the custom layout trains: one step's loss equals the plain single-device loss
    rng = np.random.default_rng(1)
    batch = {
        "inputs": rng.normal(size=(16, 16)).astype(np.float32),
        "targets": rng.integers(0, 10, (16,)).astype(np.int32),
    }
    plain = build_model(MLP)
    want_loss = optax.softmax_cross_entropy_with_integer_labels(
        plain(batch["inputs"]), batch["targets"]
    ).mean()
    batch_sh = batch_shardings(batch, mesh, rules)
    step = jit_train_step(RunSpec(mesh=mesh, rules=rules), graphdef, TX, shardings, batch_sh)
    state, metrics = step(state, S.shard_batch(batch, mesh, rules))
    # fp32, one forward on a [16, 64] → [16, 10] net: a few ulps of the ≈2.3 loss
    np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-6)
    ups = flat(state.params)["ups/0/kernel"]
    assert ups.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp")), 2)


# --- strategies and divisibility ----------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, mesh_str, match",
    [
        ("fsdp2", None, r"strategy='fsdp2': unknown strategy 'fsdp2'; choose from dp, fsdp"),
        ("dp+fsdp", None, r"dp and fsdp both decide how parameters use the data axes"),
        ("zero1+hsdp+tp", None, r"zero1 and hsdp both decide"),
        ("", None, r"unknown strategy"),
        ("tp", "data=8", r"strategy='tp': uses tensor parallelism but the mesh has tensor=1"),
        (
            "fsdp+tp",
            "fsdp=8",
            r"strategy='fsdp\+tp': uses tensor parallelism but the mesh has "
            r"tensor=1",
        ),
        (
            "hsdp",
            "data=8",
            r"strategy='hsdp': shards parameters over the fsdp axis but the mesh "
            r"has fsdp=1",
        ),
    ],
)
def test_bad_strategies(strategy, mesh_str, match):
    mesh = make_mesh(mesh_str) if mesh_str else None
    with pytest.raises(ValueError, match=match):
        S.rules_for(strategy, mesh)


@pytest.mark.parametrize(
    "config, strategy, mesh_str, match",
    [
        (
            GPTConfig(style="gpt2", n_layers=2, d_model=60, n_heads=4, max_seq_len=16),
            "fsdp",
            "fsdp=8",
            r"parameter 'blocks/attn/k/kernel' \(2, 60, 4, 15\): dimension 1 \(embed=60\) is "
            r"not divisible by mesh fsdp=8 = 8",
        ),
        (
            GPTConfig(style="gpt2", n_layers=2, d_model=60, n_heads=4, max_seq_len=16),
            "fsdp",
            "data=8",
            r"\(embed=60\) is not divisible by mesh data=8 = 8",
        ),
        (  # query heads have no fallback (key/value heads are replicated instead)
            GPT["llama"],
            "tp",
            "data=1,tensor=8",
            r"parameter 'blocks/attn/o/kernel' \(2, 4, 16, 64\): dimension 1 \(heads=4\) is "
            r"not divisible by mesh tensor=8 = 8",
        ),
    ],
)
def test_indivisible_dimension_is_caught_before_compiling(config, strategy, mesh_str, match):
    mesh = make_mesh(mesh_str)
    rules = S.rules_for(strategy, mesh)
    with count_compiles() as compiles, pytest.raises(ValueError, match=match):
        init_train_state(lambda: build_model(config), TX, mesh, rules)
    assert compiles == []


def test_compile_counter_counts_sharded_init():
    """Positive control: the same call on a valid layout does compile (so 0 above means 0)."""
    mesh = make_mesh("fsdp=8")
    config = MLPConfig(num_features=8, num_classes=8, d_model=16, d_hidden=16, n_layers=1)
    with count_compiles() as compiles:
        init_train_state(lambda: build_model(config), TX, mesh, S.rules_for("fsdp", mesh))
    assert len(compiles) >= 1


def test_activation_constraints_are_a_no_op_outside_rules():
    x = jnp.arange(16.0).reshape(8, 2)
    assert S.constrain(x, ("batch", "embed")) is x
    mesh = make_mesh("data=8")
    with S.activation_rules(mesh, S.rules_for("dp", mesh)):
        y = jax.jit(lambda a: S.constrain(a * 2, ("batch", "embed")))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    assert math.prod(y.addressable_shards[0].data.shape) == 2


# --- one divisibility policy ---------------------------------------------------------------


def test_alternatives_fall_back_to_the_first_that_divides():
    mesh = make_mesh("data=2,tensor=4")
    table = {"kv_heads": ["tensor", None], "kv": None}
    assert S.resolve(("kv_heads", "kv"), table, mesh, shape=(8, 16)) == P("tensor", None)
    assert S.resolve(("kv_heads", "kv"), table, mesh, shape=(2, 16)) == P(None, None)
    with pytest.raises(ValueError, match=r"\(kv_heads=6\) is not divisible by mesh tensor=4"):
        S.resolve(("kv_heads", "kv"), {"kv_heads": "tensor", "kv": None}, mesh, shape=(6, 16))


def test_alternatives_are_validated_like_any_rule():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'tensr'"):
        S.Rules(params={"heads": ["tensr", None]}, activations={})


def test_kernels_split_by_the_same_policy_and_refuse_what_it_refuses():
    """A kernel under the layout splits its rows as `constrain` would, and a batch the batch
    axes do not divide is the same clear error (it used to run silently replicated)."""
    from meshtrain import kernels

    mesh = make_mesh("data=4,tensor=2")
    rules = S.rules_for("dp", mesh)
    x = jax.random.normal(jax.random.key(0), (6, 8, 16))
    scale = jnp.ones((16,))
    with S.activation_rules(mesh, rules), pytest.raises(ValueError) as err:
        jax.eval_shape(lambda x: kernels.rms_norm(x, scale, impl="pallas"), x)
    assert "(batch=6) is not divisible by mesh data=4" in str(err.value)
    x = x[:4]
    with S.activation_rules(mesh, rules):
        got = jax.jit(lambda x: kernels.rms_norm(x, scale, impl="pallas"))(x)
    want = kernels.reference.rms_norm(x.reshape(-1, 16), scale).reshape(x.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_manual_region_nests_inside_another():
    """A kernel (manual over the batch axes) inside a pipeline-like region manual over
    ``pipe`` runs on the inner axes only and gives the reference result."""
    from meshtrain import kernels

    mesh = make_mesh("pipe=2,data=4")
    rules = S.rules_for("dp", mesh)
    x = jax.random.normal(jax.random.key(1), (2, 8, 4, 16))  # [pipe, batch, seq, width]
    scale = jnp.linspace(0.5, 1.5, 16)

    def stage(x):
        assert S.manual_axes() == {"pipe"}
        return kernels.rms_norm(x[0], scale, impl="pallas")[None]

    region = S.manual_region(
        stage, mesh=mesh, axes={"pipe"}, in_specs=P("pipe"), out_specs=P("pipe")
    )
    with S.activation_rules(mesh, rules):
        got = jax.jit(region)(x)
    want = kernels.reference.rms_norm(x.reshape(-1, 16), scale).reshape(x.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("sizes", "want"),
    [
        ({"data": 2, "fsdp": 2, "tensor": 2}, "hsdp+tp"),
        ({"fsdp": 8}, "fsdp"),
        ({"data": 4, "tensor": 2}, "dp+tp"),
        ({"expert": 4, "data": 2}, "dp"),
        ({"pipe": 2, "fsdp": 2, "tensor": 2}, "fsdp+tp"),
    ],
)
def test_auto_strategy_picks_from_the_mesh(sizes, want):
    rules = S.rules_for("auto", sizes)
    assert rules.name == want
    assert rules == S.rules_for(want, sizes)


def test_auto_strategy_needs_a_mesh():
    with pytest.raises(ValueError, match="strategy='auto': picks from the mesh"):
        S.rules_for("auto")
