"""Context parallelism with the Pallas flash kernel (``impl="pallas"``, interpreted on CPU):
ring, all-gather and Ulysses against plain single-device attention (output and every
gradient), a whole GPT with ``attention_impl="pallas"`` on seq × data against one device, and
cuDNN refused under ``seq > 1`` before anything compiles.

Shapes are the smallest that cross the kernel's block boundary: 80 tokens per device with
head width 64 give 64-row blocks, the second one mostly padding; all-gather and Ulysses run
over the whole sequence (160 to 640 keys). Inputs are fresh random float32 arrays.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cp_helpers import errors_vs_full, qkv
from _helpers import initial_values, losses_and_params, state_and_step, token_batches
from flax import nnx

from meshtrain import context_parallel as cp
from meshtrain.check import check_run
from meshtrain.context_parallel import blocks
from meshtrain.kernels import attention as flash
from meshtrain.kernels import reference
from meshtrain.layout import activation_rules, rules_for
from meshtrain.lower import make_optimizer
from meshtrain.mesh import make_mesh
from meshtrain.models import DataSpec, GPTConfig, build_model
from meshtrain.run import RunSpec
from meshtrain.train import OptimConfig

ATOL = 2e-5  # float32: measured ≤ 6e-6 on outputs and gradients of unit-scale inputs
ALGORITHMS = ("ring", "allgather", "ulysses")
PER_DEVICE, K = 80, 64


def _errors(algorithm, n, causal, H, G, window=None, layout=False):
    """Max |difference| of the output and of dq, dk, dv against plain attention."""
    return errors_vs_full(
        [algorithm], n, causal, H, G, PER_DEVICE * n, K=K, B=8 // n if layout else 1,
        window=window, impl="pallas", layout=layout, seed=n * 1000 + H * 10 + G + causal,
    )[algorithm]  # fmt: skip


# (seq, causal, heads, kv heads, window, under a layout): seq 2/4/8, causal and not, GQA and
# MHA; a window that spans a block boundary; the layout's per-shard call (batch over data).
CASES = [
    (2, True, 4, 2, None, False),
    (4, False, 4, 4, None, True),
    (8, True, 8, 2, 100, False),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n, causal, H, G, window, layout", CASES)
@pytest.mark.pair("pallas", "ring")
@pytest.mark.pair("pallas", "allgather")
@pytest.mark.pair("pallas", "ulysses")
def test_algorithm_with_the_kernel_equals_plain_attention(
    algorithm, n, causal, H, G, window, layout
):
    errors = _errors(algorithm, n, causal, H, G, window, layout)
    assert max(errors) < ATOL, errors


def test_a_block_that_sees_no_key_ends_with_lse_near_neg():
    """Queries wholly before a block's keys: output 0 and lse ≈ NEG, so `merge` weighs the
    block 0; the merged result is the other block's."""
    q, k, v, _ = qkv(7, 1, 40, 2, 2, 64)
    pos_q, pos_k = jnp.arange(40), 100 + jnp.arange(40)

    @jax.jit
    def run(q, k, v):
        o, lse = blocks.attend(q, k, v, pos_q, pos_k, blocks.Options(True, None, "pallas"))
        own = blocks.attend(q, k, v, pos_q, pos_q, blocks.Options(True, None, "pallas"))
        return o, lse, own, blocks.merge(*own, o, lse)

    o, lse, (o_own, lse_own), (merged, lse_m) = run(q, k, v)
    assert float(np.abs(np.asarray(o)).max()) == 0.0 and float(lse.max()) < blocks.NEG / 2
    np.testing.assert_allclose(merged, o_own, atol=1e-6)
    np.testing.assert_allclose(lse_m, lse_own, atol=1e-6)


# --- refusals -----------------------------------------------------------------------------


def test_impls_context_parallelism_cannot_run_are_clear_errors():
    mesh = make_mesh("data=4,seq=2")
    q, k, v, _ = qkv(0, 1, 32, 2, 2, 64)
    pos = jnp.arange(32)
    with pytest.raises(ValueError, match="impl='cudnn' cannot compute a block"):
        cp.context_attention(q, k, v, pos, mesh=mesh, impl="cudnn")
    with pytest.raises(ValueError, match="choose from xla, pallas, auto"):
        cp.context_attention(q, k, v, pos, mesh=mesh, impl="triton")
    with pytest.raises(ValueError, match="head_dim=32 is not supported"):
        cp.context_attention(q[..., :32], k[..., :32], v[..., :32], pos, mesh=mesh, impl="pallas")
    assert cp.attention.block_impl("auto", 64) == "xla"  # no GPU here: the jnp math


def test_gpt_with_cudnn_attention_under_seq_is_refused_naming_the_field():
    """The run check refuses the pair before anything compiles, naming the field and the fix;
    traced anyway, the model's context-parallel attention refuses the impl."""
    sizes = dict(pipe=1, data=4, fsdp=1, expert=1, seq=2, tensor=1)
    cfg = GPTConfig(
        n_layers=1, d_model=128, n_heads=2, max_seq_len=32, attention_impl="cudnn",
        dtype="bfloat16",
    )  # fmt: skip
    data = DataSpec(kind="lm", batch_size=8, seq_len=32, vocab_size=cfg.vocab_size)
    problems = check_run(RunSpec(model=cfg, data=data, mesh=sizes, rules=rules_for("dp", sizes)))
    assert [p.field for p in problems] == ["gpt.attention_impl"]
    assert re.search(r"gpt.attention_impl='cudnn'.*pallas, auto or xla", str(problems[0]))

    mesh = make_mesh("seq=2,data=4")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))

    def forward(state, tokens):
        with activation_rules(mesh, rules_for("dp", mesh)):
            return nnx.merge(graphdef, state)(tokens)

    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"impl='cudnn' cannot compute a block.*'pallas', 'auto'"),
    ):
        jax.eval_shape(forward, state, jax.ShapeDtypeStruct((4, 32), jnp.int32))


