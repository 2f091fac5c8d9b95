"""Makes the DeepSeek-V3 router fixture in tests/fixtures/hf/ with the reference code:
transformers' ``DeepseekV3TopkRouter`` (sigmoid scores, a score-correction bias, group-limited
top-k, renormalised and scaled weights) on random tokens.

Run once, by hand, never by the test suite, in the venv `scripts/make_hf_fixtures.py` describes
(torch 2.13.0+cpu, transformers 5.23.0)::

    .venv-hf/bin/python scripts/make_hf_deepseek_router.py

It writes ``tests/fixtures/hf/deepseek_v3_router.npz``, all float32 but the ids: per case
(``grouped``: 16 experts in 4 groups, 2 per token, top-4, scale 2.5; ``flat``: 8 experts in
one group, top-2, scale 1, no renormalising) the router weight ``{case}_weight`` [E, D], the
bias ``{case}_bias`` [E], the tokens ``{case}_x`` [N, D], transformers' logits
``{case}_logits`` [N, E], chosen ids ``{case}_ids`` [N, K] (sorted per token) and their weights
``{case}_weights`` [N, K] (in the same order); ``versions``, what made them (JSON).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
D, N = 16, 64
CASES = {
    "grouped": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                    routed_scaling_factor=2.5, norm_topk_prob=True),
    "flat": dict(n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
                 routed_scaling_factor=1.0, norm_topk_prob=False),
}  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    out = {}
    for name, fields in CASES.items():
        cfg = DeepseekV3Config(hidden_size=D, **fields)
        router = DeepseekV3TopkRouter(cfg)
        E = fields["n_routed_experts"]
        with torch.no_grad():
            router.weight.copy_(torch.randn(E, D))
            router.e_score_correction_bias.copy_(0.3 * torch.randn(E))
            x = torch.randn(N, D)
            logits, weights, ids = router(x)
        order = torch.argsort(ids, dim=-1)
        out[f"{name}_weight"] = router.weight.detach().numpy()
        out[f"{name}_bias"] = router.e_score_correction_bias.numpy()
        out[f"{name}_x"] = x.numpy()
        out[f"{name}_logits"] = logits.numpy()
        out[f"{name}_ids"] = torch.gather(ids, 1, order).numpy().astype(np.int32)
        out[f"{name}_weights"] = torch.gather(weights, 1, order).numpy()
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    out["versions"] = np.array(json.dumps(versions))
    np.savez(OUT / "deepseek_v3_router.npz", **out)
    print(f"wrote {OUT / 'deepseek_v3_router.npz'}: {versions}")


if __name__ == "__main__":
    main()
