"""Values inside files are checked like flags: a wrong type, a negative count, a non-finite
number, a missing key or unreadable JSON in a Hugging Face ``config.json``, a ``--config`` file,
a corpus manifest or a tiktoken sidecar is one line naming the file and the key, with a fix for
the file; on the command line, exit code 2 before anything is built."""

import base64
import json
import math
import shutil

import numpy as np
import pytest
from _hf_helpers import copy, edit_config

from meshtrain import filevalues, hf
from meshtrain.cli import main, parse
from meshtrain.data import load_tokenizer, prepare_corpus
from meshtrain.data.tokens import TokenCorpus
from meshtrain.filevalues import Key
from meshtrain.problem import Problem, RunCheckError

RANDOM = ("str", "frac", "neg")  # a case's value drawn afresh (see `_draw`)
DROP = object()  # a case's value: remove the key
BROKEN = object()  # a case's value: write text that is not JSON
EOS = "<|endoftext|>"
FIX = {
    "hf": "fix the file, or download the model again",
    "config": "fix the file",
    "manifest": "restore the file, or prepare the corpus again: meshtrain prepare FILES --out",
    "tiktoken": "fix the file, or remove it",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared corpus of a few random byte documents."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdef "), 40)) for _ in range(20)]
    (root / "notes.txt").write_text("\n".join(words))
    prepare_corpus([str(root / "notes.txt")], str(root / "out"), progress=False)
    return root / "out"


def _reader(kind, tmp_path, corpus):
    """(the file, a function that reads it the way meshtrain does) for reader `kind`."""
    if kind == "hf":
        path = copy(tmp_path, "llama")
        return path / "config.json", lambda: hf.load_pretrained(path)
    if kind == "config":
        file = tmp_path / "plan.json"
        file.write_text(json.dumps({"steps": 5, "lr": 0.01, "mesh": "data=8"}))
        return file, lambda: parse(["train", "--config", str(file)])
    if kind == "tiktoken":
        ranks = "\n".join(f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256))
        (tmp_path / "bytes.tiktoken").write_text(ranks)
        sidecar = tmp_path / "tiktoken_config.json"
        sidecar.write_text(json.dumps({"special_tokens": {EOS: 256}, "eos_token": EOS}))
        return sidecar, lambda: load_tokenizer(str(tmp_path / "bytes.tiktoken"))
    out = tmp_path / "corpus"
    shutil.copytree(corpus, out)
    return out / "manifest.json", lambda: TokenCorpus(str(out))


def _edit(file, key, value) -> None:
    """Sets `key` (``tokenizer.vocab_size`` inside an object) of the JSON `file` to `value`."""
    if value is BROKEN:
        file.write_text('{\n "steps": 3,\n "lr": ,\n}')
        return
    values = json.loads(file.read_text())
    inner, _, name = key.rpartition(".")
    where = values[inner] if inner in values else values
    name = name if inner in values else key
    if value is DROP:
        where.pop(name)
    else:
        where[name] = value
    file.write_text(json.dumps(values))


def _draw(rng):
    """Fresh wrong values: a count as a string, a fraction, a negative count."""
    n = int(rng.integers(2, 500))
    return {"str": str(n), "frac": n + 0.5, "neg": -n}


# (reader, what is wrong, key, value (a name of `_draw`, or the value), words of the line).
CASES = [
    ("hf", "string", "hidden_size", "str", "must be an integer, not a string (write it without"),
    ("hf", "bool", "num_hidden_layers", True, "must be an integer, not true/false"),
    ("hf", "fraction", "num_attention_heads", "frac", "must be a whole number"),
    ("hf", "negative", "num_hidden_layers", "neg", "must be a positive integer"),
    ("hf", "non-finite", "rms_norm_eps", math.inf, "must be a finite number"),
    ("hf", "not a bool", "tie_word_embeddings", "false", "must be true or false (write it"),
    ("hf", "config refuses", "num_key_value_heads", 3, "does not divide n_heads=4"),
    ("hf", "missing", "vocab_size", DROP, "missing; add it"),
    ("hf", "unreadable", "", BROKEN, "not valid JSON at line 3 column 8"),
    ("config", "string", "steps", "str", "must be an integer, not a string (write it without"),
    ("config", "bool", "lr", True, "must be a number, not true/false"),
    ("config", "fraction", "steps", "frac", "must be a whole number"),
    ("config", "negative", "steps", "neg", "must be a positive integer; e.g. steps=300"),
    ("config", "non-finite", "lr", math.nan, "must be a finite number"),
    ("config", "unknown key", "stpes", 3, "not a flag of this command (did you mean steps?)"),
    ("config", "unreadable", "", BROKEN, "not valid JSON at line 3 column 8"),
    ("manifest", "string", "tokenizer.vocab_size", "str", "must be an integer, not a string"),
    ("manifest", "bool", "num_tokens", True, "must be an integer, not true/false"),
    ("manifest", "fraction", "num_documents", "frac", "must be a whole number"),
    ("manifest", "negative", "num_tokens", "neg", "must be an integer ≥ 0"),
    ("manifest", "non-finite", "max_id", math.inf, "must be a finite integer"),
    ("manifest", "missing", "input_hash", DROP, "missing; add it"),
    ("manifest", "unreadable", "", BROKEN, "not valid JSON at line 3 column 8"),
    ("tiktoken", "string", f"special_tokens.{EOS}", "str", "must be an integer, not a string"),
    ("tiktoken", "negative", f"special_tokens.{EOS}", "neg", "must be an integer ≥ 0"),
    ("tiktoken", "not a string", "pattern", 3, "must be a string"),
    ("tiktoken", "unreadable", "", BROKEN, "not valid JSON at line 3 column 8"),
]


