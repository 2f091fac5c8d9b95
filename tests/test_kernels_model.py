"""The GPT with Pallas kernels (interpreted) against the GPT with the jnp paths, on a
2×2×2 data×fsdp×tensor mesh: loss and every gradient; config validation; the CLI flags; a
short Trainer run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import initial_values
from _kernel_helpers import assert_close, fresh_key
from flax import nnx

from meshtrain import cli, kernels
from meshtrain.data import DataConfig, make_dataset
from meshtrain.layout import activation_rules, rules_for, shard_batch
from meshtrain.loss import cross_entropy
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, build_model
from meshtrain.run import RunSpec
from meshtrain.train.trainer import TrainConfig, Trainer

# Head width 64 (the kernels take 64 and 128); GQA with 2 query heads per key/value head, so
# query and key/value heads both split over tensor=2. T=40 is not a whole number of blocks.
BASE = dict(vocab_size=256, max_seq_len=64, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2)
PALLAS = dict(attention_impl="pallas", norm_impl="pallas")  # the model's kernels


def _loss_and_grads(cfg, values, mesh, rules, tokens, targets, loss_impl="xla"):
    """Loss and parameter gradients of `cfg`'s GPT from `values` on the mesh, jitted."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)
    nnx.replace_by_pure_dict(params, values)

    @jax.jit
    def run(params, tokens, targets):
        def loss_of(params):
            with activation_rules(mesh, rules):
                logits = nnx.merge(graphdef, params)(tokens)
                return cross_entropy(logits, targets, impl=loss_impl)

        return jax.value_and_grad(loss_of)(params)

    return run(params, tokens, targets)


# Mistral/Qwen2/Llama 3.1 features at once: a window shorter than the sequence (and than two
# blocks), q/k/v biases, scaled RoPE.
NEWER = dict(sliding_window=20, qkv_bias=True, rope_scaling="llama3", rope_original_max_seq_len=16)


@pytest.mark.slow
# The llama style runs with the newer features: the same kernels and wiring as the plain
# llama (the window is one more argument of the same flash kernel), one program fewer.
@pytest.mark.parametrize("style,extra", [("gpt2", {}), ("llama", NEWER)], ids=["gpt2", "newer"])
@pytest.mark.pair("fsdp", "pallas")
@pytest.mark.pair("tp", "pallas")
def test_gpt_with_pallas_kernels_equals_reference_on_2x2x2_mesh(style, extra):
    key, seed = fresh_key()
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = rules_for("fsdp+tp", mesh)
    tokens = np.asarray(jax.random.randint(key, (8, 41), 0, 256))
    batch = shard_batch({"x": tokens[:, :-1], "y": tokens[:, 1:]}, mesh, rules)
    ref_cfg = GPTConfig(style=style, **BASE, **extra)
    values = initial_values(ref_cfg)  # the kernels change no parameter: one set for both
    loss, grads = _loss_and_grads(
        dataclasses.replace(ref_cfg, **PALLAS), values, mesh, rules, batch["x"], batch["y"],
        "pallas",
    )  # fmt: skip
    ref_loss, ref_grads = _loss_and_grads(ref_cfg, values, mesh, rules, batch["x"], batch["y"])
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss)), (loss, ref_loss)
    flat, ref_flat = nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)
    assert [p for p, _ in flat] == [p for p, _ in ref_flat]
    # on the host: eager jnp would compile a program per gradient shape
    total = np.sqrt(sum(float(np.sum(np.square(np.asarray(r.get_value())))) for _, r in ref_flat))
    for (path, g), (_, r) in zip(flat, ref_flat, strict=True):
        name = "/".join(map(str, path))
        g, r = np.asarray(g.get_value()), np.asarray(r.get_value())
        if float(np.linalg.norm(r)) < 1e-6 * total:  # zero in exact arithmetic (a key bias)
            assert float(np.linalg.norm(g)) < 1e-5 * total, name
            continue
        assert_close(g, r, 1e-4, name, seed)


