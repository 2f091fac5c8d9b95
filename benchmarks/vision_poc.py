"""The surveys' proof of concept, per training phase: forward, backward-input, backward-weights.

The small CNN (`CNNConfig` preset ``lenet``, convolutions and linear layers, no norm), trained
with the mean-squared-error loss, as three contenders on the same shapes:

- ``xla_conv+pallas``: XLA's convolutions (cuDNN on a GPU) with the hand-written Pallas ReLU
  and MSE kernels (`meshtrain.kernels.relu`, `mean_squared_error`);
- ``xla``: everything XLA's own (its fusion of ReLU and loss);
- ``torch``: the same network in PyTorch, where ``import torch`` works.

Phases, each its own jitted function: ``forward`` (the loss), ``backward_input`` (the
gradient with respect to the images only: the convolutions' data gradients, cuDNN's
"backward data"), ``backward_weights`` (the gradient with respect to the parameters only:
"backward filter" plus the data gradients it needs) and ``total`` (loss and parameter
gradients together, one training step without the optimizer). Each prints one JSON line with
XLA's compiled FLOPs, bytes accessed and peak memory (arguments + outputs + temporaries), and
on a GPU the median time of ``--iters`` runs; a last line gives each phase's ratio of
``xla_conv+pallas`` to ``xla``. On a CPU the times are left out (``time_ms: null``): they are
GPU figures, and the Pallas kernels run interpreted there, so their compiled figures describe
the interpreter's emulation, not the GPU kernels.

    python benchmarks/vision_poc.py --quick        # 8×8 digits-sized, batch 32
    python benchmarks/vision_poc.py                # 32×32×3, batch 128
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import parser
from flax import nnx

from meshtrain.loss import mse
from meshtrain.models import CNNConfig

PHASES = ("forward", "backward_input", "backward_weights", "total")


def _phases(cfg: CNNConfig, impl: str):
    """The four phase functions of the network `cfg` with kernels `impl`, and its params."""
    graphdef, params = nnx.split(cfg.build(rngs=nnx.Rngs(params=0)))

    def loss(params, x, y):
        return mse(nnx.merge(graphdef, params)(x), y, impl=impl)

    return params, {
        "forward": loss,
        "backward_input": jax.grad(loss, argnums=1),
        "backward_weights": jax.grad(loss, argnums=0),
        "total": jax.value_and_grad(loss, argnums=0),
    }


def _figures(fn, args, iters: int) -> dict:
    """Compiled FLOPs, bytes and peak memory of ``jit(fn)(*args)``; its time on a GPU."""
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
    out = {
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "peak_bytes": peak,
        "time_ms": None,
    }
    if jax.default_backend() == "gpu":
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append((time.perf_counter() - start) * 1e3)
        out["time_ms"] = statistics.median(times)
    return out


def _torch_lines(cfg: CNNConfig, batch: int, iters: int) -> list[dict]:
    """PyTorch on the same network and shapes where it imports (times on CUDA only); else one
    line saying it is not measured. Written for a GPU host; not run where torch is absent."""
    try:
        import torch
    except ImportError:
        return [
            {
                "bench": "vision_poc",
                "variant": "torch",
                "status": "not measured: torch is not importable in this environment",
            }
        ]
    from torch import nn

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layers, c_in = [], cfg.in_channels
    for width in cfg.stage_widths:
        for _ in range(cfg.stage_depth):
            layers += [nn.Conv2d(c_in, width, 3, padding=1), nn.ReLU()]
            c_in = width
        layers.append(nn.MaxPool2d(2))
    (flat, hidden), (_, classes) = cfg.dense()
    layers += [nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, classes)]
    net = nn.Sequential(*layers).to(dev)
    x = torch.rand(batch, cfg.in_channels, cfg.image_size, cfg.image_size, device=dev)
    y = nn.functional.one_hot(torch.randint(0, classes, (batch,), device=dev), classes).float()

    def run(phase):
        for p in net.parameters():
            p.requires_grad_(phase in ("backward_weights", "total"))
            p.grad = None
        x.requires_grad_(phase == "backward_input")
        x.grad = None
        with torch.set_grad_enabled(phase != "forward"):
            loss = nn.functional.mse_loss(net(x), y)
            if phase != "forward":
                loss.backward()

    lines = []
    for phase in PHASES:
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        run(phase)
        times = []
        for _ in range(iters if dev == "cuda" else 0):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run(phase)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
        lines.append(
            {
                "bench": "vision_poc",
                "variant": "torch",
                "phase": phase,
                "batch": batch,
                "time_ms": statistics.median(times) if times else None,
                "peak_bytes": peak,
                "device": dev,
                "torch": torch.__version__,
            }
        )
    return lines


def main(argv=None) -> int:
    """Prints one JSON line per contender and phase, then the ratios."""
    p = parser(__doc__.splitlines()[0], quick="8×8×1 images, batch 32")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    size, channels, batch = (8, 1, 32) if args.quick else (32, 3, args.batch)
    cfg = CNNConfig(image_size=size, in_channels=channels, norm="none")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random((batch, size * size * channels), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, cfg.num_classes, batch), dtype=jnp.int32)
    device = jax.devices()[0]
    results = {}
    for variant, impl in (("xla_conv+pallas", "pallas"), ("xla", "xla")):
        act = CNNConfig(**{**cfg.__dict__, "act_impl": impl})
        params, fns = _phases(act, impl)
        for phase in PHASES:
            figures = _figures(fns[phase], (params, x, y), args.iters)
            results[variant, phase] = figures
            line = {
                "bench": "vision_poc",
                "variant": variant,
                "phase": phase,
                "model": act.describe(),
                "batch": batch,
                **figures,
                "device": device.device_kind,
                "jax": jax.__version__,
            }
            if device.platform != "gpu":
                line["note"] = "times are GPU-only; on CPU the Pallas kernels run interpreted"
            print(json.dumps(line), flush=True)
    for line in _torch_lines(cfg, batch, args.iters):
        print(json.dumps(line), flush=True)
    ratios = {}
    for phase in PHASES:
        a, b = results["xla_conv+pallas", phase], results["xla", phase]
        ratios[phase] = {
            key: (a[key] / b[key] if a[key] and b[key] else None)
            for key in ("flops", "bytes_accessed", "peak_bytes", "time_ms")
        }
    print(json.dumps({"bench": "vision_poc", "ratio": "xla_conv+pallas / xla", **ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
