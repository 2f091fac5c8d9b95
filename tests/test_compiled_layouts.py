"""The compiled train step of every preset partitions cleanly: XLA never falls back to
"replicate the whole tensor, then partition it again" (its "Involuntary full
rematerialization" warning), which would move a full copy of an activation or weight.

XLA prints that warning from C++ to stderr; the inspector's compile (`meshtrain.comm.compile`,
the real train step on abstract state) captures it, and the compiles run in a subprocess
whose stderr the test reads. Two models: meshtrain's GPT, and a user's own model written here (an
`mt.Embed` and two linears, as in the getting-started guide), which with a plain `nnx.Embed`
makes XLA print the warning under fsdp+tp and zero1+tp. One process compiles both models'
steps (each start of Python and meshtrain costs seconds), with the persistent compilation
cache off: a program read back from it is not compiled, so XLA would print nothing.
"""

import os
import subprocess
import sys
import textwrap

import pytest

# One worker runs the module-scoped compiles for both tests (under --dist loadgroup).
pytestmark = pytest.mark.xdist_group("compiled_layouts")

LAYOUTS = [
    ("gpt2", "data=8", "dp"),
    ("llama", "fsdp=8", "fsdp"),
    ("llama", "data=8", "zero1"),
    ("gpt2", "data=2,tensor=4", "tp"),
    ("gpt2", "data=2,fsdp=2,tensor=2", "fsdp+tp"),
    ("llama", "data=2,fsdp=2,tensor=2", "fsdp+tp"),
    ("llama", "data=2,fsdp=2,tensor=2", "hsdp+tp"),
]

SCRIPT = textwrap.dedent(
    """
    import sys
    from flax import nnx
    import meshtrain as mt

    mt.simulate_devices(8)
    from meshtrain.comm.compile import compile_step
    from meshtrain.models.base import DataSpec

    TRAIN = mt.TrainConfig(steps=100)  # the schedule these layouts are compiled with

    spec = DataSpec("lm", 16, 32, 256, None)
    for style, mesh_str, strategy in LAYOUTS:
        print(f"LAYOUT gpt {style} {mesh_str} {strategy}", file=sys.stderr, flush=True)
        cfg = mt.GPTConfig(style=style, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)
        mesh = mt.make_mesh(mesh_str)
        rules = mt.rules_for(strategy, mesh)
        model = lambda: cfg.build(rngs=nnx.Rngs(0))
        run = mt.RunSpec(model=model, data=spec, mesh=mesh, rules=rules, train=TRAIN)
        _, info = compile_step(run)
        print(info["stderr"], file=sys.stderr, flush=True)  # XLA's warnings, as captured
    print("DONE", file=sys.stderr, flush=True)
    """
)


# Every data strategy alone, on meshes without a tensor axis, and with +tp on the 2×2×2 mesh.
USER_LAYOUTS = [
    ("data=8", "dp"),
    ("data=2,fsdp=4", "fsdp"),
    ("data=2,fsdp=4", "hsdp"),
    ("data=8", "zero1"),
    ("data=2,fsdp=2,tensor=2", "dp+tp"),
    ("data=2,fsdp=2,tensor=2", "fsdp+tp"),
    ("data=2,fsdp=2,tensor=2", "hsdp+tp"),
    ("data=2,fsdp=2,tensor=2", "zero1+tp"),
]

USER_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    import meshtrain as mt

    mt.simulate_devices(8)
    from meshtrain.comm.compile import compile_step
    from meshtrain.models.base import DataSpec

    TRAIN = mt.TrainConfig(steps=100)  # the schedule these layouts are compiled with


    class TwoLayer(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(0.02)
            named = lambda names: nnx.with_partitioning(init, names, eager_sharding=False)
            self.embed = mt.Embed(256, 64, embedding_init=init, rngs=rngs)
            self.up = nnx.Linear(64, 128, kernel_init=named(("embed", "mlp")), rngs=rngs)
            self.out = nnx.Linear(128, 256, kernel_init=named(("mlp", "vocab")), rngs=rngs)

        def __call__(self, tokens_BT):
            x_BTD = mt.constrain(self.embed(tokens_BT), ("batch", "seq", "embed"))
            return self.out(nnx.relu(self.up(x_BTD))).astype(jnp.float32)


    spec = DataSpec("lm", 16, 16, 256, None)
    for mesh_str, strategy in LAYOUTS:
        print(f"LAYOUT user {mesh_str} {strategy}", file=sys.stderr, flush=True)
        mesh = mt.make_mesh(mesh_str)
        rules = mt.rules_for(strategy, mesh)
        model = lambda: TwoLayer(nnx.Rngs(0))
        run = mt.RunSpec(model=model, data=spec, mesh=mesh, rules=rules, train=TRAIN)
        _, info = compile_step(run)
        print(info["stderr"], file=sys.stderr, flush=True)  # XLA's warnings, as captured
    print("DONE", file=sys.stderr, flush=True)
    """
)


@pytest.fixture(scope="module")
def rematerializations() -> dict[str, list[str]]:
    """Runs SCRIPT on LAYOUTS, then USER_SCRIPT on USER_LAYOUTS, in one fresh process; returns
    XLA's warnings by model ("gpt", "user"), each with its layout."""
    code = f"LAYOUTS = {LAYOUTS!r}\n{SCRIPT}\nLAYOUTS = {USER_LAYOUTS!r}\n{USER_SCRIPT}"
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("DONE") == 2, proc.stderr[-3000:]
    layout, bad = None, {"gpt": [], "user": []}
    seen = {"gpt": 0, "user": 0}
    for line in proc.stderr.splitlines():
        if line.startswith("LAYOUT "):
            layout = line.removeprefix("LAYOUT ")
            seen[layout.split()[0]] += 1
        elif "Involuntary full rematerialization" in line:
            model = layout.split()[0]
            bad[model].append(f"{layout}: {line[line.find('for HLO operation') :][:200]}")
    assert seen == {"gpt": len(LAYOUTS), "user": len(USER_LAYOUTS)}, seen
    return bad


@pytest.mark.slow
def test_no_preset_makes_xla_replicate_a_tensor_to_repartition_it(rematerializations):
    bad = rematerializations["gpt"]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_a_users_model_with_mt_embed_partitions_cleanly_under_every_preset(rematerializations):
    bad = rematerializations["user"]
    assert not bad, "\n".join(bad)
