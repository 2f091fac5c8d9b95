"""The fine-tune workflow: a Hugging Face GPT-2 with its tokenizer → 3 steps on fsdp+tp →
export → the exported files give meshtrain's logits in GPT-2's reference math; top-k / top-p
sampling; `meshtrain generate`; the refusals.

transformers is not installed in the suite's venv (it needs torch), so the reference is
`_gpt2_logits`: GPT2LMHeadModel's forward written in numpy from the tensor names and config.json
transformers writes. It is pinned to transformers by reproducing the logits transformers
computed for the GPT-2 fixture (tests/fixtures/hf, scripts/make_hf_fixtures.py), and
``scripts/make_hf_fixtures.py --verify`` checks an export with transformers itself.
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hf_helpers import ATOL, FIXTURES, forward, read, reference
from flax import nnx

from meshtrain import cli, hf
from meshtrain import generate as gen
from meshtrain.cli.parsing import given
from meshtrain.cli.train import TrainJob, build_trainer
from meshtrain.data import HFTokenizer, load_tokenizer, stdlib_corpus
from meshtrain.hf import finetune
from meshtrain.models.sampling import filter_logits


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _norm(x, w, b, eps):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _gpt2_logits(path, tokens_BT) -> np.ndarray:
    """GPT2LMHeadModel's float32 logits [B, T, V] from the files in `path`, in numpy."""
    cfg = json.loads((path / "config.json").read_text())
    w = {k.removeprefix("transformer."): v.astype(np.float32) for k, v in read(
        path / "model.safetensors").items()}  # fmt: skip
    H, eps = cfg["n_head"], cfg["layer_norm_epsilon"]
    B, T = tokens_BT.shape
    x = w["wte.weight"][tokens_BT] + w["wpe.weight"][:T]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg["n_layer"]):
        p = lambda n, i=i: w[f"h.{i}.{n}"]  # noqa: E731
        h = _norm(x, p("ln_1.weight"), p("ln_1.bias"), eps)
        q, k, v = np.split(h @ p("attn.c_attn.weight") + p("attn.c_attn.bias"), 3, axis=-1)
        heads = lambda t: t.reshape(B, T, H, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        o = ((a / a.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, -1)
        x = x + o @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = _norm(x, p("ln_2.weight"), p("ln_2.bias"), eps)
        h = _gelu_tanh(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
        x = x + h @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = _norm(x, w["ln_f.weight"], w["ln_f.bias"], eps)
    head = w.get("lm_head.weight", w["wte.weight"])
    return x @ head.T


def test_numpy_reference_reproduces_transformers_gpt2():
    """The reference below is GPT2LMHeadModel: it gives transformers' own fixture logits."""
    tokens, want = reference("gpt2")
    np.testing.assert_allclose(_gpt2_logits(FIXTURES / "gpt2", tokens), want, rtol=0, atol=ATOL)


def _bpe(text: str, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE trained on `text` with only the bytes it contains (so its vocabulary
    fits the 256 of the GPT-2 fixture)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.train_from_iterator([text], trainer)
    return HFTokenizer.from_object(tok)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """The GPT-2 fixture with a tokenizer beside it, fine-tuned 3 steps on data=2 × fsdp=2 ×
    tensor=2 along the CLI's path (resolve, build_trainer, fit, export)."""
    tmp = tmp_path_factory.mktemp("finetune")
    source = tmp / "gpt2"
    shutil.copytree(FIXTURES / "gpt2", source)
    text = stdlib_corpus(40_000).decode("utf-8", errors="replace")
    _bpe(text[:8000], 200).save(str(source))
    (tmp / "corpus.txt").write_text(text)
    argv = ["train", "--init-from", f"hf:{source}", "--export-hf", str(tmp / "tuned")]
    argv += ["--mesh", "data=2,fsdp=2,tensor=2", "--strategy", "fsdp+tp", "--steps", "3"]
    argv += ["--data.source", "text", "--data.path", str(tmp / "corpus.txt")]
    argv += ["--data.seq-len", "32", "--data.batch-size", "8", "--data.val-fraction", "0"]
    argv += ["--no-save", "--no-progress", "--sample-tokens", "0", "--lr", "1e-2"]
    job = finetune.resolve(cli.parse(argv), given(argv[1:], TrainJob))
    trainer = build_trainer(job, say=lambda *a: None)
    start = jax.device_get(trainer.state.params)
    trainer.fit()
    tokenizer = load_tokenizer(job.data.tokenizer)
    finetune.export(trainer, job.export_hf, tokenizer=tokenizer)
    params = jax.device_get(trainer.state.params)
    return dict(job=job, params=params, start=start, source=source, tuned=tmp / "tuned")


@pytest.mark.slow  # about 25 s with its fixture on 2 loaded cores: one fsdp+tp compile
def test_import_train_export_matches_gpt2_reference(finetuned):
    source, tuned = finetuned["source"], finetuned["tuned"]
    # The run took its model from config.json and its tokenizer from tokenizer.json, and
    # started from the checkpoint's weights, not an initialiser's.
    saved, fixture = hf.load_pretrained(source)
    assert finetuned["job"].gpt == saved
    assert finetuned["job"].data.tokenizer == str((source / "tokenizer.json").absolute())
    start = jax.tree.leaves(finetuned["start"])
    for a, b in zip(start, jax.tree.leaves(fixture), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    trained = finetuned["params"]
    moved = [
        float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(trained), start, strict=True)
    ]
    assert min(moved) > 1e-4, moved  # every tensor trained
    # The export: GPT-2's math on its files gives the trained model's logits, and its
    # tokenizer is the one the run used.
    tokens = np.random.default_rng(0).integers(0, 200, size=(2, 32)).astype(np.int32)
    logits = lambda params: np.asarray(forward(saved)(params, tokens))[..., :256]  # noqa: E731
    ours = logits(trained)
    np.testing.assert_allclose(_gpt2_logits(tuned, tokens), ours, rtol=0, atol=ATOL)
    assert (tuned / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    # `meshtrain generate` reads the export with its tokenizer.
    loaded, tok = gen.load(f"hf:{tuned}")
    assert tok.vocab_size == 200 and tok.encode("def ") == load_tokenizer(str(source)).encode(
        "def "
    )
    np.testing.assert_allclose(
        logits(nnx.to_pure_dict(nnx.state(loaded, nnx.Param))), ours, rtol=0, atol=ATOL
    )


def test_model_flags_keep_training_choices_and_refuse_the_shape(capsys, tmp_path):
    gpt2 = FIXTURES / "gpt2"
    argv = ["train", "--init-from", f"hf:{gpt2}", "--gpt.remat", "full", "--gpt.d-model", "128"]
    job = finetune.resolve(cli.parse(argv[:-2]), given(argv[1:-2], TrainJob))
    assert job.gpt == dataclasses.replace(hf.load_pretrained(gpt2)[0], remat="full")
    bytes_flag = [*argv[:3], "--data.tokenizer", "bytes"]  # given, so kept
    kept = finetune.resolve(cli.parse(bytes_flag), given(bytes_flag[1:], TrainJob))
    assert kept.data.tokenizer == "bytes"
    # 128 is also the CLI's default d_model: the flag given on the command line still counts.
    err = _error(capsys, [*argv, "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert "--gpt.d-model 128 (the checkpoint has 64) contradicts" in err and "drop the flag" in err
    assert not (tmp_path / "run").exists()


def _nucleus_reference(logits, top_k, top_p):
    """The kept set by definition: the k largest, then the fewest largest reaching mass p."""
    order = np.argsort(-logits, kind="stable")
    keep = order[:top_k] if top_k else order
    p = np.exp(logits[keep] - logits[keep].max())
    p /= p.sum()
    n = int(np.searchsorted(np.cumsum(p), top_p) + 1) if top_p < 1 else len(keep)
    return set(keep[:n].tolist())


def test_top_k_top_p_keep_the_tokens_their_definition_names():
    probs = np.array([0.5, 0.3, 0.15, 0.05])  # by hand: mass 0.5, 0.8, 0.95, 1.0
    logits = jnp.log(jnp.asarray(probs))
    for top_k, top_p, want in [
        (0, 0.7, [0.625, 0.375, 0, 0]),  # 0.5 < 0.7 ≤ 0.8: two tokens, renormalised
        (0, 0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (0, 0.4, [1, 0, 0, 0]),  # the most probable token always stays
        (3, 1.0, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (3, 0.6, [0.625, 0.375, 0, 0]),  # top-k first: 0.5/0.95 < 0.6
    ]:
        got = jax.nn.softmax(filter_logits(logits, top_k=top_k, top_p=top_p))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 2, (16, 50)).astype(np.float32)  # fresh random rows, checked by definition
    for top_k, top_p in [(0, rng.uniform(0.05, 1)), (7, rng.uniform(0.05, 1)), (4, 1.0)]:
        kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(x), top_k=top_k, top_p=top_p)))
        for row, keep in zip(x, kept, strict=True):
            assert set(np.flatnonzero(keep)) == _nucleus_reference(row, top_k, top_p)
    # Draws follow the filtered distribution: 20k samples within 5 standard errors.
    keys = jax.random.split(jax.random.key(0), 20_000)
    filtered = filter_logits(logits, top_p=0.85)
    draws = np.asarray(jax.vmap(lambda k: jax.random.categorical(k, filtered))(keys))
    freq = np.bincount(draws, minlength=4) / len(draws)
    want = np.array([0.5, 0.3, 0.15, 0]) / 0.95
    assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / len(draws)) + 1e-9)


def _error(capsys, argv) -> str:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err + out, err
    return lines[0]


def test_bad_fine_tune_inputs_are_one_line_before_anything_runs(capsys, tmp_path):
    gpt2 = f"hf:{FIXTURES / 'gpt2'}"
    run = ["--run-dir", str(tmp_path / "run"), "--no-progress"]
    err = _error(capsys, ["train", "--init-from", f"hf:{tmp_path}", *run])
    assert f"{tmp_path} has no config.json" in err and "Hugging Face model directory" in err
    err = _error(capsys, ["train", "--init-from", str(FIXTURES / "gpt2"), *run])
    assert "give hf:PATH" in err
    err = _error(
        capsys, ["train", "--init-from", gpt2, "--export-hf", str(FIXTURES / "gpt2"), *run]
    )
    assert "already holds a model" in err
    err = _error(capsys, ["generate", gpt2, "--top-p", "1.5"])
    assert "top_p=1.5: must be in (0, 1]" in err
    err = _error(capsys, ["generate", str(tmp_path)])
    assert "no meshtrain checkpoint there" in err
    assert not (tmp_path / "run").exists()


def test_given_params_must_fit_the_model():
    """`Trainer(params=...)` / `init_train_state(params=...)` refuses another model's tree."""
    import optax

    from meshtrain.layout import rules_for
    from meshtrain.mesh import make_mesh
    from meshtrain.state import init_train_state

    cfg, params = hf.load_pretrained(FIXTURES / "gpt2")
    mesh = make_mesh("data=8")
    smaller = dataclasses.replace(cfg, n_layers=1)
    with pytest.raises(ValueError, match="params do not fit the model"):
        init_train_state(lambda: smaller.build(rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh,
                         rules_for("dp", mesh), params)  # fmt: skip
