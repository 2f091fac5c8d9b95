"""The compiled train step of every preset partitions cleanly: XLA never falls back to
"replicate the whole tensor, then partition it again" (its "Involuntary full
rematerialization" warning), which would move a full copy of an activation or weight.

XLA prints that warning from C++ to stderr, so the compiles run in a subprocess whose stderr
the test reads.
"""

import subprocess
import sys
import textwrap

import pytest

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
    import numpy as np
    import meshtrain as mt

    mt.simulate_devices(8)
    from meshtrain.layout import batch_shardings

    tx = mt.lower.make_optimizer(mt.OptimConfig(), 10)
    tokens = np.random.default_rng(0).integers(0, 256, (16, 33), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    for style, mesh_str, strategy in LAYOUTS:
        print(f"LAYOUT {style} {mesh_str} {strategy}", file=sys.stderr, flush=True)
        cfg = mt.GPTConfig(style=style, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)
        mesh = mt.make_mesh(mesh_str)
        rules = mt.rules_for(strategy, mesh)
        graphdef, state, shardings = mt.lower.init_train_state(
            lambda: mt.lower.build_model(cfg), tx, mesh, rules
        )
        step = mt.lower.jit_train_step(
            graphdef, tx, mesh, rules, shardings, batch_shardings(batch, mesh, rules)
        )
        step.lower(state, mt.lower.shard_batch(batch, mesh, rules)).compile()
    print("DONE", file=sys.stderr, flush=True)
    """
)


@pytest.mark.slow
def test_no_preset_makes_xla_replicate_a_tensor_to_repartition_it():
    code = f"LAYOUTS = {LAYOUTS!r}\n{SCRIPT}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DONE" in proc.stderr
    layout, bad = None, []
    for line in proc.stderr.splitlines():
        if line.startswith("LAYOUT "):
            layout = line.removeprefix("LAYOUT ")
        elif "Involuntary full rematerialization" in line:
            bad.append(f"{layout}: {line[line.find('for HLO operation') :][:200]}")
    assert not bad, "\n".join(bad)
