"""Library-level refusals: each mistake is one ValueError line naming the field, flag or file
and the fix, raised before anything is written (every file that existed is unchanged)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import shutil

import numpy as np
import pytest

from meshtrain.data import prepare_corpus

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"


def _hashes(root: pathlib.Path) -> dict[str, str]:
    """Every file under `root` → the sha256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@contextlib.contextmanager
def refused(root: pathlib.Path, *needles: str):
    """Expects one ValueError line holding every needle, and no file under `root` changed,
    added or removed."""
    before = _hashes(root)
    with pytest.raises(ValueError) as e:
        yield
    message = str(e.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    assert _hashes(root) == before


def _text(path: pathlib.Path, body: str = "hello there\nsecond line\n") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return str(path)


def _prepare(inputs, out, **kw) -> dict:
    return prepare_corpus(inputs, str(out), progress=False, workers=1, **kw)


# ---- prepare_corpus: where the corpus may go ---------------------------------------------


def test_prepare_refuses_an_output_inside_its_own_input_and_a_rerun_deletes_nothing(tmp_path):
    source = tmp_path / "src"
    _text(source / "a.txt")
    with refused(tmp_path, "out_dir", "lies inside the input", "outside the inputs"):
        _prepare([str(source)], source / "corpus")
    assert not (source / "corpus").exists()
    # A corpus put there by hand (or by an older meshtrain): a rerun keeps its manifest.
    corpus = _prepare([str(source / "a.txt")], tmp_path / "corpus")
    (tmp_path / "corpus").rename(source / "corpus")
    with refused(tmp_path, "lies inside the input"):
        _prepare([str(source)], source / "corpus")
    assert json.loads((source / "corpus" / "manifest.json").read_text()) == {
        k: v for k, v in corpus.items() if k != "up_to_date"
    }


def test_prepare_refuses_a_training_run_directory(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "10").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    a = _text(tmp_path / "a.txt")
    with refused(tmp_path, f"out_dir={str(run)!r}: holds a training run", "new or empty"):
        _prepare([a], run, overwrite=True)  # overwrite does not apply


def test_prepare_refuses_another_corpus_unless_overwrite(tmp_path):
    a, b = _text(tmp_path / "a.txt"), _text(tmp_path / "b.txt", "other text\n")
    out = tmp_path / "out"
    first = _prepare([a], out)
    with refused(tmp_path, "holds another corpus", "a.txt", "overwrite=True"):
        _prepare([b], out)
    replaced = _prepare([b], out, overwrite=True)
    assert replaced["inputs"][0]["path"] == b and replaced["input_hash"] != first["input_hash"]
    assert (out / "tokens.bin").read_bytes() == b"other text\n"


def test_prepare_rebuilds_an_earlier_corpus_of_the_same_inputs(tmp_path):
    a, out = _text(tmp_path / "a.txt"), tmp_path / "out"
    _prepare([a], out)
    assert _prepare([a], out)["up_to_date"]
    _text(tmp_path / "a.txt", "changed\n")
    again = _prepare([a], out)
    assert not again["up_to_date"] and (out / "tokens.bin").read_bytes() == b"changed\n"


def test_prepare_refuses_a_directory_of_other_files_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    _text(out / "notes.md", "mine\n")
    a = _text(tmp_path / "a.txt")
    with refused(tmp_path, "is not empty", "'notes.md'", "overwrite=True"):
        _prepare([a], out)
    _prepare([a], out, overwrite=True)
    assert (out / "notes.md").read_text() == "mine\n" and (out / "manifest.json").is_file()


def test_prepare_refuses_an_output_path_that_is_a_file(tmp_path):
    target, a = pathlib.Path(_text(tmp_path / "out")), _text(tmp_path / "a.txt")
    with refused(tmp_path, "is a file", "directory"):
        _prepare([a], target)


# ---- a truncated model.safetensors under --init-from hf: -------------------------------


@pytest.mark.parametrize("keep", [0.5, 4 / 1e9])  # cut in the tensors; cut in the header
def test_a_truncated_model_safetensors_is_one_line_naming_the_file(tmp_path, keep):
    from meshtrain import hf

    model = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: max(4, int(len(data) * keep))])
    with refused(tmp_path, str(weights), "truncated or corrupt", "download or save"):
        hf.load_pretrained(model)


# ---- a prepared corpus with token ids past the model's vocabulary ------------------------


