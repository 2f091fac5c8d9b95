"""`MoEConfig`: a Llama-style decoder whose feed-forward blocks are mixtures of experts (all of
them, or every n-th), with the model interface's FLOP count, checks and summary line."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
from flax import nnx

from meshtrain import validate
from meshtrain.kernels import grouped_matmul as gmm
from meshtrain.kernels._common import on_gpu
from meshtrain.layout import EXPERT, Rules
from meshtrain.models.base import DataSpec
from meshtrain.models.gpt_config import GPTConfig
from meshtrain.models.moe_dispatch import DISPATCH, exchange_impl
from meshtrain.models.moe_routing import ROUTER_LOSSES, ROUTER_SCORES, Choice, capacity
from meshtrain.problem import Problem, RunCheckError

if TYPE_CHECKING:
    from meshtrain.models.moe import MoE


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(validate.Checked):
    """Shape of the mixture-of-experts decoder (attention, norms and embeddings as
    `GPTConfig` with ``style="llama"``; each MoE block's feed-forward is a router and
    ``n_experts`` SwiGLU experts, of which each token uses ``top_k``).

    Args:
        vocab_size, max_seq_len, d_model, n_layers, n_heads, n_kv_heads, rope_theta, norm_eps,
            tie_embeddings, remat, dtype, fp8, attention_impl, sliding_window, attention,
            mla_q_rank, mla_kv_rank, mla_nope_dim, mla_rope_dim, mla_v_dim, vocab_multiple,
            head_dim, qk_norm: as in `GPTConfig`; with fp8 the experts' products are fp8 too
            (`meshtrain.precision.fp8.matmul`).
        d_ff: hidden width of the dense feed-forward blocks (0: Llama's default).
        n_experts: experts per MoE block.
        top_k: experts each token is sent to (1 or 2, or any ≤ ``n_experts``).
        d_expert: hidden width of one expert (0: ``d_ff`` after its default).
        moe_every: every n-th block is an MoE block (1: all of them); must divide n_layers.
        shared_expert: hidden width of a dense expert every token also goes through
            (DeepSeek style); 0 for none.
        dispatch: ``"capacity"`` (GShard buffers, overflow dropped) or ``"dropless"``
            (grouped matmuls, nothing dropped).
        grouped_impl: dropless dispatch's grouped matmul: ``"tiled"`` (at active cost on every
            backend), ``"xla"`` (`jax.lax.ragged_dot`, a dense product on CPU) or ``"auto"``
            (the faster one measured on the backend).
        capacity_factor: capacity dispatch: slots per expert and sequence are
            ⌈factor · T · top_k / n_experts⌉.
        renormalize: divide the top-k probabilities by their sum (Mixtral); with top_k=1 this
            makes every weight 1, so Switch-style k=1 routers set it False.
        aux_loss_coef: weight of the load-balancing loss.
        z_loss_coef: weight of the router z-loss (summed over MoE blocks).
        router_losses: the load-balancing loss's definition: ``"meshtrain"`` (Switch's loss
            per MoE block over every token, summed over the blocks) or ``"mixtral"``
            (transformers' ``MixtralForCausalLM``: one loss over every block's real tokens
            pooled, padding left out; what an imported Mixtral trains with).
        router_scores: ``"softmax"`` over the experts (Mixtral) or ``"sigmoid"`` per expert
            (DeepSeek-V3); the balancing losses then read the sigmoid scores normalised over
            the experts.
        routed_scale: factor on the routed experts' weights after any renormalising
            (DeepSeek-V3's ``routed_scaling_factor``).
        expert_groups: equal groups the experts are cut into (``n_group``); a group is scored
            by the sum of its two best (biased) scores.
        groups_per_token: groups each token chooses its top-k experts within (``topk_group``).
        bias_update_rate: auxiliary-loss-free balancing's step γ: each MoE block keeps a bias
            per expert, added to the scores for the top-k choice only, and after every
            optimizer step ``b_e ← b_e + γ · sign(mean load − load_e)`` over the step's whole
            batch (`meshtrain.models.moe_balance`); 0: no bias.
    """

    vocab_size: int = 256
    max_seq_len: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0
    d_ff: int = 0
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 0
    moe_every: int = 1
    shared_expert: int = 0
    dispatch: str = "capacity"
    grouped_impl: str = "auto"
    capacity_factor: float = 1.25
    renormalize: bool = True
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    router_losses: str = "meshtrain"
    router_scores: str = "softmax"
    routed_scale: float = 1.0
    expert_groups: int = 1
    groups_per_token: int = 1
    bias_update_rate: float = 0.0
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    remat: str = "none"
    dtype: str = "float32"
    fp8: bool = False
    attention_impl: str = "xla"
    sliding_window: int = 0
    attention: str = "mha"
    mla_q_rank: int = 0
    mla_kv_rank: int = 64
    mla_nope_dim: int = 32
    mla_rope_dim: int = 16
    mla_v_dim: int = 32
    vocab_multiple: int = 128
    head_dim: int = 0
    qk_norm: bool = False

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems: list[Problem] = []
        try:
            self.backbone  # noqa: B018  (validates the shared fields)
        except RunCheckError as e:
            problems = [
                dataclasses.replace(
                    p, field=p.field.replace("gpt.", "moe.", 1), message=_moe(p.message)
                )
                for p in e.problems
            ]
        for name in ("n_experts", "top_k", "moe_every"):
            problems += v.positive(
                f"moe.{name}", getattr(self, name), example=getattr(type(self), name)
            )
        for name in ("d_expert", "shared_expert"):
            problems += v.non_negative(
                f"moe.{name}", getattr(self, name), note="0: none or default"
            )
        if problems:  # the checks below compare whole, positive sizes
            return problems
        problems += v.require(
            self.top_k <= self.n_experts,
            "moe.top_k",
            self.top_k,
            f"more than n_experts={self.n_experts}; set top_k to at most {self.n_experts}",
        )
        problems += v.require(
            self.n_layers % self.moe_every == 0,
            "moe.moe_every",
            self.moe_every,
            f"does not divide n_layers={self.n_layers}; pick a divisor (every moe_every-th "
            "block is an MoE block)",
        )
        problems += v.one_of("moe.dispatch", self.dispatch, DISPATCH, example="dropless")
        problems += v.one_of("moe.grouped_impl", self.grouped_impl, gmm.IMPLS, example="auto")
        problems += v.above(
            "moe.capacity_factor",
            self.capacity_factor,
            0,
            example=1.25,
            note="1.0 is an even share; 1.25 leaves headroom; or use --moe.dispatch dropless",
        )
        for name in ("aux_loss_coef", "z_loss_coef"):
            problems += v.non_negative(f"moe.{name}", getattr(self, name), integer=False)
        problems += v.one_of(
            "moe.router_losses",
            self.router_losses,
            ROUTER_LOSSES,
            example="mixtral",
            note="meshtrain: per MoE block; mixtral: pooled over the blocks, as transformers'",
        )
        return problems + self._routing_problems()

    def _routing_problems(self) -> list[Problem]:
        """What is wrong with the router's choice: scores, expert groups, scale and bias."""
        v = validate
        problems = v.one_of(
            "moe.router_scores",
            self.router_scores,
            ROUTER_SCORES,
            example="sigmoid",
            note="softmax: Mixtral; sigmoid: DeepSeek-V3",
        )
        problems += v.above("moe.routed_scale", self.routed_scale, 0, example=2.5)
        problems += v.non_negative("moe.bias_update_rate", self.bias_update_rate, integer=False)
        for name in ("expert_groups", "groups_per_token"):
            problems += v.positive(f"moe.{name}", getattr(self, name), example=1)
        if problems:
            return problems
        groups, chosen = self.expert_groups, self.groups_per_token
        problems += v.require(
            self.n_experts % groups == 0,
            "moe.expert_groups",
            groups,
            f"does not divide n_experts={self.n_experts}; pick a divisor (the experts are cut "
            "into equal groups)",
        )
        problems += v.require(
            chosen <= groups,
            "moe.groups_per_token",
            chosen,
            f"more than expert_groups={groups}; set groups_per_token to at most {groups}",
        )
        if problems:
            return problems
        per_group = self.n_experts // groups
        problems += v.require(
            self.top_k <= chosen * per_group,
            "moe.top_k",
            self.top_k,
            f"more than the {chosen * per_group} experts in a token's {chosen} group(s) of "
            f"{per_group}; raise --moe.groups-per-token or lower --moe.top-k",
        )
        return problems

    @property
    def choice(self) -> Choice:
        """How the router chooses (`meshtrain.models.moe_routing.Choice`)."""
        return Choice(
            self.router_scores, self.expert_groups, self.groups_per_token, self.routed_scale
        )

    @property
    def backbone(self) -> GPTConfig:
        """The attention, norm and embedding settings as a Llama-style `GPTConfig`."""
        shared = {name: getattr(self, name) for name in _BACKBONE_FIELDS}
        return GPTConfig(style="llama", **shared)

    def experts_precision(self, compute: str, fp8: bool = False) -> str:
        """The run summary's part for the experts under compute dtype `compute`: on CPU they
        compute in float32 whatever the policy (`meshtrain.models.moe`: XLA's CPU compiler
        aborts on the bfloat16 dispatch's backward)."""
        products = ", fp8 products" if fp8 else ""
        if compute != "float32" and jax.default_backend() == "cpu":
            why = "XLA's CPU compiler aborts on the bfloat16 dispatch's backward"
            return f"experts float32{products} (on CPU, not {compute}: {why})"
        return f"experts {compute}{products}"

    @property
    def expert_dim(self) -> int:
        """One expert's hidden width after defaults."""
        return self.d_expert or self.backbone.ff_dim

    @property
    def n_moe_layers(self) -> int:
        """How many blocks are MoE blocks."""
        return self.n_layers // self.moe_every

    def capacity_slots(self, seq_len: int) -> int:
        """Capacity dispatch: slots per expert and sequence of `seq_len` tokens."""
        return capacity(seq_len, self.n_experts, self.top_k, self.capacity_factor)

    def matmul_params(self, *, active: bool = True) -> int:
        """Matmul parameters per token: the experts a token uses (``active``) or all of them."""
        g = self.backbone
        D = g.d_model
        attn = g.attention_params()
        experts = self.top_k if active else self.n_experts
        moe = 3 * D * self.expert_dim * experts + D * self.n_experts + 3 * D * self.shared_expert
        dense = 3 * D * g.ff_dim
        n_moe = self.n_moe_layers
        return (
            self.n_layers * attn + n_moe * moe + (self.n_layers - n_moe) * dense
        ) + D * g.padded_vocab

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6·N_active`` plus attention, as `GPTConfig` counts."""
        g = self.backbone
        keys = min(seq_len, self.sliding_window) if self.sliding_window else seq_len
        scores, values = g.attention_widths()
        return 6 * self.matmul_params() + 6 * self.n_layers * g.n_heads * (scores + values) * keys

    # --- the model interface (meshtrain.models.base.ModelConfig) ---------------------------

    def build(self, *, rngs: nnx.Rngs) -> MoE:
        """The decoder, unsharded."""
        from meshtrain.models.moe import MoE

        return MoE(self, rngs=rngs)

    def check(self, data: DataSpec) -> list[Problem]:
        """Token data whose sequences and vocabulary fit this model."""
        return [
            dataclasses.replace(p, field=p.field.replace("gpt.", "moe."), message=_moe(p.message))
            for p in self.backbone.check(data)
        ]

    def check_layout(self, sizes: Mapping[str, int], rules: Rules) -> list[Problem]:
        """Experts that the ``expert`` axis cannot split, and the padded vocabulary's split."""
        problems = [
            dataclasses.replace(p, field=p.field.replace("gpt.", "moe."), message=_moe(p.message))
            for p in self.backbone.check_layout(sizes, rules)
        ]
        shards = sizes.get(EXPERT, 1)
        if shards > self.n_experts:
            problems.append(
                Problem(
                    "moe.n_experts",
                    self.n_experts,
                    f"fewer experts than the {shards} shards of the expert axis; raise "
                    f"--moe.n-experts to a multiple of {shards} or set expert to a divisor of "
                    f"{self.n_experts}",
                )
            )
        elif self.n_experts % shards:
            problems.append(
                Problem(
                    "moe.n_experts",
                    self.n_experts,
                    f"not divisible by the expert axis of size {shards}; use a multiple of "
                    f"{shards} experts or an expert axis that divides {self.n_experts}",
                )
            )
        return problems

    def describe(self) -> str:
        """E.g. ``moe · d_model=64 · 2 layers (2 MoE) · 8 experts, top-2, capacity 1.25``."""
        how = f"capacity {self.capacity_factor:g}"
        if self.dispatch == "dropless":
            impl = self.grouped_impl
            if impl == "auto":  # off a GPU the tiled loop; on one, by the table per call
                impl = gmm.auto_impl() if not on_gpu() else "measured-fastest"
            how = f"dropless ({impl} grouped matmul, {exchange_impl()} exchange)"
        shared = f" + shared {self.shared_expert}" if self.shared_expert else ""
        losses = "" if self.router_losses == "meshtrain" else f", {self.router_losses} losses"
        return (
            f"moe · d_model={self.d_model} · {self.n_layers} layers ({self.n_moe_layers} MoE) · "
            f"{self.n_experts} experts{shared}, top-{self.top_k}{self._choice_words()}, "
            f"{how}{losses}"
        )

    def _choice_words(self) -> str:
        """The summary's words for a router other than Mixtral's, e.g. ``, sigmoid scores,
        top-2 of 4 groups, scale 2.5, bias γ=0.001``."""
        words = [] if self.router_scores == "softmax" else [f"{self.router_scores} scores"]
        if self.expert_groups > 1:
            words.append(f"top-{self.groups_per_token} of {self.expert_groups} groups")
        if self.routed_scale != 1.0:
            words.append(f"scale {self.routed_scale:g}")
        if self.bias_update_rate:
            words.append(f"bias γ={self.bias_update_rate:g}")
        return "".join(f", {w}" for w in words)

    @property
    def pipeline_layers(self) -> int:
        """Stacked layers a pipeline cuts into stages: the groups (``moe_every`` blocks each)."""
        return self.n_moe_layers

    @property
    def supported_axes(self) -> tuple[str, ...]:
        """Axes beyond the defaults that this model runs (the run check reads it)."""
        return (EXPERT,)


_BACKBONE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(MoEConfig)
    if f.name in {g.name for g in dataclasses.fields(GPTConfig)}
)  # the fields an MoE shares with the dense decoder: vocab_size … qk_norm


