"""Overhead of meshtrain's train step over a hand-written `jax.jit` + optax step.

For one GPT and one mesh this script builds

- the meshtrain step: `init_train_state` + `jit_train_step` (activation constraints, in/out
  shardings, donated state, loss and grad-norm metrics);
- ``baseline``: what a user would write by hand. ``nnx.split`` to a plain params pytree, params
  and optimizer state placed with the *same* `NamedSharding`s as meshtrain's, and a ~15-line
  ``jax.jit(step, donate_argnums=0)`` doing ``value_and_grad`` of cross-entropy, ``tx.update``
  and ``apply_updates``; no activation constraints;
- ``baseline_constrained``: the same hand-written step traced inside
  ``meshtrain.layout.activation_rules``, so the model's activation constraints apply. It
  separates the cost of the step wrapper (what meshtrain adds) from the effect of the layout
  (what the constraints change).

All three use the same optax transformation (`make_optimizer`), the same initial parameters and
the same batch arrays. After compiling and warming up, each round runs meshtrain (A), baseline
(B) and baseline_constrained (C) once each, in the order ABC, CBA, ABC, ... so that A and C
follow B equally often (B is the slow one and can slow the step after it); every step is timed to
`jax.block_until_ready`. The medians, their ratios, and the medians of the per-round ratios
are reported.

It also times ``step.lower(state, batch).compile()`` of the meshtrain step at depth 4 and depth
32 (same width): the blocks are scanned, so the depth should barely change the compile time.

Prints exactly one JSON line on stdout; progress and XLA's warnings go to stderr.

    python benchmarks/overhead.py             # defaults: about 75 s on a 2-core CPU
    python benchmarks/overhead.py --quick     # tiny sizes, few rounds (the smoke test)

On simulated CPU devices absolute times mean little; only the ratios taken in one run do.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from _common import emit, logger, parser, simulate_cpu_devices

COMPILE_DEPTHS = (4, 32)
CONTENDERS = ("meshtrain", "baseline", "baseline_constrained")


log = logger("overhead")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(
        "meshtrain train-step overhead vs jax.jit + optax",
        quick="tiny sizes and few rounds (smoke test)",
        devices=8,
    )
    p.add_argument("--mesh", default="data=2,fsdp=2,tensor=2", help="mesh axis sizes")
    p.add_argument("--strategy", default="fsdp+tp", help="sharding strategy preset")
    p.add_argument("--style", default="llama", choices=("llama", "gpt2"), help="GPT flavour")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=4, help="blocks of the timed model")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per example")
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (one step of each)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each after compiling")
    p.add_argument(
        "--compile-reps", type=int, default=2, help="compiles per depth; the fastest is reported"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the parameters and the batch")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.seq_len, args.batch = 64, 4, 32, 8
        args.rounds, args.warmup, args.compile_reps = 5, 1, 1
    if args.rounds < 1 or args.compile_reps < 1 or args.warmup < 0:
        p.error("--rounds and --compile-reps must be ≥ 1, --warmup ≥ 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    simulate_cpu_devices(args.devices)

    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshtrain import layout as S
    from meshtrain.comm.hlo import collectives
    from meshtrain.layout import batch_shardings
    from meshtrain.lower import RunSpec, init_train_state, jit_train_step, make_optimizer
    from meshtrain.mesh import describe, make_mesh
    from meshtrain.models import GPTConfig, build_model
    from meshtrain.train import OptimConfig

    # A compile-time benchmark must not read compiled programs back from a disk cache.
    jax.config.update("jax_enable_compilation_cache", False)

    mesh = make_mesh(args.mesh)
    rules = S.rules_for(args.strategy, mesh)
    cfg = GPTConfig(
        style=args.style,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq_len,
    )
    tx = make_optimizer(OptimConfig(), total_steps=1000)
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.seq_len + 1), dtype=np.int32)
    batch_np = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    batch = S.shard_batch(batch_np, mesh, rules)  # one set of arrays, read by every step
    batch_sh = batch_shardings(batch_np, mesh, rules)
    device = jax.devices()[0]
    log(f"mesh {describe(mesh)} · strategy {args.strategy} · {cfg}")

    def ctor_for(depth):
        c = dataclasses.replace(cfg, n_layers=depth)
        return lambda: build_model(c, seed=args.seed)

    # --- the meshtrain state (created for real) ---------------------------------------
    gd, mt_state, sh = init_train_state(ctor_for(cfg.n_layers), tx, mesh, rules)
    n_params = sum(int(x.size) for x in jax.tree.leaves(mt_state.params))

    # --- compile time of the meshtrain step at two depths ------------------------------
    # Every compile gets a freshly built jitted step (nothing comes from jax's in-memory
    # caches) and is lowered from shape-and-sharding structs, so a depth other than --layers is
    # never created: its state comes from `jax.eval_shape`. The last step compiled at --layers
    # becomes the timed one (calling it reuses its executable).
    def spec_of(x, sharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def abstract_for(depth):
        """(graphdef, state as shape-and-sharding structs, shardings); nothing allocated."""
        box = {}

        def init():
            box["gd"], state, box["sh"] = init_train_state(ctor_for(depth), tx, mesh, rules)
            return state

        state_shapes = jax.eval_shape(init)
        return box["gd"], jax.tree.map(spec_of, state_shapes, box["sh"]), box["sh"]

    abstract = {d: abstract_for(d) for d in COMPILE_DEPTHS if d != cfg.n_layers}
    abstract[cfg.n_layers] = (gd, jax.tree.map(spec_of, mt_state, sh), sh)
    abstract_batch = {k: spec_of(v, v.sharding) for k, v in batch.items()}

    compile_s = {d: [] for d in COMPILE_DEPTHS}
    lower_s = {d: [] for d in COMPILE_DEPTHS}
    mt_step = None
    for rep in range(args.compile_reps):
        for depth in COMPILE_DEPTHS:
            gd_d, state_d, sh_d = abstract[depth]
            fn = jit_train_step(RunSpec(mesh=mesh, rules=rules), gd_d, tx, sh_d, batch_sh)
            t0 = time.perf_counter()
            lowered = fn.lower(state_d, abstract_batch)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            lower_s[depth].append(t1 - t0)
            compile_s[depth].append(t2 - t0)
            log(
                f"compile {rep + 1}/{args.compile_reps} depth {depth}: lower {t1 - t0:.2f} s, "
                f"lower+compile {t2 - t0:.2f} s"
            )
            if depth == cfg.n_layers:
                mt_step = fn
    if mt_step is None:  # --layers is neither compile depth
        mt_step = jit_train_step(RunSpec(mesh=mesh, rules=rules), gd, tx, sh, batch_sh)

    def meshtrain_step(state, batch):
        state, metrics = mt_step(state, batch)
        return state, metrics["loss"]

    # --- hand-written baseline: no meshtrain train code ----------------------------------
    graphdef, param_vars, rest_vars = nnx.split(build_model(cfg, seed=args.seed), nnx.Param, ...)
    rest = nnx.to_pure_dict(rest_vars)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params, rest)(batch["inputs"]).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return losses.mean()

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def constrained_step(state, batch):
        with S.activation_rules(mesh, rules):  # constraints are read while tracing
            return step(state, batch)

    # Params and optimizer state get meshtrain's layout, and out_shardings keeps them in it,
    # so every step of every contender runs on the same parameter layout.
    state_sh = (sh.params, sh.opt_state)
    out_sh = (state_sh, NamedSharding(mesh, P()))

    def baseline_state():
        params = jax.device_put(nnx.to_pure_dict(param_vars), sh.params)
        return params, jax.device_put(tx.init(params), sh.opt_state)

    fns = {
        "meshtrain": meshtrain_step,
        "baseline": jax.jit(step, donate_argnums=0, out_shardings=out_sh),
        "baseline_constrained": jax.jit(constrained_step, donate_argnums=0, out_shardings=out_sh),
    }
    states = {"meshtrain": mt_state, "baseline": baseline_state()}
    states["baseline_constrained"] = baseline_state()

    # --- first call (compiles the baselines), same-math check, warm-up ----------------------
    def run(name):
        t0 = time.perf_counter()
        states[name], loss = fns[name](states[name], batch)
        jax.block_until_ready((states[name], loss))
        return time.perf_counter() - t0, loss

    first_loss = {}
    for name in CONTENDERS:
        dt, loss = run(name)
        first_loss[name] = float(loss)
        log(f"first call {name}: {dt:.2f} s (compile + step), loss {first_loss[name]:.6f}")
    same_layout = all(
        a.sharding.is_equivalent_to(b.sharding, a.ndim)
        for name in CONTENDERS[1:]
        for a, b in zip(
            jax.tree.leaves((states["meshtrain"].params, states["meshtrain"].opt_state)),
            jax.tree.leaves(states[name]),
            strict=True,
        )
    )

    ops = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    lowerable = {"meshtrain": mt_step, **{k: fns[k] for k in CONTENDERS[1:]}}
    hlo_collectives = {}
    for name, fn in lowerable.items():  # already compiled: these hit jax's caches
        found = collectives(fn.lower(states[name], batch).compile().as_text())
        hlo_collectives[name] = {op: sum(c.kind == op for c in found) for op in ops}
    log(f"collectives in the compiled programs: {hlo_collectives}")

    for _ in range(args.warmup):
        for name in CONTENDERS:
            run(name)

    # --- timed rounds: A B C, C B A, A B C, ... ------------------------------------------
    times = {name: [] for name in CONTENDERS}
    for i in range(args.rounds):
        # ABC, CBA, ABC, ...: in the stream (ABCCBAABC...) A and C each follow B equally often
        # and each follows itself once, so the slow step of one contender does not land on the
        # step after it more for one than for another (a plain rotation ABC, BCA, CAB did).
        for name in CONTENDERS if i % 2 == 0 else CONTENDERS[::-1]:
            times[name].append(run(name)[0])
        if (i + 1) % 10 == 0 or i + 1 == args.rounds:
            last = ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in CONTENDERS)
            log(f"round {i + 1}/{args.rounds}: {last}")

    ms = {n: round(statistics.median(times[n]) * 1e3, 4) for n in CONTENDERS}

    def median_round_ratio(other):
        return round(
            statistics.median(a / b for a, b in zip(times["meshtrain"], times[other], strict=True)),
            4,
        )

    c4, c32 = (round(min(compile_s[d]), 4) for d in COMPILE_DEPTHS)
    return {
        "benchmark": "overhead",
        "platform": device.platform,
        "device_kind": device.device_kind,
        "n_devices": jax.device_count(),
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "optax_version": optax.__version__,
        "mesh": describe(mesh),
        "strategy": args.strategy,
        "model": {
            "style": cfg.style,
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "vocab_size": cfg.vocab_size,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "params": n_params,
        },
        "optimizer": "make_optimizer(OptimConfig()) for all: clip_by_global_norm + adamw",
        "baseline": "jax.jit + optax, same param shardings",
        "baseline_detail": (
            "jax.jit(step, donate_argnums=0, out_shardings=the same params/optimizer-state "
            "NamedShardings as meshtrain); value_and_grad of cross-entropy, tx.update, "
            "apply_updates; no activation constraints; returns only the loss"
        ),
        "baseline_constrained_detail": (
            "the same hand-written step traced inside meshtrain.layout.activation_rules, so "
            "the model's activation constraints apply"
        ),
        "same_state_layout": same_layout,
        "first_loss": first_loss,
        "rounds": args.rounds,
        "warmup_steps": args.warmup,
        "meshtrain_step_ms": ms["meshtrain"],
        "baseline_step_ms": ms["baseline"],
        "baseline_constrained_step_ms": ms["baseline_constrained"],
        "overhead_ratio": round(ms["meshtrain"] / ms["baseline"], 4),
        "median_round_ratio": median_round_ratio("baseline"),
        "overhead_ratio_vs_constrained": round(ms["meshtrain"] / ms["baseline_constrained"], 4),
        "median_round_ratio_vs_constrained": median_round_ratio("baseline_constrained"),
        "step_ms_min": {n: round(min(times[n]) * 1e3, 4) for n in CONTENDERS},
        "hlo_collectives": hlo_collectives,
        "compile_s_depth4": c4,
        "compile_s_depth32": c32,
        "compile_ratio_32_over_4": round(c32 / c4, 4),
        "compile_reps": args.compile_reps,
        "compile_s_all": {str(d): [round(t, 3) for t in compile_s[d]] for d in COMPILE_DEPTHS},
        "lower_s_min": {str(d): round(min(lower_s[d]), 4) for d in COMPILE_DEPTHS},
        "compile_what": (
            "fastest wall time of step.lower(state, batch).compile() of a freshly built "
            "meshtrain step, over compile_reps"
        ),
        "note": (
            "on simulated CPU devices absolute times are not speed-ups (all devices share the "
            "host's cores); only the ratios taken within one run are meaningful"
            if device.platform == "cpu"
            else "ratios taken within one run; absolute times depend on the device"
        ),
    }


if __name__ == "__main__":
    start = time.perf_counter()
    result = main()
    log(f"wall time {time.perf_counter() - start:.1f} s")
    emit(result)