def _sparse_tokenizer(directory: pathlib.Path) -> str:
    """A word-level tokenizer.json of 5 tokens whose ids reach 700 (not contiguous)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "[UNK]": 2, "<|endoftext|>": 3, "c": 700}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return str(directory / "tokenizer.json")


def test_a_corpus_with_ids_past_the_model_vocabulary_is_refused_before_training(tmp_path):
    import meshtrain as mt
    from meshtrain.check import check_run
    from meshtrain.data import DataConfig, make_dataset

    spec = _sparse_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "corpus"
    manifest = _prepare([_text(tmp_path / "a.txt", "a b c a\n" * 200)], corpus, tokenizer=spec)
    tokens = np.fromfile(corpus / "tokens.bin", manifest["dtype"])
    assert manifest["max_id"] == tokens.max() == 700 and manifest["dtype"] == "uint16"
    data = make_dataset(DataConfig(source="tokens", path=str(corpus), seq_len=16, batch_size=8))
    assert data.vocab_size == 701
    model = mt.GPTConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    no_dir = mt.TrainConfig(run_dir="")  # no run directory to check
    rules = mt.rules_for("dp")
    problems = check_run(
        mt.RunSpec(model=model, data=data, mesh={"data": 1}, rules=rules, train=no_dir)
    )
    assert [str(p) for p in problems] == [
        f"data.tokenizer={str(corpus / 'tokenizer.json')!r}: the tokenizer has 701 tokens but "
        "the model's vocabulary has 256; raise --gpt.vocab-size to 701, or use a tokenizer of "
        "at most 256 tokens"
    ]
    mesh = mt.make_mesh("data=8")
    with refused(tmp_path, "--gpt.vocab-size"):
        mt.Trainer(model, data, mesh=mesh, rules=mt.rules_for("dp", mesh))


def test_the_run_check_reads_the_corpus_max_id_where_the_tokenizer_undercounts(tmp_path):
    """A corpus whose manifest records ids past its tokenizer's count (an older tokenizer
    count): the data's vocabulary is the ids', and the model's line names its flag."""
    import meshtrain as mt
    from meshtrain.check import check_run
    from meshtrain.data import DataConfig, make_dataset
    from meshtrain.data.digest import with_digests

    corpus = tmp_path / "corpus"
    _prepare([_text(tmp_path / "a.txt", "some text\n" * 30)], corpus)
    manifest = json.loads((corpus / "manifest.json").read_text())
    edited = with_digests({**manifest, "max_id": 299}, manifest["digests"]["files"])  # resealed
    (corpus / "manifest.json").write_text(json.dumps(edited))
    data = make_dataset(DataConfig(source="tokens", path=str(corpus), seq_len=4, batch_size=2))
    model = mt.GPTConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    no_dir = mt.TrainConfig(run_dir="")  # no run directory to check
    rules = mt.rules_for("dp")
    problems = check_run(
        mt.RunSpec(model=model, data=data, mesh={"data": 1}, rules=rules, train=no_dir)
    )
    assert [p.field for p in problems] == ["gpt.vocab_size"], problems
    assert "the data has 300 token ids; raise --gpt.vocab-size to at least 300" in str(problems[0])


# ---- pipeline stages that do not divide the layers ---------------------------------------


@pytest.mark.parametrize("strategy", ["dp", "zero1", "fsdp"])
def test_stages_that_do_not_divide_the_layers_are_one_line_naming_the_layers_flag(strategy):
    from flax import nnx

    import meshtrain as mt
    from meshtrain.check import check_run
    from meshtrain.models.base import DataSpec
    from meshtrain.state import abstract_model

    cfg = mt.GPTConfig(vocab_size=256, d_model=32, n_layers=3, n_heads=2, max_seq_len=16)
    data = DataSpec("lm", 16, 16, 256, None, None, False)
    sizes = dict(pipe=2, data=4)
    abstract = abstract_model(lambda: mt.GPT(cfg, rngs=nnx.Rngs(0)))
    rules = mt.rules_for(strategy, sizes)
    no_dir = mt.TrainConfig(run_dir="")  # no run directory to check
    run = mt.RunSpec(model=cfg, data=data, mesh=sizes, rules=rules, train=no_dir)
    problems = check_run(run, abstract=abstract)
    assert [str(p) for p in problems] == [
        "gpt.n_layers=3: not divisible by pipe × repeats = 2 × 1 = 2: each stage needs whole "
        "layers; use --gpt.n-layers 4 (a multiple of 2), or fewer stages"
    ]
    # A model from a constructor has no config field to name: the line says so plainly, still
    # once (not once per parameter).
    problems = check_run(run.replace(model=None), abstract=abstract)
    assert [p.field for p in problems] == ["layers"], problems


def test_the_trainer_refuses_stages_that_do_not_divide_the_layers_in_one_line(tmp_path):
    import meshtrain as mt
    from meshtrain.data import DataConfig, make_dataset

    cfg = mt.GPTConfig(vocab_size=256, d_model=32, n_layers=3, n_heads=2, max_seq_len=16)
    data = make_dataset(DataConfig(source="synthetic", seq_len=16, batch_size=16))
    mesh = mt.make_mesh("pipe=2,data=4")
    with refused(tmp_path, "gpt.n_layers=3", "--gpt.n-layers 4"):
        mt.Trainer(cfg, data, mesh=mesh, rules=mt.rules_for("fsdp", mesh))


# ---- generate: a prompt longer than the model's context ----------------------------------


def test_generate_refuses_a_prompt_longer_than_the_context(tmp_path):
    from flax import nnx

    import meshtrain as mt
    from meshtrain.data import load_tokenizer
    from meshtrain.generate import generate

    cfg = mt.GPTConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    model, tok = mt.GPT(cfg, rngs=nnx.Rngs(0)), load_tokenizer("bytes")
    with refused(tmp_path, "prompt: 9 tokens", "context of 8 tokens", "at most 8 tokens"):
        generate(model, tok, "123456789", 2)
    assert generate(model, tok, "12345678", 1, temperature=0).startswith("12345678")