# --- a whole GPT --------------------------------------------------------------------------

T, B, STEPS = 32, 4, 3
# SGD: parameters move by lr × gradient, so their difference bounds the gradients'; Adam's
# normalisation would blow float rounding in near-zero gradients up to lr (the jnp ring on
# this model differs from one device by 1.6e-4 after 3 AdamW steps at lr 1e-3).
TX = make_optimizer(OptimConfig(optimizer="sgd", lr=0.1, warmup_steps=0), 10)
GPT = GPTConfig(
    style="llama", n_layers=2, d_model=128, n_heads=2, n_kv_heads=1, max_seq_len=T,
    attention_impl="pallas",
)  # fmt: skip


def _batches(cfg):
    return token_batches(STEPS, cfg.vocab_size, B, T)


def _train(cfg, mesh_str, values, devices=None):
    """STEPS steps from `values`: the losses and the final parameters."""
    mesh = make_mesh(mesh_str, devices=devices)
    rules = rules_for("dp", mesh, context_parallel="ring")
    # `values` moved into the layout (no initialiser program is compiled)
    data = _batches(cfg)
    _, state, _, step = state_and_step(lambda: build_model(cfg), TX, mesh, rules, data[0], values)
    losses, params, _ = losses_and_params(step, state, data, mesh, rules)
    return losses, params


@pytest.mark.slow
@pytest.mark.pair("pallas", "ring")
@pytest.mark.pair("dp", "pallas")
@pytest.mark.pair("remat", "pallas")
@pytest.mark.pair("dp", "ring")
@pytest.mark.pair("remat", "ring")
def test_gpt_with_the_kernel_on_seq4_data2_equals_one_device(monkeypatch):
    """3 steps with ring attention through the kernel (attention_impl='pallas') on seq=4 ×
    data=2 equal the same model's single-device run (whose attention is the flash kernel
    without positions): losses and parameters."""
    cfg = dataclasses.replace(GPT, remat="full")
    values = initial_values(cfg)
    calls = []
    for name in ("block_forward", "block_backward"):
        real = getattr(flash, name)
        spy = lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(flash, name, spy)
    loss, params = _train(cfg, "seq=4,data=2", values)
    assert {"block_forward", "block_backward"} <= set(calls)  # the blocks ran the kernel
    loss_1, params_1 = _train(cfg, "data=1", values, devices=jax.devices()[:1])
    np.testing.assert_allclose(loss, loss_1, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # moves ~4e-3; measured 1e-8
    assert not np.allclose(loss[0], loss[-1])  # it trained


# --- on a GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_algorithm_compiles_the_kernel_on_a_gpu_and_equals_plain_attention(algorithm):
    """Each algorithm with the Pallas kernel compiled by Triton (not interpreted), on as many
    GPUs as divide 8 (one GPU: a ring of one), against plain attention on the same GPU."""
    gpus = jax.devices("gpu")
    n = max(d for d in (1, 2, 4, 8) if d <= len(gpus))
    mesh = make_mesh(f"seq={n}", devices=gpus[:n])
    T = 256 * n
    whole = jax.NamedSharding(mesh, jax.P())
    q, k, v, w = (jax.device_put(x, whole) for x in qkv(3, 2, T, 8, 2, 64))
    idx = cp.order(T, n)
    inv = cp.inverse(idx)

    def split(q, k, v):
        q, k, v = (x[:, idx] for x in (q, k, v))
        o = cp.context_attention(q, k, v, idx, mesh=mesh, algorithm=algorithm, impl="pallas")
        return (o * w[:, idx]).sum(), o

    with jax.set_mesh(mesh):
        (_, o), g = jax.jit(jax.value_and_grad(split, (0, 1, 2), has_aux=True))(q, k, v)

    def full(q, k, v):
        o = reference.attention(q, k, v, causal=True)
        return (o * w).sum(), o

    (_, o_want), g_want = jax.jit(jax.value_and_grad(full, (0, 1, 2), has_aux=True))(q, k, v)
    o = jax.device_get(o)[:, inv]
    errors = [float(jnp.abs(jnp.asarray(o) - o_want).max())]
    errors += [float(jnp.abs(jax.device_get(a) - b).max()) for a, b in zip(g, g_want, strict=True)]
    assert max(errors) < 1e-2, errors  # TF32 matmuls on the GPU


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_kernel_visits_half_the_tiles_of_the_zigzag_ring(n):
    """The ring hands the kernel whole blocks; the kernel's position test (`_sees_block`, the
    one its loops use) skips every 64 × 64 tile the causal mask leaves empty. Per device, with
    m tiles per block and chunks of m/2 tiles: each of the n − 1 hops visits m²/2 tiles, the
    own block (m/2)² + 2 · (m/2)(m/2 + 1)/2, against n·m² for whole blocks."""
    tile, m = 64, 4  # chunks of 128 positions
    T = n * m * tile
    pos = np.asarray(cp.order(T, n)).reshape(n, m, tile)  # device, tile, row
    for i in range(n):
        visited = 0
        for j in range(n):
            for qt in range(m):
                sees = flash._sees_block(
                    jnp.asarray(pos[i, qt]), lambda kt, j=j: jnp.asarray(pos[j, kt]), True, None
                )
                visited += sum(bool(sees(kt)) for kt in range(m))
        half = m // 2
        assert visited == (n - 1) * m * m // 2 + half * half + half * (half + 1)
