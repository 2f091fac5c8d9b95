r"""Auxiliary-loss-free balancing on a skewed router: the coefficient of variation of the expert
load, per step, with the bias (γ > 0) and without it (γ = 0); one JSON line.

One MoE block (`meshtrain.models.moe.Experts`) with DeepSeek-V3's router: sigmoid scores, 16
experts in 4 groups, each token in its 2 best groups, top-2. Its router weights are skewed:
the tokens share a mean direction, and a few "hot" experts' weights point along it, so they get
most of the choices. Each step routes a fresh batch of tokens, the block counts the choices,
and `meshtrain.models.moe_balance.settle` moves the bias, as the train step does after each
optimizer step. The router itself is not trained, so only the bias can change the load.

    .venv/bin/python benchmarks/aux_free_balance.py \
        --out benchmarks/results/DATE-cpu-aux-free-balance.jsonl
"""

from __future__ import annotations

import datetime
import platform

import jax
import jax.numpy as jnp
import numpy as np
from _common import emit, logger, parser
from flax import nnx

from meshtrain.models import MoEConfig
from meshtrain.models.moe import Experts
from meshtrain.models.moe_balance import settle

log = logger("aux_free_balance")
B, T, D, E, HOT = 8, 256, 64, 16, 3
CFG = MoEConfig(
    d_model=D,
    n_heads=4,
    n_experts=E,
    top_k=2,
    d_expert=16,
    dispatch="dropless",
    router_scores="sigmoid",
    expert_groups=4,
    groups_per_token=2,
    bias_update_rate=1.0,
)  # fmt: skip  (the rate is passed per run)


def skewed_block(seed: int) -> tuple[Experts, jax.Array]:
    """The block with its router skewed towards `HOT` experts, and the tokens' mean direction."""
    block = Experts(CFG, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    mean_D = rng.standard_normal(D)
    mean_D /= np.linalg.norm(mean_D)
    router_DE = rng.normal(0, 0.05, (D, E))
    router_DE[:, [1, 6, 11][:HOT]] += 0.6 * mean_D[:, None]  # in three different groups
    block.router[...] = jnp.asarray(router_DE, jnp.float32)
    return block, jnp.asarray(mean_D, jnp.float32)


def run(rate: float, steps: int, seed: int = 0) -> list[float]:
    """The load's coefficient of variation at each of `steps` steps (before each update)."""
    block, mean_D = skewed_block(seed)

    @nnx.jit
    def step(block: Experts, key: jax.Array) -> jax.Array:
        x_BTD = mean_D + jax.random.normal(key, (B, T, D))
        block(x_BTD)  # counts the choices into block.load
        return settle(block.bias, block.load, rate)["moe_expert_load_cv"]

    keys = jax.random.split(jax.random.key(seed + 1), steps)
    return [float(step(block, k)) for k in keys]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], steps=400, steps_help="update steps", out=True)
    p.add_argument("--rate", type=float, default=1e-3, help="the bias update rate γ")
    args = p.parse_args(argv)
    with_bias = run(args.rate, args.steps)
    without = run(0.0, args.steps)
    halved = next((i for i, cv in enumerate(with_bias) if cv <= with_bias[0] / 2), None)
    tail = max(1, args.steps // 20)  # the last 5% of the steps, averaged
    record = {
        "benchmark": "aux_free_balance",
        "experts": E,
        "top_k": CFG.top_k,
        "groups": f"{CFG.groups_per_token} of {CFG.expert_groups}",
        "tokens_per_step": B * T,
        "rate": args.rate,
        "steps": args.steps,
        "cv_start": round(with_bias[0], 4),
        "cv_end": round(float(np.mean(with_bias[-tail:])), 4),
        "cv_end_no_bias": round(float(np.mean(without[-tail:])), 4),
        "cv_start_no_bias": round(without[0], 4),
        "first_step_at_half": halved,
        "halved": halved is not None,
        "no_bias_halved": min(without) <= without[0] / 2,
        "device": f"{jax.default_backend()} ({platform.processor() or platform.machine()})",
        "jax": jax.__version__,
        "date": datetime.date.today().isoformat(),
    }
    log(f"cv {record['cv_start']} → {record['cv_end']} with γ={args.rate}; "
        f"{record['cv_end_no_bias']} without")  # fmt: skip
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
