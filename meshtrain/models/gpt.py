"""A decoder-only transformer: GPT-2 style or Llama style from one config.

    gpt2   learned positions, LayerNorm, GELU MLP, biases
    llama  rotary positions (RoPE), RMSNorm, SwiGLU MLP, no biases

Both take multi-head or grouped-query attention (``n_kv_heads``). The blocks are created
stacked (one leading ``layers`` dimension) and run with `nnx.scan`, so the compiled program
holds one block whatever the depth. Parameters and activations carry logical names only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain import context_parallel, kernels
from meshtrain.layout import constrain
from meshtrain.models import layers, mla, token_ends
from meshtrain.models import remat as remat_policies
from meshtrain.models.base import PipelineParts
from meshtrain.models.gpt_config import GPTConfig
from meshtrain.models.remat import ATTN_OUT
from meshtrain.models.token_order import token_order


def _projection(layer, cfg: GPTConfig, rngs: nnx.Rngs):
    """`layer` (a linear layer class) with the settings every projection of a block shares:
    biases for gpt2, the compute dtype, the precision's matmul."""
    return functools.partial(
        layer,
        use_bias=cfg.style == "gpt2",
        dtype=cfg.compute_dtype,
        dot_general=cfg.dot_general,
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with a Megatron-splittable (heads) layout; with
    ``qk_norm`` each query and key head is RMS-normalised before RoPE (Qwen3)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        D, H, G, K = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_width
        bias = cfg.style == "gpt2"
        dense = _projection(nnx.LinearGeneral, cfg, rngs)
        qkv = functools.partial(dense, use_bias=bias or cfg.qkv_bias)
        self.q = qkv(
            D,
            (H, K),
            kernel_init=layers.init(("embed", "heads", "kv")),
            bias_init=layers.const_init(nnx.initializers.zeros, ("heads", "kv")),
        )
        kv_bias = layers.const_init(nnx.initializers.zeros, ("kv_heads", "kv"))
        self.k = qkv(
            D, (G, K), kernel_init=layers.init(("embed", "kv_heads", "kv")), bias_init=kv_bias
        )
        self.v = qkv(
            D, (G, K), kernel_init=layers.init(("embed", "kv_heads", "kv")), bias_init=kv_bias
        )
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.o = dense(
            (H, K),
            D,
            axis=(-2, -1),
            kernel_init=layers.init(("heads", "kv", "embed"), out_std),
            bias_init=layers.const_init(nnx.initializers.zeros, ("embed",)),
        )
        head_norm = functools.partial(  # one [K] scale each, shared by every head
            layers.make_norm, "rmsnorm", K, eps=cfg.norm_eps, dtype=cfg.compute_dtype,
            param_dtype=jnp.float32, rngs=rngs, axis="kv",
        )  # fmt: skip
        self.q_norm = head_norm() if cfg.qk_norm else None
        self.k_norm = head_norm() if cfg.qk_norm else None
        self.rope = cfg.style == "llama"
        self.rope_theta = cfg.rope_theta
        self.llama3 = None
        if cfg.rope_scaling == "llama3":
            self.llama3 = (
                cfg.rope_factor,
                cfg.rope_low_freq_factor,
                cfg.rope_high_freq_factor,
                cfg.rope_original_max_seq_len,
            )
        self.window = cfg.sliding_window or None
        self.impl = cfg.attention_impl  # "auto" resolves per call (sequence, packing, layout)

    def __call__(
        self,
        x_BTD: jax.Array,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        """Self-attention over [B, T, D]; with `segment_ids_BT` a token attends only to earlier
        tokens of its own segment, and with `positions_BT` RoPE rotates each token by its own
        position (both [B, T] integers: a packed batch, in the plain order of the row even
        when context parallelism runs the tokens in the balanced order)."""
        q_BTHK = constrain(self.q(x_BTD), ("batch", "seq", "heads", "kv"))
        k_BTGK = constrain(self.k(x_BTD), ("batch", "seq", "kv_heads", "kv"))
        v_BTGK = constrain(self.v(x_BTD), ("batch", "seq", "kv_heads", "kv"))
        if self.q_norm is not None:  # over each head's K dims, before RoPE
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BTHK, k_BTGK, v_BTGK = (checkpoint_name(a, "qkv") for a in (q_BTHK, k_BTGK, v_BTGK))
        T = x_BTD.shape[1]
        width = q_BTHK.shape[-1] if self.rope else None
        cp, order, segment_ids_BT, cos, sin = token_order(
            T, segment_ids_BT, positions_BT, width, self.rope_theta, self.llama3
        )
        if self.rope:
            q_BTHK = layers.apply_rope(q_BTHK, cos, sin)
            k_BTGK = layers.apply_rope(k_BTGK, cos, sin)
        impl = kernels.model_attention_impl(
            self.impl, q_BTHK.shape[-1], q_BTHK.dtype, seq=T, window=self.window,
            packed=segment_ids_BT is not None, context=cp is not None and cp.algorithm,
        )  # fmt: skip
        if cp is not None:
            # The mask: causal (and windowed) by each token's index in its row (`order`), and
            # within one segment, as `layers.causal_attention` masks the plain order.
            o_BTHK = context_parallel.attend_active(
                q_BTHK, k_BTGK, v_BTGK, order, window=self.window, impl=impl,
                segment_ids=segment_ids_BT,
            )  # fmt: skip
        elif impl == "xla":
            o_BTHK = layers.causal_attention(
                q_BTHK, k_BTGK, v_BTGK, window=self.window, segment_ids=segment_ids_BT
            )
        else:
            o_BTHK = kernels.flash_attention(
                q_BTHK,
                k_BTGK,
                v_BTGK,
                impl=impl,
                window=self.window,
                segment_ids=segment_ids_BT,
            )
        o_BTHK = checkpoint_name(o_BTHK, ATTN_OUT)
        o_BTHK = constrain(o_BTHK, ("batch", "seq", "heads", "kv"))
        return self.o(o_BTHK)


def make_attention(cfg: GPTConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """The attention of a block: `Attention`, or `mla.LatentAttention` for attention='mla'."""
    if cfg.attention == "mla":
        return mla.LatentAttention(cfg, rngs=rngs)
    return Attention(cfg, rngs=rngs)


class MLP(nnx.Module):
    """GELU (gpt2) or SwiGLU (llama) feed-forward block."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.ff_dim
        dense = _projection(nnx.Linear, cfg, rngs)
        up = layers.init(("embed", "mlp"))
        up_bias = layers.const_init(nnx.initializers.zeros, ("mlp",))
        self.swiglu = cfg.style == "llama"
        self.gate = dense(D, F, kernel_init=up, bias_init=up_bias) if self.swiglu else None
        self.up = dense(D, F, kernel_init=up, bias_init=up_bias)
        self.down = dense(
            F,
            D,
            kernel_init=layers.init(("mlp", "embed"), 0.02 / math.sqrt(2 * cfg.n_layers)),
            bias_init=layers.const_init(nnx.initializers.zeros, ("embed",)),
        )

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        if self.swiglu:
            h_BTF = jax.nn.silu(self.gate(x_BTD)) * self.up(x_BTD)
        else:
            h_BTF = jax.nn.gelu(self.up(x_BTD))
        h_BTF = constrain(h_BTF, ("batch", "seq", "mlp"))
        return self.down(checkpoint_name(h_BTF, "mlp_hidden"))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        norm = "layernorm" if cfg.style == "gpt2" else "rmsnorm"
        make_norm = functools.partial(
            layers.make_norm,
            norm,
            cfg.d_model,
            eps=cfg.norm_eps,
            dtype=cfg.compute_dtype,
            param_dtype=jnp.float32,
            rngs=rngs,
        )
        self.norm1 = make_norm()
        self.attn = make_attention(cfg, rngs=rngs)
        self.norm2 = make_norm()
        self.mlp = MLP(cfg, rngs=rngs)
        self.norm_impl = cfg.norm_impl

    def __call__(
        self,
        x_BTD: jax.Array,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        h_BTD = checkpoint_name(layers.apply_norm(self.norm1, x_BTD, self.norm_impl), "attn_in")
        x_BTD = x_BTD + self.attn(h_BTD, segment_ids_BT, positions_BT)
        h_BTD = checkpoint_name(layers.apply_norm(self.norm2, x_BTD, self.norm_impl), "mlp_in")
        x_BTD = x_BTD + self.mlp(h_BTD)
        return constrain(x_BTD, ("batch", "seq", "embed"))


class GPT(nnx.Module):
    """Token ids [B, T] → next-token logits [B, T, padded_vocab] (float32); the logits of
    padded ids (``vocab_size`` and up) are `layers.PADDED_LOGIT`.

    A packed batch also gives ``segment_ids`` and ``positions`` ([B, T] integers, see
    `__call__`): attention then stays within each document, and positions restart at each
    document's start (unless ``restart_positions=False``)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D = cfg.d_model
        self.embed = token_ends.token_embedding(cfg, rngs)
        if cfg.style == "gpt2":
            pos_init = layers.init(("pos", "embed"), 0.01)
            self.pos = nnx.Param(pos_init(rngs.params(), (cfg.max_seq_len, D), jnp.float32))
        else:
            self.pos = None

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        norm = "layernorm" if cfg.style == "gpt2" else "rmsnorm"
        self.norm = layers.make_norm(
            norm, D, eps=cfg.norm_eps, dtype=cfg.compute_dtype, param_dtype=jnp.float32, rngs=rngs
        )
        self.head = token_ends.output_head(cfg, rngs)

    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Logits of `tokens_BT`.

        Args:
            tokens_BT: token ids [B, T].
            segment_ids: [B, T] document ids of a packed batch (0 = padding, documents 1, 2,
                …); a token attends only to earlier tokens of its own document. None: one
                causal sequence per row.
            positions: [B, T] each token's position within its document; the learned (gpt2)
                or rotary (llama) positions use them unless ``restart_positions=False``.
                None: 0..T−1 in every row.

        Returns:
            Float32 logits [B, T, padded_vocab].
        """
        if not self.cfg.restart_positions:
            positions = None
        x_BTD = self.embed_tokens(tokens_BT, positions)
        return self.head_logits(self.run_blocks(x_BTD, segment_ids, positions))

    # The forward in three pieces, so a pipeline can run the blocks stage by stage and the
    # embedding and head around them.

    def pipeline_parts(self) -> PipelineParts:
        """The embedding, the stacked blocks and the head, for `meshtrain.pipeline`."""
        head = ("norm", "head") if self.head is not None else ("norm", "embed")
        remat, restart = self.cfg.remat, self.cfg.restart_positions

        def embed(tokens_BT, positions_BT=None):
            return self.embed_tokens(tokens_BT, positions_BT if restart else None)

        def run_blocks(blocks, x_BTD, segment_ids_BT=None, positions_BT=None):
            positions_BT = positions_BT if restart else None
            return scan_blocks(blocks, x_BTD, remat, segment_ids_BT, positions_BT)

        return PipelineParts(
            blocks="blocks",
            embed=embed,
            run_blocks=run_blocks,
            head=self.head_logits,
            head_params=head,
            packed=True,
        )

    def embed_tokens(
        self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None
    ) -> jax.Array:
        """Token ids [B, T] → input activations [B, T, D] in the compute dtype; learned
        positions by `positions_BT` ([B, T]) when given, else 0..T−1."""
        T = tokens_BT.shape[1]
        token_ends.check_length(T, self.cfg)
        # Under context parallelism the tokens take the balanced (zig-zag) order here and
        # `head_logits` restores theirs: attention follows their positions, so the logits are
        # exactly those of the plain order.
        order = context_parallel.balanced_order(T)
        if order is not None:
            tokens_BT = tokens_BT[:, order]
            if positions_BT is not None:
                positions_BT = positions_BT[:, order]
        x_BTD = self.embed(tokens_BT)  # the table is gathered to its activation layout first
        if self.pos is not None and positions_BT is not None:
            x_BTD = x_BTD + self.pos[positions_BT].astype(x_BTD.dtype)
        elif self.pos is not None:
            pos_TD = self.pos[:T] if order is None else self.pos[order]
            x_BTD = x_BTD + pos_TD.astype(x_BTD.dtype)
        return constrain(x_BTD, ("batch", "seq", "embed"))

    def run_blocks(
        self,
        x_BTD: jax.Array,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        """Runs the stacked blocks over [B, T, D] activations (of a packed batch with
        `segment_ids_BT` and `positions_BT`)."""
        return scan_blocks(self.blocks, x_BTD, self.cfg.remat, segment_ids_BT, positions_BT)

    def head_logits(self, x_BTD: jax.Array) -> jax.Array:
        """Final norm and output head: [B, T, D] → float32 logits [B, T, padded_vocab], the
        padded ids' masked."""
        order = context_parallel.balanced_order(x_BTD.shape[1])
        if order is not None:  # back from the balanced order `embed_tokens` chose
            x_BTD = constrain(x_BTD[:, context_parallel.inverse(order)], ("batch", "seq", "embed"))
        x_BTD = layers.apply_norm(self.norm, x_BTD, self.cfg.norm_impl)
        return token_ends.logits(x_BTD, self.embed, self.head, self.cfg)


def scan_blocks(
    blocks: Block,
    x_BTD: jax.Array,
    remat: str = "none",
    segment_ids_BT: jax.Array | None = None,
    positions_BT: jax.Array | None = None,
) -> jax.Array:
    """Scans stacked `blocks` (a leading dimension of any length) over `x_BTD`, rematerialising
    each block's backward by the named `remat` policy; every block sees the packed batch's
    `segment_ids_BT` and `positions_BT` (or None)."""

    def body(block: Block, x_BTD: jax.Array, seg_BT, pos_BT) -> jax.Array:
        return block(x_BTD, seg_BT, pos_BT)

    if remat != "none":
        body = nnx.remat(body, policy=remat_policies.policy(remat), prevent_cse=False)
    scan = nnx.scan(body, in_axes=(0, nnx.Carry, None, None), out_axes=nnx.Carry)
    return scan(blocks, x_BTD, segment_ids_BT, positions_BT)
