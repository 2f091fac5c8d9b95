"""The PyTorch baseline: the same GPT in plain PyTorch, timed like ``meshtrain bench``.

Standalone: it imports torch and numpy only (torch is not a meshtrain dependency; the GPU image
has it). On a GPU it runs the usual fast recipe: ``torch.compile``, SDPA attention
(`F.scaled_dot_product_attention`, causal, GQA through ``enable_gqa``), bf16 autocast with
float32 master weights, fused AdamW, global-norm clipping. It prints one JSON line.

    python benchmarks/baseline_torch.py --d-model 768 --n-layers 12 --n-heads 12 \
        --vocab-size 50304 --seq-len 1024 --batch 16            # what e2e.py runs for 125m
    python benchmarks/baseline_torch.py --parity FILE.npz       # same-math check (CPU, fp32)

``--parity`` reads weights in meshtrain's layout, a batch and meshtrain's loss and gradient
norm (written by ``benchmarks/torch_parity.py export``), computes both in float32 without
compiling, and exits 1 unless they agree. `make torch-parity` runs the pair on CPU.

Shape suffixes: B batch, T positions, D width, H query heads, G key/value heads, K head width.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Cfg(argparse.Namespace):
    """style, vocab_size, max_seq_len, d_model, n_layers, n_heads, n_kv_heads, d_ff,
    rope_theta, norm_eps, tie_embeddings."""


class Norm(nn.Module):
    """RMSNorm or LayerNorm (bias=True), statistics in float32, result in the input's dtype."""

    def __init__(self, d: int, eps: float, bias: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        if self.bias is not None:
            x32 = x32 - x32.mean(-1, keepdim=True)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def rope(x_BTHK, theta: float):
    """Rotary positions on pairs (first half, second half) of each head, angles in float32."""
    T, K = x_BTHK.shape[1], x_BTHK.shape[3]
    inv = 1.0 / theta ** (torch.arange(0, K, 2, dtype=torch.float32, device=x_BTHK.device) / K)
    ang = torch.arange(T, dtype=torch.float32, device=x_BTHK.device)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x_BTHK.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x_BTHK.dtype)


class Block(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        D, H, G, K, Fd = c.d_model, c.n_heads, c.n_kv_heads, c.d_model // c.n_heads, c.d_ff
        bias = c.style == "gpt2"
        self.c, self.H, self.G, self.K = c, H, G, K
        self.norm1, self.norm2 = Norm(D, c.norm_eps, bias), Norm(D, c.norm_eps, bias)
        self.q, self.k = nn.Linear(D, H * K, bias=bias), nn.Linear(D, G * K, bias=bias)
        self.v, self.o = nn.Linear(D, G * K, bias=bias), nn.Linear(H * K, D, bias=bias)
        self.gate = nn.Linear(D, Fd, bias=False) if c.style == "llama" else None
        self.up, self.down = nn.Linear(D, Fd, bias=bias), nn.Linear(Fd, D, bias=bias)

    def forward(self, x_BTD):
        B, T, _ = x_BTD.shape
        h = self.norm1(x_BTD)
        q = self.q(h).view(B, T, self.H, self.K)
        k = self.k(h).view(B, T, self.G, self.K)
        v = self.v(h).view(B, T, self.G, self.K)
        if self.c.style == "llama":
            q, k = rope(q, self.c.rope_theta), rope(k, self.c.rope_theta)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.G != self.H,
        )
        x_BTD = x_BTD + self.o(o.transpose(1, 2).reshape(B, T, self.H * self.K))
        h = self.norm2(x_BTD)
        if self.gate is not None:
            u = F.silu(self.gate(h)) * self.up(h)
        else:
            u = F.gelu(self.up(h), approximate="tanh")
        return x_BTD + self.down(u)


