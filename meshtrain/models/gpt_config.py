"""`GPTConfig`: the settings of the decoder in `meshtrain.models.gpt`, with the model
interface's FLOP count, checks and summary line."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
from flax import nnx

from meshtrain import context_parallel, kernels, validate
from meshtrain.layout import Rules, alternatives, axes_of, resolve
from meshtrain.models import layers, mla_config
from meshtrain.models.base import DTYPES, DataSpec
from meshtrain.models.remat import policy_problems
from meshtrain.precision import fp8
from meshtrain.problem import Problem

if TYPE_CHECKING:
    from meshtrain.models.gpt import GPT


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig(validate.Checked):
    """Shape and flavour of the decoder.

    Args:
        style: ``"gpt2"`` or ``"llama"`` (see the module docstring).
        vocab_size: output classes (256 for byte-level text).
        max_seq_len: longest sequence; sizes the learned position table.
        d_model: model width.
        n_layers: transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads; 0 means ``n_heads`` (MHA). Must divide ``n_heads``.
        d_ff: MLP hidden width; 0 means 4·d_model (gpt2) or ⌈8/3·d_model⌉₆₄ (llama).
        rope_theta: RoPE base (llama).
        norm_eps: epsilon of the norms.
        tie_embeddings: reuse the token embedding as the output head.
        remat: rematerialisation policy: none, full, save-dots, save-attention-out,
            offload-dots (matmul outputs to host memory), or a selection of named
            intermediates such as save:attn_out+offload:mlp_hidden (see the Memory guide).
        dtype: compute dtype, ``float32``, ``bfloat16`` or ``float16``. Parameters stay
            float32. A run sets it (and `fp8`) from its precision policy
            (`meshtrain.precision.Precision`).
        fp8: the attention and MLP projections run as fp8 matmuls
            (`meshtrain.precision.fp8.dot_general`); the embedding and head do not.
        attention_impl: attention kernel: xla (jnp), pallas, cudnn (GPU only) or auto (on a GPU
            the one measured fastest for the sequence, packing and layout, else xla). See
            kernels/README.md.
        norm_impl: RMSNorm/LayerNorm kernel: xla (the flax module), pallas or auto (as
            measured).
        rope_scaling: RoPE frequency scaling (llama): ``"none"`` or ``"llama3"`` (Llama 3.1's
            long-context scaling, set by the four ``rope_*`` fields below).
        rope_factor: llama3: the factor low frequencies are divided by.
        rope_low_freq_factor: llama3: wavelengths above original/low_freq_factor are scaled.
        rope_high_freq_factor: llama3: wavelengths below original/high_freq_factor are kept;
            those between are interpolated.
        rope_original_max_seq_len: llama3: the context length of pre-training.
        qkv_bias: biases on the query, key and value projections only (llama style; Qwen2).
        head_dim: width of one attention head; 0 means d_model / n_heads. Set, the heads may
            be wider or narrower than d_model in all (Qwen3-0.6B: d_model 1024, 16 heads of
            128); even for RoPE.
        qk_norm: RMSNorm over each query and key head (one [head_dim] scale each, no bias),
            after the projections and before RoPE (llama style; Qwen3).
        sliding_window: 0, or the keys each query sees: positions (t − window, t] (Mistral).
        vocab_multiple: the embedding and head get ``vocab_size`` rounded up to a multiple of
            this (`padded_vocab`), so the vocabulary splits over ``tensor`` (and matmuls get
            whole tiles): GPT-2's 50257 becomes 50304. The padded ids' logits are masked to
            `layers.PADDED_LOGIT`, so they take no probability, no loss and no gradient, and
            their rows start and stay zero. A setting of the model, never derived from the
            size of ``tensor``, so a checkpoint's shapes do not depend on the layout it was
            trained under. 128 leaves 256, 32000, 128256 and 151936 as they are; 1 turns
            padding off.
        restart_positions: on a packed batch (one with ``positions``), the learned (gpt2) or
            rotary (llama) positions restart at each document's start; False: they run
            0..T−1 along the packed row (attention stays within each document either way).
        attention: ``"mha"`` (multi-head or grouped-query attention) or ``"mla"``
            (DeepSeek-V2/V3's multi-head latent attention, `meshtrain.models.mla`; llama style,
            xla attention path).
        mla_q_rank: mla: rank of the query latent (q_a, norm, q_b); 0: one query projection.
        mla_kv_rank: mla: rank of the key/value latent each token is compressed to.
        mla_nope_dim: mla: per-head query/key dims without RoPE.
        mla_rope_dim: mla: per-head query/key dims with RoPE (one rotary key shared by all
            heads); even. The query/key width is mla_nope_dim + mla_rope_dim.
        mla_v_dim: mla: per-head value width (may differ from the query/key width).
    """

    style: str = "llama"
    vocab_size: int = 256
    max_seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0
    d_ff: int = 0
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    remat: str = "none"
    dtype: str = "float32"
    fp8: bool = False
    attention_impl: str = "xla"
    norm_impl: str = "xla"
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    qkv_bias: bool = False
    head_dim: int = 0
    qk_norm: bool = False
    sliding_window: int = 0
    vocab_multiple: int = 128
    restart_positions: bool = True
    attention: str = "mha"
    mla_q_rank: int = 0
    mla_kv_rank: int = 64
    mla_nope_dim: int = 32
    mla_rope_dim: int = 16
    mla_v_dim: int = 32

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems = v.one_of("gpt.style", self.style, ("gpt2", "llama"), example="llama")
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads"):
            problems += v.positive(
                f"gpt.{name}", getattr(self, name), example=getattr(type(self), name)
            )
        for name in ("n_kv_heads", "d_ff"):
            problems += v.non_negative(f"gpt.{name}", getattr(self, name), note="0 = default")
        problems += v.non_negative("gpt.head_dim", self.head_dim, note="0 = d_model / n_heads")
        problems += v.positive("gpt.vocab_multiple", self.vocab_multiple, note="1: no padding")
        problems += v.non_negative(
            "gpt.sliding_window", self.sliding_window, note="0 = every earlier position is seen"
        )
        problems += v.above("gpt.rope_theta", self.rope_theta, 0, example=10_000.0)
        problems += v.non_negative("gpt.norm_eps", self.norm_eps, integer=False, example=1e-5)
        if problems:  # the shape checks below need whole, positive sizes
            return problems
        if not self.head_dim:  # the heads split d_model
            problems += v.divides("gpt.d_model", self.d_model, self.n_heads, what="n_heads")
        problems += v.require(
            self.n_heads % self.kv_heads == 0,
            "gpt.n_kv_heads",
            self.n_kv_heads,
            f"does not divide n_heads={self.n_heads}; each key/value head must serve a whole "
            "group of query heads",
        )
        if not problems and self.style == "llama" and self.head_dim:
            problems += v.require(
                self.head_dim % 2 == 0,
                "gpt.head_dim",
                self.head_dim,
                f"odd; RoPE rotates pairs of a head's dims, so set --gpt.head-dim to an even "
                f"width such as {self.head_dim + 1}",
            )
        elif not problems and self.style == "llama":
            problems += v.require(
                self.head_width % 2 == 0,
                "gpt.d_model",
                self.d_model,
                f"gives a head width of {self.head_width} (d_model / n_heads), which must be "
                "even for RoPE; change d_model or n_heads, or set --gpt.head-dim",
            )
        problems += policy_problems(self.remat)
        problems += v.one_of("gpt.dtype", self.dtype, DTYPES, example="bfloat16")
        # one field at a time, so each line is filed under its own field
        attn, norm, K = self.attention_impl, self.norm_impl, self.head_width
        problems += v.check("gpt.attention_impl", attn, kernels.check_impls, attn, "xla", K)
        problems += v.check("gpt.norm_impl", norm, kernels.check_impls, "xla", norm, K)
        problems += layers.rope_scaling_problems(
            self.rope_scaling,
            style=self.style,
            rope_factor=self.rope_factor,
            rope_low_freq_factor=self.rope_low_freq_factor,
            rope_high_freq_factor=self.rope_high_freq_factor,
            rope_original_max_seq_len=self.rope_original_max_seq_len,
        )
        problems += v.require(
            not (self.qk_norm and self.style == "gpt2"),
            "gpt.qk_norm",
            self.qk_norm,
            "the query/key RMSNorm is for style='llama' (Qwen3); leave it False for gpt2",
        )
        problems += mla_config.problems(self)
        return problems + v.require(
            not (self.qkv_bias and self.style == "gpt2"),
            "gpt.qkv_bias",
            self.qkv_bias,
            "style 'gpt2' already biases every projection; qkv_bias is for style='llama' "
            "(leave it False for gpt2)",
        )

    @property
    def kv_heads(self) -> int:
        """Key/value heads after defaults."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        """Width of one attention head after defaults (``head_dim``, else d_model / n_heads)."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        """MLP hidden width after defaults."""
        if self.d_ff:
            return self.d_ff
        if self.style == "gpt2":
            return 4 * self.d_model
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and head: ``vocab_size`` up to a multiple of ``vocab_multiple``."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def compute_dtype(self):
        """The jnp dtype matmuls run in."""
        return DTYPES[self.dtype]

    @property
    def dot_general(self):
        """The ``dot_general`` of the dense projections: fp8's, or jax's."""
        return fp8.dot_general if self.fp8 else jax.lax.dot_general

    def attention_params(self) -> int:
        """Matmul parameters of one block's attention projections (mha or mla)."""
        return mla_config.attention_params(self)

    def attention_widths(self) -> tuple[int, int]:
        """Per-head widths of the attention scores (q·k) and of the weighted sum (p·v)."""
        return mla_config.attention_widths(self)

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (all but embeddings and norms)."""
        D, F = self.d_model, self.ff_dim
        attn = self.attention_params()
        mlp = (3 if self.style == "llama" else 2) * D * F
        return self.n_layers * (attn + mlp) + D * self.padded_vocab

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward).

        ``6·N`` for the N matmul parameters (2 forward, 4 backward) plus ``12·L·H·K·T`` for the
        attention scores and weighted sum at sequence length T (latent attention:
        ``6·L·H·(E + V)·T``, scores over the query/key width E, the sum over the value width
        V). Masked (causal) positions are counted too, as in the PaLM paper's MFU definition,
        and so is the padded vocabulary (`padded_vocab`): the head's matmul runs over it, as
        Megatron-LM and nanoGPT count it.
        With a sliding window W < T each query is counted against W keys instead of T (the
        band a windowed kernel computes); biases are not matmul parameters.
        """
        keys = min(seq_len, self.sliding_window) if self.sliding_window else seq_len
        scores, values = self.attention_widths()
        attention = 6 * self.n_layers * self.n_heads * (scores + values) * keys
        return 6 * self.matmul_params() + attention

    # --- the model interface (meshtrain.models.base.ModelConfig) ---------------------------

    def build(self, *, rngs: nnx.Rngs) -> GPT:
        """The decoder, unsharded."""
        from meshtrain.models.gpt import GPT

        return GPT(self, rngs=rngs)

    def check(self, data: DataSpec) -> list[Problem]:
        """Token data whose sequences and vocabulary fit this model."""
        if data.kind != "lm":
            return [
                Problem(
                    "model",
                    "gpt",
                    f"a gpt needs token data ([N, T] token ids), but the data is {data.kind!r}; "
                    "use --data.source stdlib, synthetic or text, or arrays of token ids",
                )
            ]
        problems = []
        if data.seq_len > self.max_seq_len:
            problems.append(
                Problem(
                    "data.seq_len",
                    data.seq_len,
                    f"exceeds the model's max_seq_len={self.max_seq_len}; lower "
                    f"--data.seq-len to {self.max_seq_len} or raise --gpt.max-seq-len to "
                    f"{data.seq_len}",
                )
            )
        if data.vocab_size > self.vocab_size:
            problems.append(
                Problem(
                    "gpt.vocab_size",
                    self.vocab_size,
                    f"the data has {data.vocab_size} token ids; raise --gpt.vocab-size to at "
                    f"least {data.vocab_size}",
                )
            )
        return problems  # cuDNN attention on packed batches: meshtrain.composition

    def check_layout(self, sizes: Mapping[str, int], rules: Rules) -> list[Problem]:
        """A padded vocabulary that the rules' ``vocab`` split does not divide, with the
        ``vocab_multiple`` that fixes it (`sizes`: axis name → size); heads that Ulysses
        context parallelism cannot split over ``seq``."""
        algorithm = getattr(rules, "context_parallel", context_parallel.DEFAULT)
        heads = context_parallel.heads_problems(sizes, algorithm, self.n_heads)
        if heads:
            return heads
        for table in (rules.params, rules.activations):
            if table.get("vocab") is None:
                continue
            try:
                resolve(("vocab",), table, sizes, shape=(self.padded_vocab,))
            except ValueError:
                axes = [a for a in axes_of(alternatives(table["vocab"])[0]) if sizes.get(a, 1) > 1]
                ways = math.prod(sizes[a] for a in axes)
                fix = math.lcm(self.vocab_multiple, ways)
                padded = dataclasses.replace(self, vocab_multiple=fix).padded_vocab
                split = " × ".join(f"{a}={sizes[a]}" for a in axes)
                return [
                    Problem(
                        "gpt.vocab_multiple",
                        self.vocab_multiple,
                        f"the vocabulary of {self.vocab_size} padded to {self.padded_vocab} "
                        f"ids does not split over {split}; set --gpt.vocab-multiple {fix} "
                        f"(pads it to {padded})",
                    )
                ]
        return []

    def describe(self) -> str:
        """E.g. ``gpt llama · d_model=128 · 4 layers · 4 heads (2 kv)``."""
        kv = f" ({self.kv_heads} kv)" if self.kv_heads != self.n_heads else ""
        if self.attention == "mla":
            kv = f" (latent attention, kv rank {self.mla_kv_rank})"
        vocab = ""
        if self.padded_vocab != self.vocab_size:
            vocab = f" · vocab {self.vocab_size} padded to {self.padded_vocab}"
        return (
            f"gpt {self.style} · d_model={self.d_model} · {self.n_layers} layers · "
            f"{self.n_heads} heads{kv}{vocab}"
        )

    @property
    def pipeline_layers(self) -> int:
        """Stacked layers a pipeline cuts into stages."""
        return self.n_layers
