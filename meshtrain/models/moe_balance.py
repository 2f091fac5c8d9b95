"""Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias that moves the router's
top-k choice, updated once per optimizer step from the load of the step's whole batch.

Each MoE block holds two non-parameter variables (no gradient, no optimizer state): the bias
(`RouterBias`, [E]) and the choices counted since the last update (`RouterLoad`, [E]). Every
forward adds its choices to the count (over the rows of every shard, `expert_counts`), so
across gradient accumulation's microbatches the count covers the step's whole batch. After
the update (`settle`, which the train step runs through the model's ``after_step``) the bias
is ``b_e + γ · sign(mean_e(load) − load_e)`` and the count is zero again: a saved run holds
the bias, and an empty count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """A router's balancing bias per expert [E]: model state, never a parameter."""


class RouterLoad(nnx.Variable):
    """The top-k choices per expert [E] counted since the bias was last updated."""


def _replicated(cls, n_experts: int) -> nnx.Variable:
    """A float32 zero vector [E] of `cls`, with no logical axis: never split."""
    return cls(jnp.zeros((n_experts,), jnp.float32), out_sharding=(None,), eager_sharding=False)


def bias_and_load(n_experts: int) -> tuple[RouterBias, RouterLoad]:
    """A fresh bias and count for one MoE block (zeros)."""
    return _replicated(RouterBias, n_experts), _replicated(RouterLoad, n_experts)


def load_cv(load_LE: jax.Array) -> jax.Array:
    """The coefficient of variation of the load over the experts (std / mean; 0 when nothing
    was counted), averaged over the leading dims (the MoE blocks)."""
    mean_L = jnp.mean(load_LE, axis=-1)
    cv_L = jnp.std(load_LE, axis=-1) / jnp.maximum(mean_L, 1e-9)
    return jnp.mean(cv_L)


def update(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
    """``b + rate · sign(mean(load) − load)`` per block: the overloaded experts' bias falls, the
    underloaded ones' rises (an even load, or none counted, leaves it)."""
    mean_L1 = jnp.mean(load_LE, axis=-1, keepdims=True)
    return bias_LE + rate * jnp.sign(mean_L1 - load_LE)


def settle(bias: RouterBias, load: RouterLoad, rate: float) -> dict[str, jax.Array]:
    """Updates `bias` from `load` (any leading dims: the stacked blocks), zeroes `load`; the
    step's metrics: ``moe_expert_load_cv`` (of the load just counted) and the new bias's
    ``moe_router_bias_min`` / ``_max``."""
    load_LE = load[...]
    new_LE = update(bias[...], load_LE, rate)
    bias[...] = new_LE
    load[...] = jnp.zeros_like(load_LE)
    return {
        "moe_expert_load_cv": load_cv(load_LE),
        "moe_router_bias_min": jnp.min(new_LE),
        "moe_router_bias_max": jnp.max(new_LE),
    }