def _moe(fix: str) -> str:
    """A `GPTConfig` fix, reworded for the moe flags."""
    return fix.replace("--gpt.", "--moe.")


PRESETS: dict[str, MoEConfig] = {
    # A CPU-sized model for tests, notebooks and `meshtrain train --model moe`.
    "moe-tiny": MoEConfig(),
    # Mixtral-8x7B's shape (for planning and memory estimates; ~46.7B parameters, 12.9B active).
    "mixtral-8x7b": MoEConfig(
        vocab_size=32000,
        max_seq_len=32768,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        n_experts=8,
        top_k=2,
        d_expert=14336,
        rope_theta=1e6,
        dtype="bfloat16",
        dispatch="dropless",
    ),
    # Qwen3-30B-A3B's shape (~30.5B parameters, 3.3B active): 128 experts of width 768, top-8
    # renormalised, heads of 128 with query/key norms.
    "qwen3-30b-a3b": MoEConfig(
        vocab_size=151936,
        max_seq_len=32768,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        qk_norm=True,
        n_experts=128,
        top_k=8,
        d_expert=768,
        rope_theta=1e6,
        norm_eps=1e-6,
        dtype="bfloat16",
        dispatch="dropless",
    ),
    # DeepSeek-V3's shape with every layer an MoE layer (its first 3 are dense): latent
    # attention (query rank 1536, key/value rank 512, nope 128 + rope 64, values 128), 256
    # routed experts of width 2048 in 8 groups (4 per token), top-8 sigmoid routing scaled 2.5,
    # one shared expert, the balancing bias; yarn RoPE left out (703B matmul parameters, 36.6B
    # active; DeepSeek-V3 itself: 671B, 37B active).
    "deepseek-v3-like": MoEConfig(
        vocab_size=129280,
        max_seq_len=4096,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        attention="mla",
        mla_q_rank=1536,
        mla_kv_rank=512,
        mla_nope_dim=128,
        mla_rope_dim=64,
        mla_v_dim=128,
        d_ff=18432,
        n_experts=256,
        top_k=8,
        d_expert=2048,
        shared_expert=2048,
        router_scores="sigmoid",
        expert_groups=8,
        groups_per_token=4,
        routed_scale=2.5,
        bias_update_rate=0.001,
        aux_loss_coef=0.0,
        norm_eps=1e-6,
        dtype="bfloat16",
        dispatch="dropless",
    ),
}


def preset(name: str) -> MoEConfig:
    """An MoE preset by name (``moe-tiny``, ``mixtral-8x7b``, ``qwen3-30b-a3b``,
    ``deepseek-v3-like``)."""
    if name not in PRESETS:
        raise ValueError(f"moe preset {name!r}: unknown; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