@pytest.mark.parametrize(
    ("reader", "wrong", "key", "value", "words"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_a_wrong_value_in_a_file_is_one_line_naming_the_file_and_key(
    tmp_path, corpus, reader, wrong, key, value, words
):
    file, load = _reader(reader, tmp_path, corpus)
    if value in RANDOM:
        value = _draw(np.random.default_rng())[value]
    _edit(file, key, value)
    with pytest.raises(ValueError) as e:
        load()
    line = str(e.value)
    assert "\n" not in line and words in line, line
    assert FIX[reader] in line, line
    if value is BROKEN:
        assert str(file) in line.split(": not valid JSON")[0], line
    elif value is DROP:
        assert line.startswith(f"{file}: {key}: missing"), line
    else:
        assert line.startswith(f"{file}: {key}={json.dumps(value)}: "), line


def test_values_of_the_right_kind_pass_and_whole_floats_become_ints(tmp_path):
    path = copy(tmp_path, "llama")
    edit_config(path, num_hidden_layers=2.0, rms_norm_eps=1, tie_word_embeddings=False)
    cfg, _ = hf.load_pretrained(path)
    assert cfg.n_layers == 2 and isinstance(cfg.n_layers, int) and cfg.norm_eps == 1.0
    keys = {"n": Key(int, 1), "x": Key(float, 0, strict=True), "s": Key(str, null=True)}
    rng = np.random.default_rng()
    n, x = int(rng.integers(1, 99)), float(rng.uniform(0.1, 9))
    got = filevalues.checked({"n": float(n), "x": x, "s": None, "other": "kept"}, keys, "f", "")
    assert got == {"n": n, "x": x, "s": None, "other": "kept"} and isinstance(got["n"], int)
    for bad in ({"n": 0}, {"x": 0.0}, {"x": "1"}, {"s": 3}):
        with pytest.raises(RunCheckError):
            filevalues.checked({"n": n, "x": x} | bad, keys, "f", "")


def test_relabel_words_a_config_problem_for_the_file_and_leaves_others_alone():
    keys = {"num_hidden_layers": Key(int, field="gpt.n_layers")}
    error = RunCheckError(
        [
            Problem("gpt.n_layers", -2, "must be a positive integer; e.g. --gpt.n-layers 4"),
            Problem("steps", 0, "must be a positive integer; e.g. --steps 300"),
        ]
    )
    values = {"num_hidden_layers": -2}
    fix = "fix the file"
    out = filevalues.relabel(error, values, keys, "config.json", fix, flag_fix="or --{flag}")
    assert str(out).splitlines() == [
        "config.json: num_hidden_layers=-2: must be a positive integer; fix the file (or "
        "--gpt.n-layers)",
        "steps=0: must be a positive integer; e.g. --steps 300",
    ]


def test_a_command_line_flag_overrides_a_wrong_value_of_the_file(tmp_path):
    file = tmp_path / "plan.json"
    file.write_text(json.dumps({"steps": 0, "lr": "fast", "mesh": "data=8"}))
    job = parse(["train", "--config", str(file), "--steps", "7", "--lr", "0.25"])
    assert (job.train.steps, job.optim.lr, job.mesh) == (7, 0.25, "data=8")
    with pytest.raises(ValueError, match=r"^steps=-1: must be a positive integer; e\.g\. --steps"):
        parse(["train", "--config", str(file), "--steps", "-1", "--lr", "0.25"])  # the flag's


def _cli(capsys, argv) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_each_reader_refuses_through_the_cli_with_exit_2(tmp_path, corpus, capsys):
    path = copy(tmp_path, "llama")
    edit_config(path, num_hidden_layers=-2)
    code, err = _cli(capsys, ["train", "--init-from", f"hf:{path}", "--no-save"])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"meshtrain train: error: {path / 'config.json'}: num_hidden_layers=-2: must be a "
        "positive integer; fix the file (or pass --gpt.n-layers when not using --init-from)"
    ), err
    file = tmp_path / "plan.json"
    file.write_text(json.dumps({"mesh": "data=0"}))
    code, err = _cli(capsys, ["train", "--config", str(file), "--no-save"])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f'meshtrain train: error: {file}: mesh="data=0": mesh.data=0: '), err
    assert "fix the file (or give --mesh on the command line" in err[0], err
    out = tmp_path / "corpus"
    shutil.copytree(corpus, out)
    _edit(out / "manifest.json", "tokenizer.vocab_size", "256")
    argv = ["train", "--data.source", "tokens", "--data.path", str(out), "--no-save"]
    code, err = _cli(capsys, argv)
    assert code == 2 and len(err) == 1, err
    assert f'{out / "manifest.json"}: tokenizer.vocab_size="256": must be an integer' in err[0]
