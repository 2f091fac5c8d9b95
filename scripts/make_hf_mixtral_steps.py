"""Makes the MoE training fixtures in tests/fixtures/hf/ with the reference code: a tiny
``MixtralForCausalLM`` (or ``Qwen3MoeForCausalLM``) that trains with its router loss on, and
three torch AdamW steps of it.

Run once, by hand, never by the test suite, in the venv `scripts/make_hf_fixtures.py` describes
(torch 2.13.0+cpu, transformers 5.23.0)::

    .venv-hf/bin/python scripts/make_hf_mixtral_steps.py            # mixtral
    .venv-hf/bin/python scripts/make_hf_mixtral_steps.py qwen3_moe  # qwen3_moe_steps*
    .venv-hf/bin/python scripts/make_hf_mixtral_steps.py qwen3      # qwen3_steps*

``qwen3_moe`` writes the same files under ``qwen3_moe_steps`` names: a Qwen3-MoE of width 32,
2 layers (both sparse), heads of 16 (4 × 16 ≠ 32), query/key norms, 8 experts of width 16,
top-3 without ``norm_topk_prob``, its ``load_balancing_loss_func`` being Mixtral's.
``qwen3`` writes them for the dense tiny Qwen3 of `make_hf_fixtures.py` (heads 6 × 24 on a
width of 64, query/key norms, tied head), with no router: no ``aux_loss`` and no router fields.

For ``mixtral`` it writes, all float32:

- ``tests/fixtures/hf/mixtral_steps/``: the model before training (``save_pretrained``): 4
  experts of width 32, top-2, width 32, 2 layers, vocab 128, ``output_router_logits=True`` and
  ``router_aux_loss_coef`` = `AUX`, so transformers' training loss is the cross-entropy plus
  `AUX` × its load-balancing loss;
- ``tests/fixtures/hf/mixtral_steps_trained/``: the same model after `STEPS` steps of
  ``torch.optim.AdamW`` (`ADAMW`; no weight decay on the norms' weights, no clipping, no
  schedule);
- ``tests/fixtures/hf/mixtral_steps.npz``: per step ``inputs`` [S, B, T] int32, ``targets``
  [S, B, T] int32 (-100 where ignored), ``mask`` [S, B, T] int32 (the attention mask: row 1
  ends in padding), transformers' ``loss`` [S] and ``aux_loss`` [S]; and, for the first batch,
  the routers' logits ``router_logits`` [L, B·T, E] and ``load_balancing_loss``, the value of
  ``load_balancing_loss_func`` on them with that mask; ``versions``, what made them (JSON).

The labels go in as ``shift_labels`` (position t predicts ``targets[t]``), so every position
of a row is trained on, as meshtrain's ``inputs``/``targets`` batches are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from _hf_tiny import mixtral_fields, qwen3_fields, qwen3_moe_fields
from _hf_tiny import versions as tiny_versions
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
SEED, BATCH, SEQ, STEPS, PAD = 17, 2, 16, 3, 5  # the last PAD positions of row 1 are padding
AUX = 0.1
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _mixtral() -> transformers.MixtralForCausalLM:
    cfg = transformers.MixtralConfig(
        **mixtral_fields(
            hidden_size=32,
            intermediate_size=32,
            max_position_embeddings=64,
            output_router_logits=True,
            router_aux_loss_coef=AUX,
        )
    )
    return transformers.MixtralForCausalLM(cfg)


def _qwen3_moe() -> transformers.Qwen3MoeForCausalLM:
    cfg = transformers.Qwen3MoeConfig(
        **qwen3_moe_fields(
            hidden_size=32,
            num_hidden_layers=2,
            decoder_sparse_step=1,
            moe_intermediate_size=16,
            norm_topk_prob=False,
            max_position_embeddings=64,
            output_router_logits=True,
            router_aux_loss_coef=AUX,
        )
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def _qwen3() -> transformers.Qwen3ForCausalLM:
    cfg = transformers.Qwen3Config(**qwen3_fields(max_position_embeddings=64))
    return transformers.Qwen3ForCausalLM(cfg)


MODELS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "qwen3": _qwen3}


def _model(name: str) -> transformers.PreTrainedModel:
    """The tiny model, with norm weights perturbed so their mapping is exercised too."""
    torch.manual_seed(SEED)
    model = MODELS[name]()
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def _batches(vocab: int) -> dict[str, np.ndarray]:
    """`STEPS` batches of random tokens; row 1 of each ends in `PAD` padding positions."""
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, vocab, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
    mask = np.ones((STEPS, BATCH, SEQ), np.int32)
    mask[:, 1, SEQ - PAD :] = 0
    targets = np.where(mask > 0, tokens[..., 1:], -100).astype(np.int32)
    return {"inputs": tokens[..., :-1], "targets": targets, "mask": mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", default="mixtral", choices=sorted(MODELS))
    name = parser.parse_args().name
    torch.set_default_dtype(torch.float32)
    model = _model(name)
    model.save_pretrained(OUT / f"{name}_steps", safe_serialization=True)
    data = _batches(model.config.vocab_size)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    others = [p for n, p in model.named_parameters() if "norm" not in n]
    opt = torch.optim.AdamW([{"params": others}, {"params": norms, "weight_decay": 0.0}], **ADAMW)
    model.train()
    losses, aux = [], []
    for s in range(STEPS):
        inputs, mask = (torch.from_numpy(data[k][s]).long() for k in ("inputs", "mask"))
        targets = torch.from_numpy(data["targets"][s]).long()
        out = model(input_ids=inputs, attention_mask=mask, labels=targets, shift_labels=targets)
        if s == 0 and getattr(out, "router_logits", None) is not None:
            logits = tuple(r.detach() for r in out.router_logits)
            E, k = model.config.num_local_experts, model.config.num_experts_per_tok
            balance = load_balancing_loss_func(logits, E, k, mask)
            data["router_logits"] = np.stack([r.numpy() for r in logits]).astype(np.float32)
            data["load_balancing_loss"] = np.float32(balance.item())
        losses.append(out.loss.item())
        if getattr(out, "aux_loss", None) is not None:
            aux.append(out.aux_loss.item())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.save_pretrained(OUT / f"{name}_steps_trained", safe_serialization=True)
    data["loss"] = np.asarray(losses, np.float32)
    if aux:
        data["aux_loss"] = np.asarray(aux, np.float32)
    versions = tiny_versions()
    data["versions"] = np.asarray(json.dumps(versions))
    np.savez(OUT / f"{name}_steps.npz", **data)
    print(json.dumps({"loss": losses, "aux_loss": aux, **versions}))


if __name__ == "__main__":
    main()
