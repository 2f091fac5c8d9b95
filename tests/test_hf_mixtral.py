"""Mixtral interchange: a tiny random ``MixtralForCausalLM`` made by transformers
(`scripts/make_hf_fixtures.py`) loads into meshtrain's `MoE` with logits equal to
transformers', and an export reloads to the same parameters and logits."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from meshtrain.hf.mixtral import load_mixtral, save_mixtral
from meshtrain.layout import activation_rules, rules_for
from meshtrain.mesh import make_mesh
from meshtrain.models import logits_of

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "mixtral"


@pytest.fixture(scope="module")
def mixtral():
    ref = np.load(FIXTURE.parent / "mixtral_logits.npz")
    model = load_mixtral(FIXTURE)
    return model, ref


def test_mixtral_logits_equal_transformers(mixtral):
    model, ref = mixtral
    cfg = model.cfg
    assert (cfg.n_experts, cfg.top_k, cfg.dispatch) == (4, 2, "dropless")
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: logits_of(nnx.merge(graphdef, s)(t)))
    logits = np.asarray(fwd(state, ref["tokens"]))
    logits = logits[..., : cfg.vocab_size]
    scale = np.abs(ref["logits"]).max()
    np.testing.assert_allclose(logits, ref["logits"], atol=2e-5 * scale, rtol=0)


def test_mixtral_export_reloads_the_same_parameters_and_logits(mixtral, tmp_path):
    model, ref = mixtral
    out = save_mixtral(model, tmp_path / "export")
    again = load_mixtral(out)
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(again, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The expert-parallel forward of the imported model gives the same logits.
    mesh = make_mesh("expert=4,data=2")
    rules = rules_for("dp", mesh)
    graphdef, state = nnx.split(again)

    def fwd(state, tokens):
        with activation_rules(mesh, rules):
            return logits_of(nnx.merge(graphdef, state)(tokens))

    with jax.set_mesh(mesh):
        tokens = np.concatenate([ref["tokens"]] * 4)  # 8 rows: one per device
        logits = np.asarray(jax.jit(fwd)(state, tokens))[:2, :, : model.cfg.vocab_size]
    scale = np.abs(ref["logits"]).max()
    np.testing.assert_allclose(logits, ref["logits"], atol=2e-5 * scale, rtol=0)