def test_config_validates_impls():
    with pytest.raises(ValueError, match=r"attention_impl='flash': choose from pallas, xla"):
        GPTConfig(attention_impl="flash")
    with pytest.raises(ValueError, match=r"norm_impl='cudnn': choose from pallas, xla, auto"):
        GPTConfig(norm_impl="cudnn")
    with pytest.raises(ValueError, match=r"loss_impl='fused'"):
        TrainConfig(loss_impl="fused")
    # The default GPT has head width 32: the kernel would not take it.
    with pytest.raises(
        ValueError, match=r"head width \(head_dim, or d_model / n_heads\) of 64 or 128, got 32"
    ):
        GPTConfig(attention_impl="pallas")
    GPTConfig(attention_impl="auto")  # auto falls back to the jnp path for width 32
    assert GPTConfig().attention_impl == GPTConfig().norm_impl == TrainConfig().loss_impl == "xla"


def test_cli_exposes_the_kernel_flags(capsys, tmp_path):
    argv = ["train", "--gpt.d-model", "128", "--gpt.n-heads", "2"]
    flags = [f"--gpt.{k.replace('_', '-')}={v}" for k, v in PALLAS.items()]
    job = cli.parse([*argv, *flags, "--loss-impl", "pallas"])
    assert (job.gpt.attention_impl, job.gpt.norm_impl, job.train.loss_impl) == ("pallas",) * 3
    code = cli.main(
        ["train", "--gpt.attention-impl", "pallas", "--run-dir", str(tmp_path), "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "attention_impl='pallas'" in err and "got 32" in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_trainer_trains_with_kernels_selected():
    """The Trainer runs the GPT with every kernel on Pallas (the loss through loss_impl) on a
    2×2×2 mesh; its loss starts near ln(256) and falls."""
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = rules_for("fsdp+tp", mesh)
    data = make_dataset(DataConfig(source="synthetic", seq_len=32, batch_size=8))
    cfg = GPTConfig(style="llama", **dict(BASE, n_layers=1), **PALLAS)
    loop = TrainConfig(
        steps=3, log_every=1, eval_every=0, run_dir="", progress=False, loss_impl="pallas"
    )
    trainer = Trainer(run=RunSpec(model=cfg, data=data, mesh=mesh, rules=rules, train=loop))
    logits, targets = jnp.zeros((2, 4, 256)), jnp.zeros((2, 4), jnp.int32)
    assert "cross_entropy_fwd" in str(jax.make_jaxpr(trainer.loss_fn)(logits, targets))
    losses = [m["loss"] for m in trainer.fit()]
    assert len(losses) == 3 and np.all(np.isfinite(losses)), losses
    assert abs(losses[0] - np.log(256)) < 0.3, losses
    assert losses[-1] < losses[0], losses


def test_auto_on_cpu_uses_the_jnp_paths():
    cfg = GPTConfig(attention_impl="auto", norm_impl="auto", **BASE)
    ref_cfg = dataclasses.replace(cfg, attention_impl="xla", norm_impl="xla")
    model = nnx.eval_shape(lambda: build_model(cfg))
    if jax.default_backend() != "gpu":  # "auto" resolves per call: here, to the jnp path
        impl = kernels.model_attention_impl(model.blocks.attn.impl, 64, jnp.float32, seq=8)
        assert (model.blocks.attn.impl, impl) == ("auto", "xla")
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, initial_values(ref_cfg))  # the same values for both
    ref_graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(ref_cfg)))
    both = jax.jit(lambda s, t: [nnx.merge(g, s)(t) for g in (graphdef, ref_graphdef)])
    got, want = both(state, jnp.zeros((1, 8), jnp.int32))  # both forwards in one program
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pallas_config_runs_the_kernels():
    """The Pallas config really calls the kernels; the xla config calls none."""

    def program(cfg):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
        tokens = jnp.zeros((1, 8), jnp.int32)
        return str(jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))

    cfg = GPTConfig(**dict(BASE, n_layers=1))
    pallas, xla = program(dataclasses.replace(cfg, **PALLAS)), program(cfg)
    for name in ("flash_attention_fwd", "rms_norm_fwd"):
        assert name in pallas and name not in xla, name
