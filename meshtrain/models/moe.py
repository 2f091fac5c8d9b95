"""A mixture-of-experts decoder: Llama-style attention, and feed-forward blocks that route each
token to its top-k of E SwiGLU experts (Mixtral), optionally beside a shared expert.

The blocks are created stacked in groups of ``moe_every`` (``moe_every − 1`` dense blocks, then
one MoE block) and scanned, so the compiled program holds one group whatever the depth. The
router's softmax, top-k, losses and statistics are computed on global arrays; only the
dispatch to the experts runs per shard (`meshtrain.kernels.moe_dispatch`). The forward returns
a `ModelOutput`: logits, the weighted router losses, and the per-step statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain import context_parallel
from meshtrain.layout import constrain
from meshtrain.models import layers, moe_balance, token_ends
from meshtrain.models import remat as remat_policies
from meshtrain.models.base import ModelOutput, PipelineParts
from meshtrain.models.gpt import MLP, Block, make_attention
from meshtrain.models.moe_config import MoEConfig
from meshtrain.models.moe_dispatch import Routing, dispatch
from meshtrain.models.moe_routing import (
    expert_counts,
    load_balance_loss,
    load_stats,
    pooled_load_balance_loss,
    route,
    router_sums,
    z_loss,
)


def _param(rngs: nnx.Rngs, names, shape, std=0.02) -> nnx.Param:
    """A float32 parameter of `shape`, normal(std), carrying logical `names`."""
    return nnx.Param(layers.init(names, std)(rngs.params(), shape))


class Experts(nnx.Module):
    """Router, E SwiGLU experts (weights [E, ...] named ``expert``) and an optional shared one."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        E, D, F = cfg.n_experts, cfg.d_model, cfg.expert_dim
        self.cfg = cfg
        self.router = _param(rngs, ("embed", None), (D, E))
        self.gate = _param(rngs, ("expert", "embed", "mlp"), (E, D, F))
        self.up = _param(rngs, ("expert", "embed", "mlp"), (E, D, F))
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.down = _param(rngs, ("expert", "mlp", "embed"), (E, F, D), out_std)
        if cfg.shared_expert:
            shared = dataclasses.replace(cfg.backbone, d_ff=cfg.shared_expert)
            self.shared = MLP(shared, rngs=rngs)
        else:
            self.shared = None
        if cfg.bias_update_rate:  # auxiliary-loss-free balancing (meshtrain.models.moe_balance)
            self.bias, self.load = moe_balance.bias_and_load(E)
        else:
            self.bias = self.load = None

    def __call__(
        self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The experts' output for [B, T, D] tokens, and the router's losses and statistics
        (with ``router_losses="mixtral"``, the `router_sums` of the real tokens, those with
        ``segment_ids_BT > 0``, in place of ``aux_loss``)."""
        cfg = self.cfg
        T = x_BTD.shape[1]
        logits_BTE = jnp.dot(x_BTD.astype(jnp.float32), self.router[...])
        slots = cfg.capacity_slots(T) if cfg.dispatch == "capacity" else None
        # Under context parallelism the tokens run in the balanced (zig-zag) order; capacity
        # gives slots in position order, so the router ranks them in their own order and the
        # routing then follows the tokens (the losses and statistics are means over tokens,
        # the same in either order).
        order = context_parallel.balanced_order(T)
        if order is not None:
            logits_BTE = logits_BTE[:, context_parallel.inverse(order)]
        bias_E = None if self.bias is None else self.bias[...]
        routing = route(
            logits_BTE,
            cfg.top_k,
            renormalize=cfg.renormalize,
            capacity_slots=slots,
            choice=cfg.choice,
            bias_E=bias_E,
        )
        if self.load is not None:  # counted until the step's update (moe_balance.settle)
            self.load[...] = self.load[...] + expert_counts(routing.expert_BTK, cfg.n_experts)
        kind = cfg.router_scores
        if cfg.router_losses == "mixtral":
            real_BT = None if segment_ids_BT is None else segment_ids_BT > 0
            balance = router_sums(logits_BTE, routing.expert_BTK, real_BT, kind)
        else:
            balance = {"aux_loss": load_balance_loss(logits_BTE, routing.expert_BTK, kind)}
        stats = {
            **balance,
            "z_loss": z_loss(logits_BTE),
            **load_stats(routing, cfg.n_experts),
        }
        if order is not None:
            routing = Routing(*(field_BTK[:, order] for field_BTK in routing))
        dtype = cfg.backbone.compute_dtype
        if jax.default_backend() == "cpu":
            # XLA's CPU compiler aborts on the bfloat16 dispatch's backward ("Invalid binary
            # instruction opcode copy"), so on CPU the experts run in float32.
            dtype = jnp.float32
        weights = tuple(w[...].astype(dtype) for w in (self.gate, self.up, self.down))
        y_BTD = dispatch(
            x_BTD.astype(dtype),
            routing,
            weights,
            kind=cfg.dispatch,
            n_experts=cfg.n_experts,
            slots=slots or 0,
            grouped=cfg.grouped_impl,
            fp8=cfg.fp8,
        )
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD)
        return y_BTD.astype(x_BTD.dtype), stats


class MoEBlock(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + experts(norm(x)); also the router stats."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        g = cfg.backbone
        norm = dict(eps=g.norm_eps, dtype=g.compute_dtype, param_dtype=jnp.float32, rngs=rngs)
        self.norm1 = layers.make_norm("rmsnorm", g.d_model, **norm)
        self.attn = make_attention(g, rngs=rngs)
        self.norm2 = layers.make_norm("rmsnorm", g.d_model, **norm)
        self.moe = Experts(cfg, rngs=rngs)

    def __call__(
        self, x_BTD: jax.Array, segment_ids_BT=None, positions_BT=None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        x_BTD = x_BTD + self.attn(self.norm1(x_BTD), segment_ids_BT, positions_BT)
        y_BTD, stats = self.moe(self.norm2(x_BTD), segment_ids_BT)
        return constrain(x_BTD + y_BTD, ("batch", "seq", "embed")), stats


class Group(nnx.Module):
    """``moe_every − 1`` dense blocks, then one MoE block."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.dense = nnx.List([Block(cfg.backbone, rngs=rngs) for _ in range(cfg.moe_every - 1)])
        self.moe_block = MoEBlock(cfg, rngs=rngs)

    def __call__(
        self, x_BTD: jax.Array, segment_ids_BT=None, positions_BT=None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        for block in self.dense:
            x_BTD = block(x_BTD, segment_ids_BT, positions_BT)
        return self.moe_block(x_BTD, segment_ids_BT, positions_BT)


class MoE(nnx.Module):
    """Token ids [B, T] → `ModelOutput` (float32 logits [B, T, padded_vocab], the weighted
    router losses, and ``moe_*`` metrics averaged over the MoE blocks).

    A packed batch's ``segment_ids`` and ``positions`` keyword arguments act as in
    `meshtrain.models.gpt.GPT`: attention stays within each document and RoPE restarts per
    document. The load statistics, the z-loss and meshtrain's load-balancing loss count every
    token (padding too); Mixtral's (``router_losses="mixtral"``) counts the real tokens only,
    as transformers does with an attention mask."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        g = cfg.backbone
        self.embed = token_ends.token_embedding(g, rngs)

        @nnx.split_rngs(splits=cfg.n_moe_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_groups(rngs: nnx.Rngs) -> Group:
            return Group(cfg, rngs=rngs)

        self.groups = make_groups(rngs)
        self.norm = layers.make_norm(
            "rmsnorm",
            g.d_model,
            eps=g.norm_eps,
            dtype=g.compute_dtype,
            param_dtype=jnp.float32,
            rngs=rngs,
        )
        self.head = token_ends.output_head(g, rngs)

    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> ModelOutput:
        x_BTD = self.embed_tokens(tokens_BT, positions)
        remat = self.cfg.backbone.remat
        x_BTD, totals = scan_groups(self.groups, x_BTD, segment_ids, positions, remat=remat)
        logits_BTV = self.head_logits(x_BTD)
        aux, metrics = pipeline_stats(totals, cfg=self.cfg)
        return ModelOutput(logits_BTV, aux, metrics)

    # The forward in pieces, so a pipeline can run the groups stage by stage and the
    # embedding and head around them.

    def embed_tokens(
        self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None
    ) -> jax.Array:
        """Token ids [B, T] → input activations [B, T, D] in the compute dtype. Under context
        parallelism the tokens take the balanced (zig-zag) order here, as the GPT's do, and
        `head_logits` restores theirs. `positions_BT` is accepted for the GPT's signature: the
        MoE's positions are rotary, applied in attention."""
        del positions_BT
        T = tokens_BT.shape[1]
        token_ends.check_length(T, self.cfg.backbone)
        order = context_parallel.balanced_order(T)
        if order is not None:
            tokens_BT = tokens_BT[:, order]
        return constrain(self.embed(tokens_BT), ("batch", "seq", "embed"))

    def head_logits(self, x_BTD: jax.Array) -> jax.Array:
        """Final norm and output head: [B, T, D] → float32 logits [B, T, padded_vocab] (the
        padded ids' masked), back in the tokens' own order."""
        order = context_parallel.balanced_order(x_BTD.shape[1])
        if order is not None:  # back from the balanced order `embed_tokens` chose
            x_BTD = constrain(x_BTD[:, context_parallel.inverse(order)], ("batch", "seq", "embed"))
        return token_ends.logits(self.norm(x_BTD), self.embed, self.head, self.cfg.backbone)

    def after_step(self) -> dict[str, jax.Array]:
        """Once per optimizer step, after the update: the routers' balancing biases move by the
        load the step's forwards counted (`meshtrain.models.moe_balance.settle`); its metrics.
        Nothing without a bias (``bias_update_rate = 0``)."""
        experts = self.groups.moe_block.moe
        if experts.bias is None:
            return {}
        return moe_balance.settle(experts.bias, experts.load, self.cfg.bias_update_rate)

    def pipeline_parts(self) -> PipelineParts:
        """The embedding, the stacked groups and the head, for `meshtrain.pipeline`; the groups
        return their router statistics, which `pipeline_stats` turns into the weighted router
        losses and the ``moe_*`` metrics."""
        cfg = self.cfg
        head = ("norm", "head") if self.head is not None else ("norm", "embed")
        return PipelineParts(
            blocks="groups",
            embed=self.embed_tokens,
            run_blocks=functools.partial(scan_groups, remat=cfg.backbone.remat),
            head=self.head_logits,
            head_params=head,
            packed=True,
            stats=functools.partial(pipeline_stats, cfg=cfg),
        )


def scan_groups(
    groups: Group,
    x_BTD: jax.Array,
    segment_ids_BT: jax.Array | None = None,
    positions_BT: jax.Array | None = None,
    *,
    remat: str = "none",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scans stacked `groups` (a leading dimension of any length) over `x_BTD`; returns the
    output and each router statistic summed over the groups (per expert where it is)."""

    def body(group: Group, x_BTD: jax.Array, seg_BT, pos_BT):
        return group(x_BTD, seg_BT, pos_BT)

    if remat != "none":
        body = nnx.remat(body, policy=remat_policies.policy(remat), prevent_cse=False)
    scan = nnx.scan(body, in_axes=(0, nnx.Carry, None, None), out_axes=(nnx.Carry, 0))
    x_BTD, stats = scan(groups, x_BTD, segment_ids_BT, positions_BT)
    return x_BTD, {k: jnp.sum(v, axis=0) for k, v in stats.items()}


def pipeline_stats(
    totals: dict[str, jax.Array], *, cfg: MoEConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Router statistics summed over the MoE blocks → ``(aux_loss, metrics)``: the coefficients
    times the losses, and the ``moe_*`` metrics as means over the blocks. The load-balancing
    loss is the sum of the blocks' (``"meshtrain"``) or Mixtral's of the pooled `router_sums`
    (``"mixtral"``, reported as ``moe_aux_loss``; a ratio of sums, so the same for totals
    scaled by any factor, as a pipeline's mean over microbatches scales them)."""
    totals = dict(totals)
    if cfg.router_losses == "mixtral":
        sums = (totals.pop(k) for k in ("router_choices", "router_probs", "router_tokens"))
        balance = pooled_load_balance_loss(*sums)
    else:
        balance = totals["aux_loss"]
    aux = cfg.z_loss_coef * totals["z_loss"]
    if cfg.aux_loss_coef:  # weighted 0, it stays out of the loss and of what its gradient reads
        aux = cfg.aux_loss_coef * balance + aux
    metrics = {f"moe_{k}": v / cfg.n_moe_layers for k, v in totals.items()}
    if cfg.router_losses == "mixtral":
        metrics["moe_aux_loss"] = balance
    return aux, metrics
