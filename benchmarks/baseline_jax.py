"""The hand-written baseline: the same GPT and train step in plain JAX + optax, no meshtrain.

Its model and step are jax, numpy and optax only. The model is a few functions over a nested
dict of arrays with the layer weights stacked on a leading dimension and run by `jax.lax.scan`
(the layout meshtrain's GPT uses, so the same initial weights can be handed over as they are),
and the step is ``jax.jit(value_and_grad → optax update → apply_updates, donate_argnums=0)``.
Only its settings come from meshtrain: the decoder's shape is a `meshtrain.models.GPTConfig`
and the optimizer's numbers an `meshtrain.optim.OptimConfig`, so the two sides of a comparison
are configured by the same values.

`benchmarks/e2e.py` times it beside ``meshtrain bench`` in the same run (the framework-overhead
ratio); `tests/test_bench.py` checks that it computes meshtrain's losses on the same batch and
initial weights, step after step.

Shape suffixes: B batch, T positions, D width, H query heads, G key/value heads, K head width,
F feed-forward width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshtrain.models import GPTConfig
from meshtrain.optim import OptimConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# The decoder's settings. Of them the baseline implements the shape (`style`, the sizes and
# head counts, `rope_theta`, `norm_eps`, `tie_embeddings`), `dtype`, ``attention_impl`` "xla"
# (einsum + softmax) or "cudnn" (`jax.nn.dot_product_attention`), and ``remat`` "none", "full"
# or "save-dots"; kernels, fp8, RoPE scaling, sliding windows and q/k/v biases it leaves out.
Config = GPTConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptConfig(OptimConfig):
    """meshtrain's optimizer settings (AdamW only: global-norm clipping, linear warmup then
    cosine decay) and the length of the run, where the cosine ends."""

    total_steps: int = 1000


# --- the model -------------------------------------------------------------------------------


def init_params(cfg: Config, key: jax.Array) -> dict:
    """Random float32 weights, normal(0.02) (output projections scaled by 1/√(2L))."""
    D, H, G, K, F, L, V = (
        cfg.d_model,
        cfg.n_heads,
        cfg.kv_heads,
        cfg.head_width,
        cfg.ff_dim,
        cfg.n_layers,
        cfg.vocab_size,
    )
    keys = iter(jax.random.split(key, 16))
    out_std = 0.02 / math.sqrt(2 * L)

    def normal(shape, std=0.02):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    attn = {
        "q": {"kernel": normal((L, D, H, K))},
        "k": {"kernel": normal((L, D, G, K))},
        "v": {"kernel": normal((L, D, G, K))},
        "o": {"kernel": normal((L, H, K, D), out_std)},
    }
    mlp = {"up": {"kernel": normal((L, D, F))}, "down": {"kernel": normal((L, F, D), out_std)}}
    ones, zeros = jnp.ones((L, D)), jnp.zeros((L, D))
    if cfg.style == "llama":
        mlp["gate"] = {"kernel": normal((L, D, F))}
        norms = {"norm1": {"scale": ones}, "norm2": {"scale": ones}}
        final = {"scale": jnp.ones((D,))}
    else:
        for name, shape in (("q", (L, H, K)), ("k", (L, G, K)), ("v", (L, G, K)), ("o", (L, D))):
            attn[name]["bias"] = jnp.zeros(shape)
        mlp["up"]["bias"], mlp["down"]["bias"] = jnp.zeros((L, F)), jnp.zeros((L, D))
        norms = {"norm1": {"scale": ones, "bias": zeros}, "norm2": {"scale": ones, "bias": zeros}}
        final = {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))}
    params = {
        "embed": {"embedding": normal((V, D))},
        "blocks": {"attn": attn, "mlp": mlp, **norms},
        "norm": final,
    }
    if not cfg.tie_embeddings:
        params["head"] = {"kernel": normal((D, V))}
    if cfg.style == "gpt2":
        params["pos"] = normal((cfg.max_seq_len, D), 0.01)
    return params


def _norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (p has no bias) or LayerNorm, statistics in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    if "bias" in p:
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * (jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * p["scale"])
    if "bias" in p:
        y = y + p["bias"]
    return y.astype(x.dtype)


def _dense(p: dict, x: jax.Array, spec: str, dtype) -> jax.Array:
    """einsum of x with p["kernel"] (cast to the compute dtype), plus p["bias"] if any."""
    y = jnp.einsum(spec, x.astype(dtype), p["kernel"].astype(dtype))
    return y + p["bias"].astype(dtype) if "bias" in p else y


def _rope(x_BTHK: jax.Array, theta: float) -> jax.Array:
    """Rotary positions: pairs (first half, second half) of each head, angles in float32."""
    T, K = x_BTHK.shape[1], x_BTHK.shape[3]
    inv_freq = 1.0 / theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    angle_TK = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angle_TK)[None, :, None, :], jnp.sin(angle_TK)[None, :, None, :]
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BTHK.dtype)


def _attention(q_BTHK, k_BTGK, v_BTGK, impl: str) -> jax.Array:
    """Causal softmax attention with grouped key/value heads (softmax in float32)."""
    if impl == "cudnn":
        return jax.nn.dot_product_attention(
            q_BTHK, k_BTGK, v_BTGK, is_causal=True, implementation="cudnn"
        )
    B, T, H, K = q_BTHK.shape
    G = k_BTGK.shape[2]
    q = q_BTHK.reshape(B, T, G, H // G, K)
    s = jnp.einsum("btgrk,bsgk->bgrts", q, k_BTGK, preferred_element_type=jnp.float32)
    s = s / math.sqrt(K)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v_BTGK.dtype)
    return jnp.einsum("bgrts,bsgk->btgrk", p, v_BTGK).reshape(B, T, H, K)


def _block(cfg: Config, p: dict, x_BTD: jax.Array) -> jax.Array:
    dtype = DTYPES[cfg.dtype]
    h = _norm(p["norm1"], x_BTD, cfg.norm_eps)
    a = p["attn"]
    q = _dense(a["q"], h, "btd,dhk->bthk", dtype)
    k = _dense(a["k"], h, "btd,dgk->btgk", dtype)
    v = _dense(a["v"], h, "btd,dgk->btgk", dtype)
    if cfg.style == "llama":
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
    o = _attention(q, k, v, cfg.attention_impl)
    x_BTD = x_BTD + _dense(a["o"], o, "bthk,hkd->btd", dtype)
    h = _norm(p["norm2"], x_BTD, cfg.norm_eps)
    m = p["mlp"]
    if cfg.style == "llama":
        up = jax.nn.silu(_dense(m["gate"], h, "btd,df->btf", dtype)) * _dense(
            m["up"], h, "btd,df->btf", dtype
        )
    else:
        up = jax.nn.gelu(_dense(m["up"], h, "btd,df->btf", dtype))
    return x_BTD + _dense(m["down"], up, "btf,fd->btd", dtype)


_REMAT = {
    "full": None,
    "save-dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def logits(cfg: Config, params: dict, tokens_BT: jax.Array) -> jax.Array:
    """Token ids [B, T] → float32 logits [B, T, V]."""
    dtype = DTYPES[cfg.dtype]
    x_BTD = jnp.take(params["embed"]["embedding"].astype(dtype), tokens_BT, axis=0)
    if cfg.style == "gpt2":
        x_BTD = x_BTD + params["pos"][: tokens_BT.shape[1]].astype(dtype)

    def body(x, p):
        return _block(cfg, p, x), None

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
    x_BTD, _ = jax.lax.scan(body, x_BTD, params["blocks"])
    x_BTD = _norm(params["norm"], x_BTD, cfg.norm_eps)
    if cfg.tie_embeddings:
        out = jnp.einsum("btd,vd->btv", x_BTD, params["embed"]["embedding"].astype(dtype))
    else:
        out = _dense(params["head"], x_BTD, "btd,dv->btv", dtype)
    return out.astype(jnp.float32)


def loss(cfg: Config, params: dict, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy of batch {"inputs", "targets"} [B, T]."""
    out = logits(cfg, params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(out, batch["targets"]).mean()


# --- the step --------------------------------------------------------------------------------


def optimizer(opt: OptConfig) -> optax.GradientTransformation:
    """clip_by_global_norm, then AdamW with warmup + cosine; no decay on biases and scales."""
    if opt.optimizer != "adamw":
        raise ValueError(f"the baseline's optimizer is adamw, not {opt.optimizer!r}")
    # Step s (from 0) runs at optax's schedule of s + 1: the first step already gets lr/W, step
    # W − 1 the peak, and the last step (total_steps − 1) exactly lr · min_lr_ratio.
    warmup = max(min(opt.warmup_steps, opt.total_steps - 1), 1)
    shifted = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt.lr,
        warmup_steps=warmup,
        decay_steps=max(opt.total_steps, warmup + 1),
        end_value=opt.lr * opt.min_lr_ratio,
    )

    def schedule(step):
        return shifted(step + 1)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: str(getattr(path[-1], "key", path[-1])) not in ("bias", "scale"),
            params,
        )

    adamw = optax.adamw(
        schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask
    )
    return optax.chain(optax.clip_by_global_norm(opt.clip_norm), adamw) if opt.clip_norm else adamw


def make_step(cfg: Config, tx: optax.GradientTransformation) -> Callable:
    """``step((params, opt_state), batch) -> ((params, opt_state), loss)``, jitted, donated."""

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(lambda p: loss(cfg, p, batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return jax.jit(step, donate_argnums=0)


def data_parallel(params: dict, tx, batches: list[dict]):
    """Places params and optimizer state replicated and each batch split over all devices.

    Returns:
        ``((params, opt_state), batches)`` as device arrays.
    """
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("data",), axis_types=(AxisType.Auto,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    return (params, opt_state), [jax.device_put(b, split) for b in batches]
