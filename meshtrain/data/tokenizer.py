"""Tokenizers: the embedded byte-level default, a Hugging Face ``tokenizer.json`` (through the
`tokenizers` library), a SentencePiece ``.model`` and a tiktoken ``.tiktoken`` BPE-ranks file
(each where its package is importable).

Every tokenizer has the same small surface (`Tokenizer`): ``name``, ``vocab_size``,
``eos_id``, ``encode``, ``encode_batch``, ``decode``, ``save`` and ``fingerprint`` (a hash of
its full definition, which `meshtrain.data.prepare` keys its cache on).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import shutil
from typing import Protocol, runtime_checkable

from meshtrain.filevalues import Key, checked, read_json

# Special tokens that end a document, in the spellings common tokenizers use.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


@runtime_checkable
class Tokenizer(Protocol):
    """What meshtrain needs of a tokenizer.

    Attributes:
        name: a short description (``"bytes"``, or the file it came from).
        vocab_size: ids are in ``[0, vocab_size)``.
        eos_id: the end-of-document id, or None when the tokenizer has none.
        fingerprint: a hex digest of the tokenizer's whole definition.
    """

    name: str
    vocab_size: int
    eos_id: int | None
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids) -> str: ...

    def save(self, directory: str) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no end-of-document id, nothing to download."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None
    fingerprint = hashlib.sha256(b"meshtrain byte tokenizer v1").hexdigest()

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Bytes back to text; invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: str) -> None:
        """Writes nothing: ``"bytes"`` is always available."""


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``), through the `tokenizers` library.

    Text is encoded without the tokenizer's own special tokens (no BOS); documents are
    separated with `eos_id` by whoever concatenates them.
    """

    def __init__(self, tokenizer, name: str, eos_id: int | None):
        self._tok, self.name, self.eos_id = tokenizer, name, eos_id
        # ids need not be contiguous (a word-level vocabulary, added tokens placed far out):
        # the bound is the largest id + 1, not the count.
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(ids, default=-1) + 1
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()

    @classmethod
    def from_file(cls, path: str) -> HFTokenizer:
        """Loads a ``tokenizer.json``; the EOS token comes from a ``tokenizer_config.json``
        beside it, else from the common spellings (`EOS_NAMES`)."""
        from tokenizers import Tokenizer as RustTokenizer

        try:
            tok = RustTokenizer.from_file(path)
        except Exception as e:  # the library raises plain Exceptions with a Rust message
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"data.tokenizer={path!r}: not a Hugging Face tokenizer.json ({reason}); "
                "give a tokenizer.json saved by `tokenizers` or `transformers`, or 'bytes'"
            ) from None
        return cls(tok, path, _eos_id(tok, os.path.dirname(path)))

    @classmethod
    def from_object(cls, tokenizer, name: str = "tokenizer.json") -> HFTokenizer:
        """Wraps an in-memory `tokenizers.Tokenizer` (e.g. one just trained)."""
        return cls(tokenizer, name, _eos_id(tokenizer, None))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without added special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (the library's own batch call)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens kept."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str) -> None:
        """Writes ``directory/tokenizer.json``."""
        os.makedirs(directory, exist_ok=True)
        self._tok.save(os.path.join(directory, "tokenizer.json"))


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` (needs the `sentencepiece` package)."""

    def __init__(self, path: str):
        import sentencepiece

        self._path, self.name = path, path
        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        self.eos_id = eos if eos >= 0 else None
        with open(path, "rb") as f:
            self.fingerprint = hashlib.sha256(f.read()).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        return list(self._sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text."""
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def decode(self, ids) -> str:
        """Text of `ids`."""
        return self._sp.decode([int(i) for i in ids])

    def save(self, directory: str) -> None:
        """Copies the model to ``directory/tokenizer.model``."""
        os.makedirs(directory, exist_ok=True)
        shutil.copyfile(self._path, os.path.join(directory, "tokenizer.model"))


# The pre-tokeniser split of OpenAI's cl100k_base encoding: the default for a .tiktoken file,
# whose ranks alone do not say how text is split before the merges.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
TIKTOKEN_SIDECAR = "tiktoken_config.json"
_SIDECAR_KEYS = {"pattern": Key(str), "special_tokens": Key(dict), "eos_token": Key(str, null=True)}
_SIDECAR_FIX = "fix the file, or remove it"


class TiktokenTokenizer:
    """A tiktoken BPE-ranks file (``<base64 token> <rank>`` a line), through `tiktoken`.

    The ranks alone do not say how text is split nor which special tokens exist; a
    ``tiktoken_config.json`` beside the file may give ``pattern`` (the split regex, default
    `CL100K_PATTERN`), ``special_tokens`` ({text: id}, default ``<|endoftext|>`` at the id
    after the largest rank) and ``eos_token`` (default ``<|endoftext|>`` when it is special).
    """

    def __init__(self, path: str):
        import tiktoken

        with open(path, "rb") as f:
            data = f.read()
        ranks = _tiktoken_ranks(data, path)
        config = _tiktoken_config(os.path.join(os.path.dirname(path), TIKTOKEN_SIDECAR), path)
        pattern = config.get("pattern", CL100K_PATTERN)
        special = config.get("special_tokens", {EOS_NAMES[0]: max(ranks.values()) + 1})
        eos = config.get("eos_token", EOS_NAMES[0] if EOS_NAMES[0] in special else None)
        if eos is not None and eos not in special:
            raise ValueError(
                f"data.tokenizer={path!r}: eos_token {eos!r} of {TIKTOKEN_SIDECAR} is not one "
                f"of its special_tokens {sorted(special)}; add it there"
            )
        try:
            self._enc = tiktoken.Encoding(
                os.path.basename(path),
                pat_str=pattern,
                mergeable_ranks=ranks,
                special_tokens=special,
            )
        except ValueError as e:  # e.g. a regex the Rust engine refuses
            raise ValueError(
                f"data.tokenizer={path!r}: tiktoken refused the file or its "
                f"{TIKTOKEN_SIDECAR} ({str(e).splitlines()[0]})"
            ) from None
        self._data, self._config = data, {"pattern": pattern, "special_tokens": special}
        self._config["eos_token"] = eos
        self.name = path
        self.vocab_size = int(self._enc.n_vocab)
        self.eos_id = None if eos is None else int(special[eos])
        h = hashlib.sha256(data)
        h.update(json.dumps(self._config, sort_keys=True).encode("utf-8"))
        self.fingerprint = h.hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token spellings in it are ordinary text."""
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text."""
        return [self._enc.encode_ordinary(t) for t in texts]

    def decode(self, ids) -> str:
        """Text of `ids`; bytes that are not UTF-8 become U+FFFD."""
        return self._enc.decode([int(i) for i in ids])

    def save(self, directory: str) -> None:
        """Writes ``directory/tokenizer.tiktoken`` and its ``tiktoken_config.json``."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer.tiktoken"), "wb") as f:
            f.write(self._data)
        with open(os.path.join(directory, TIKTOKEN_SIDECAR), "w", encoding="utf-8") as f:
            json.dump(self._config, f, indent=1)


def _tiktoken_ranks(data: bytes, path: str) -> dict[bytes, int]:
    """{token bytes: rank} of a .tiktoken file; every single byte must have a rank."""
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(
                f"data.tokenizer={path!r}: line {n} is not '<base64 token> <rank>'; give a "
                "tiktoken BPE-ranks file"
            ) from None
    missing = 256 - sum(1 for t in ranks if len(t) == 1)
    if missing:
        raise ValueError(
            f"data.tokenizer={path!r}: {missing} of the 256 single bytes have no rank; a "
            "tiktoken BPE-ranks file must rank every byte"
        )
    return ranks


def _tiktoken_config(path: str, ranks_path: str) -> dict:
    """The sidecar's settings ({} when there is none), each value checked (one line naming the
    file and the key)."""
    if not os.path.isfile(path):
        return {}
    config = read_json(path, _SIDECAR_FIX)
    unknown = set(config) - set(_SIDECAR_KEYS)
    if unknown:
        raise ValueError(
            f"data.tokenizer={ranks_path!r}: {path} has unknown keys {sorted(unknown)}; it "
            "takes pattern, special_tokens and eos_token"
        )
    config = checked(config, _SIDECAR_KEYS, path, _SIDECAR_FIX)
    if "special_tokens" in config:  # token text → id
        special = config["special_tokens"]
        ids = {text: Key(int, 0) for text in special}
        fix = _SIDECAR_FIX
        config["special_tokens"] = checked(special, ids, path, fix, prefix="special_tokens.")
    return config


def train_bpe(texts, vocab_size: int, eos: str = "<|endoftext|>") -> HFTokenizer:
    """Trains a byte-level BPE tokenizer (GPT-2's scheme) on `texts`; nothing is downloaded.

    Args:
        texts: an iterable of strings.
        vocab_size: the vocabulary size to reach (at least 257: the 256 byte symbols and `eos`).
        eos: the end-of-document token, added as a special token.

    Returns:
        an `HFTokenizer` whose ``decode(encode(text)) == text`` for any text.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"train_bpe vocab_size={vocab_size!r}: must be an integer >= 257")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer.from_object(tok, f"bpe-{vocab_size}")


def _eos_id(tok, directory: str | None) -> int | None:
    """The EOS id: ``eos_token`` of a tokenizer_config.json in `directory`, else a known name."""
    names = list(EOS_NAMES)
    config = os.path.join(directory, "tokenizer_config.json") if directory is not None else ""
    if config and os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError):
            eos = None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    return None


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names.

    Args:
        spec: ``"bytes"`` (the embedded byte-level default); a path to a Hugging Face
            ``tokenizer.json``; a SentencePiece ``.model`` file (needs `sentencepiece`); a
            tiktoken ``.tiktoken`` ranks file (needs `tiktoken`; see `TiktokenTokenizer`); or
            a directory holding a ``tokenizer.json``, ``tokenizer.model`` or
            ``tokenizer.tiktoken`` (looked for in that order).

    Returns:
        a `Tokenizer`.

    Raises:
        ValueError: one line naming the spec and what was expected.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"data.tokenizer={spec!r}: give 'bytes' or a path to a tokenizer.json (or a "
            "directory holding one)"
        )
    if spec == "bytes":
        return ByteTokenizer()
    path = spec
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken"):
            if os.path.isfile(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
        else:
            raise ValueError(
                f"data.tokenizer={spec!r}: the directory holds no tokenizer.json (nor "
                "tokenizer.model, tokenizer.tiktoken); give the directory a tokenizer saved with "
                "tokenizer.save(...) / save_pretrained, or use 'bytes'"
            )
    if not os.path.isfile(path):
        raise ValueError(
            f"data.tokenizer={spec!r}: no such file or directory; give 'bytes' or a path to "
            "a tokenizer.json"
        )
    if path.endswith(".model"):
        try:
            import sentencepiece  # noqa: F401
        except ImportError:
            raise ValueError(
                f"data.tokenizer={spec!r}: a SentencePiece model needs the sentencepiece "
                "package (pip install sentencepiece), or convert it to a tokenizer.json"
            ) from None
        try:
            return SentencePieceTokenizer(path)
        except (OSError, RuntimeError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"data.tokenizer={spec!r}: not a SentencePiece model ({reason}); give a valid "
                ".model or a tokenizer.json"
            ) from None
    if path.endswith(".tiktoken"):
        try:
            import tiktoken  # noqa: F401
        except ImportError:
            raise ValueError(
                f"data.tokenizer={spec!r}: a .tiktoken file needs the tiktoken package "
                "(pip install tiktoken), or convert it to a tokenizer.json"
            ) from None
        return TiktokenTokenizer(path)
    return HFTokenizer.from_file(path)