class GPT(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = (
            nn.Parameter(torch.zeros(c.max_seq_len, c.d_model)) if c.style == "gpt2" else None
        )
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = Norm(c.d_model, c.norm_eps, c.style == "gpt2")
        self.head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                std = (
                    0.02 / math.sqrt(2 * c.n_layers)
                    if name.endswith(("o.weight", "down.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=0.01 if name == "pos" else std)

    def forward(self, tokens_BT, targets_BT):
        x = self.embed(tokens_BT)
        if self.pos is not None:
            x = x + self.pos[: tokens_BT.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = x @ self.embed.weight.T if self.head is None else self.head(x)
        return F.cross_entropy(logits.float().flatten(0, 1), targets_BT.flatten())


def load_meshtrain_weights(model: GPT, flat: dict[str, np.ndarray]) -> None:
    """Copies weights in meshtrain's layout ("blocks/attn/q/kernel" [L, D, H, K], ...) in."""
    c = model.c

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    with torch.no_grad():
        model.embed.weight.copy_(t(flat["embed/embedding"]))
        if model.pos is not None:
            model.pos.copy_(t(flat["pos"]))
        if model.head is not None:
            model.head.weight.copy_(t(flat["head/kernel"]).T)
        model.norm.scale.copy_(t(flat["norm/scale"]))
        if model.norm.bias is not None:
            model.norm.bias.copy_(t(flat["norm/bias"]))
        for i, b in enumerate(model.blocks):

            def w(name, i=i):
                return flat[f"blocks/{name}"][i]

            for proj in ("q", "k", "v"):  # [D, heads, K] -> torch's [heads·K, D]
                getattr(b, proj).weight.copy_(t(w(f"attn/{proj}/kernel").reshape(c.d_model, -1)).T)
                if getattr(b, proj).bias is not None:
                    getattr(b, proj).bias.copy_(t(w(f"attn/{proj}/bias").reshape(-1)))
            b.o.weight.copy_(t(w("attn/o/kernel").reshape(-1, c.d_model)).T)
            names = ["up", "down"] + (["gate"] if b.gate is not None else [])
            for name in names:
                getattr(b, name).weight.copy_(t(w(f"mlp/{name}/kernel")).T)
            if c.style == "gpt2":
                b.o.bias.copy_(t(w("attn/o/bias")))
                b.up.bias.copy_(t(w("mlp/up/bias")))
                b.down.bias.copy_(t(w("mlp/down/bias")))
            for n in ("norm1", "norm2"):
                getattr(b, n).scale.copy_(t(w(f"{n}/scale")))
                if getattr(b, n).bias is not None:
                    getattr(b, n).bias.copy_(t(w(f"{n}/bias")))


def parity(path: str) -> int:
    """Loss and gradient norm on meshtrain's weights and batch, float32, against meshtrain's."""
    data = np.load(path)
    c = Cfg(**json.loads(str(data["config"])))
    flat = {k[2:]: data[k] for k in data.files if k.startswith("p/")}
    inputs = torch.from_numpy(data["inputs"].astype(np.int64))
    targets = torch.from_numpy(data["targets"].astype(np.int64))
    model = GPT(c)
    load_meshtrain_weights(model, flat)
    loss = model(inputs, targets)
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    # The check can fail: the classic slip of swapping the key and value projections must
    # move the loss by far more than the tolerance.
    slip = dict(flat)
    slip["blocks/attn/k/kernel"], slip["blocks/attn/v/kernel"] = (
        flat["blocks/attn/v/kernel"],
        flat["blocks/attn/k/kernel"],
    )
    slipped = GPT(c)
    load_meshtrain_weights(slipped, slip)
    with torch.no_grad():
        slip_loss = float(slipped(inputs, targets))
    out = {
        "benchmark": "torch_parity",
        "torch_version": torch.__version__,
        "loss": float(loss.detach()),
        "meshtrain_loss": float(data["loss"]),
        "grad_norm": float(grad_norm),
        "meshtrain_grad_norm": float(data["grad_norm"]),
    }
    out["loss_rel_diff"] = abs(out["loss"] - out["meshtrain_loss"]) / abs(out["meshtrain_loss"])
    out["grad_norm_rel_diff"] = abs(out["grad_norm"] - out["meshtrain_grad_norm"]) / abs(
        out["meshtrain_grad_norm"]
    )
    out["slip_loss_rel_diff"] = abs(slip_loss - out["meshtrain_loss"]) / abs(out["meshtrain_loss"])
    out["ok"] = (
        out["loss_rel_diff"] < 1e-5
        and out["grad_norm_rel_diff"] < 1e-4
        and out["slip_loss_rel_diff"] > 1e-3
    )
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The GPT in plain PyTorch; one JSON line.")
    p.add_argument("--parity", default="", help="same-math check against a meshtrain .npz")
    p.add_argument("--style", default="llama", choices=("llama", "gpt2"))
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=2)
    p.add_argument("--n-kv-heads", type=int, default=0, help="0: n_heads")
    p.add_argument("--d-ff", type=int, default=0, help="0: meshtrain's default for the style")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--dtype",
        default="",
        choices=("", "bfloat16", "float32"),
        help="autocast dtype (default: bfloat16 on a GPU, float32 elsewhere)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    p.add_argument("--no-compile", action="store_true", help="eager (no torch.compile)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def bench(a: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    d_ff = a.d_ff or (
        4 * a.d_model if a.style == "gpt2" else 64 * math.ceil(8 * a.d_model / 3 / 64)
    )
    c = Cfg(
        style=a.style,
        vocab_size=a.vocab_size,
        max_seq_len=a.seq_len,
        d_model=a.d_model,
        n_layers=a.n_layers,
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads or a.n_heads,
        d_ff=d_ff,
        rope_theta=10_000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
    )
    torch.manual_seed(a.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = GPT(c).to(device)
    decay = [p for n, p in model.named_parameters() if not n.endswith(("bias", "scale"))]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(("bias", "scale"))]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=cuda,
    )
    fwd = model if a.no_compile else torch.compile(model)
    gen = np.random.default_rng(a.seed)
    batches = []
    for _ in range(3):
        tok = torch.from_numpy(
            gen.integers(0, c.vocab_size, (a.batch, a.seq_len + 1)).astype(np.int64)
        )
        batches.append((tok[:, :-1].to(device), tok[:, 1:].to(device)))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(i):
        x, y = batches[i % 3]
        with autocast:
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    first = float(step(0))
    sync()
    compile_s = time.perf_counter() - t0
    for i in range(a.warmup):
        step(i)
    sync()
    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        step(i)
        sync()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(a.steps):
        step(i)
    sync()
    back_to_back = (time.perf_counter() - t0) / a.steps
    med = statistics.median(times)
    return {
        "benchmark": "torch_baseline",
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": dtype,
        "compiled": not a.no_compile,
        "attention": "F.scaled_dot_product_attention(is_causal=True)",
        "optimizer": f"AdamW(fused={cuda}) + clip_grad_norm_(1.0)",
        "model": {k: v for k, v in vars(c).items()},
        "seq_len": a.seq_len,
        "batch": a.batch,
        "params": sum(p.numel() for p in model.parameters()),
        "first_loss": first,
        "first_step_s": compile_s,
        "step_time_s": med,
        "step_time_min": min(times),
        "step_time_max": max(times),
        "step_time_back_to_back_s": back_to_back,
        "tokens_per_s": a.batch * a.seq_len / med,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.parity:
        return parity(a.parity)
    print(json.dumps(bench(a)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
