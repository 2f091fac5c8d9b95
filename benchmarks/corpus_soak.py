"""Prepared corpora with damaged bytes: are they refused, and what does the check cost?

Two measurements, one JSON line each on stdout (progress on stderr):

- the soak (default): prepare a small corpus (JSONL documents from this Python's standard
  library and a byte-level BPE trained on them, so the directory holds ``manifest.json``,
  ``tokens.bin``, ``documents.bin`` and ``tokenizer.json``), then `--trials` times: copy it,
  xor one byte at a random offset of a random one of its files with a random non-zero value,
  and open the copy as ``meshtrain train`` does (`make_dataset`, then one batch). A trial is

  - ``detected``: refused with a one-line ValueError naming the damaged file;
  - ``harmless``: it opened, and every file but the manifest is the intact corpus's byte for
    byte and the manifest's content is equal (a flip between two JSON whitespace characters);
  - ``silent``: it opened with something the intact corpus does not have, the failure the
    digests are there to prevent;
  - ``other``: anything else (another exception; a refusal of several lines, or naming no file).

- the cost (``--cost``): prepare a corpus of `--gb` GB of byte-level tokens, timing the digests
  `prepare_corpus` computes as it writes, and the no-op re-run (which checks them); then open
  it (`TokenCorpus`, which streams every file through its digest) warm (the files in the page
  cache) and cold (their pages dropped with ``posix_fadvise`` first), beside an unchecked open
  of the same files (a manifest without digests), and read the token file in 8 MiB blocks
  with no hash and with crc32, sha256 and blake2b.

    python benchmarks/corpus_soak.py             # 50 trials: seconds on 2 cores
    python benchmarks/corpus_soak.py --trials 5  # a quick check
    python benchmarks/corpus_soak.py --cost      # 1 GB: under a minute, about 2 GB of disk

The test suite runs a few trials with these functions (tests/test_corpus_integrity.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from datetime import UTC, datetime
from importlib.metadata import version

from _common import emit, logger

log = logger("corpus_soak")
FILES = ("manifest.json", "tokens.bin", "documents.bin", "tokenizer.json")
OUTCOMES = ("detected", "harmless", "silent", "other")
BLOCK = 8 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=50, help="damaged copies to open")
    p.add_argument("--seed", type=int, default=None, help="the trials' seed (default: drawn)")
    p.add_argument("--cost", action="store_true", help="time the check on a large corpus")
    p.add_argument("--gb", type=float, default=1.0, help="the large corpus's tokens, in GB")
    p.add_argument("--workdir", default=None, help="where the corpora go (default: a temp dir)")
    return p.parse_args(argv)


def small_corpus(root: str, seed: int) -> str:
    """Prepares about 200 KB of standard-library documents with a BPE trained on them into
    ``root/corpus``; returns that directory."""
    from meshtrain.data import prepare_corpus, stdlib_corpus, train_bpe

    text = stdlib_corpus(2_000_000).decode("utf-8", errors="replace")
    rng = random.Random(seed)
    starts = [rng.randrange(len(text) - 2000) for _ in range(120)]
    docs = [text[s : s + rng.randrange(1, 2000)] for s in starts]
    train_bpe(docs, vocab_size=320).save(os.path.join(root, "tok"))
    with open(os.path.join(root, "docs.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    out = os.path.join(root, "corpus")
    tok = os.path.join(root, "tok")
    prepare_corpus([os.path.join(root, "docs.jsonl")], out, tokenizer=tok, progress=False)
    return out


def open_as_a_run(directory: str) -> dict:
    """Opens `directory` as the ``tokens`` source of a run does and reads one batch."""
    from meshtrain.data import DataConfig, make_dataset

    config = DataConfig(source="tokens", path=directory, seq_len=32, batch_size=4, seed=1)
    it = make_dataset(config).train_iter()
    try:
        return next(it)
    finally:
        it.close()


def _same_as(intact: str, copy: str) -> bool:
    """Whether `copy` holds what `intact` does: equal manifests' content, other files' bytes."""
    for name in os.listdir(intact):
        with open(os.path.join(intact, name), "rb") as a, open(os.path.join(copy, name), "rb") as b:
            left, right = a.read(), b.read()
        if name.endswith(".json"):
            try:
                if json.loads(left) == json.loads(right):
                    continue
            except ValueError:
                return False
        if left != right:
            return False
    return True


def trial(intact: str, copy: str, rng: random.Random) -> dict:
    """Damages one byte of a fresh copy of `intact` and opens it; the trial's record."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(intact, copy)
    name = rng.choice([n for n in FILES if os.path.isfile(os.path.join(intact, n))])
    path = os.path.join(copy, name)
    offset, flip = rng.randrange(os.path.getsize(path)), rng.randrange(1, 256)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ flip]))
    record = {"file": name, "offset": offset, "xor": flip}
    try:
        open_as_a_run(copy)
    except ValueError as e:
        message = str(e).replace(copy, "corpus")  # the message, free of this machine's paths
        path = path.replace(copy, "corpus")
        one_line = "\n" not in message and path in message
        record.update(outcome="detected" if one_line else "other", message=message)
        return record
    except Exception as e:  # noqa: BLE001 - any other failure is a finding, not a crash
        record.update(outcome="other", message=f"{type(e).__name__}: {e}".replace(copy, "corpus"))
        return record
    record["outcome"] = "harmless" if _same_as(intact, copy) else "silent"
    return record


def soak(trials: int, seed: int, root: str) -> dict:
    """`trials` damaged copies of a small corpus prepared in `root`, opened; the tallies.

    Returns:
        the counts per outcome, overall and per file, the records of every trial that was not
        detected, and one refusal per file.
    """
    rng = random.Random(seed)
    intact = small_corpus(root, seed)
    open_as_a_run(intact)  # the intact corpus opens
    counts = dict.fromkeys(OUTCOMES, 0)
    by_file: dict[str, dict[str, int]] = {}
    undetected, examples = [], {}
    for i in range(trials):
        record = trial(intact, os.path.join(root, "copy"), rng)
        counts[record["outcome"]] += 1
        per = by_file.setdefault(record["file"], dict.fromkeys(OUTCOMES, 0))
        per[record["outcome"]] += 1
        if record["outcome"] != "detected":
            undetected.append(record)
        elif record["file"] not in examples:
            examples[record["file"]] = record["message"]
        log(f"trial {i}: {record['outcome']} ({record['file']} byte {record['offset']})")
    sizes = {n: os.path.getsize(os.path.join(intact, n)) for n in sorted(os.listdir(intact))}
    return {
        "trials": trials,
        **counts,
        "by_file": by_file,
        "file_bytes": sizes,
        "not_detected": undetected,
        "example_refusals": examples,
    }


def write_jsonl(path: str, gb: float) -> None:
    """About `gb` GB of JSONL documents: the standard library's modules, over and over."""
    from meshtrain.data import stdlib_corpus

    modules = stdlib_corpus(8_000_000).decode("utf-8", errors="replace").split("\n# ==== ")
    lines = "".join(json.dumps({"text": m}) + "\n" for m in modules if m).encode()
    with open(path, "wb") as f:
        while f.tell() < gb * 1e9:
            f.write(lines)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _drop_from_cache(directory: str) -> None:
    """Asks the kernel to drop the page-cache pages of the files in `directory`."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_hashed(path: str, make: Callable | None) -> float:
    """Seconds to read `path` in 8 MiB blocks through ``make()``'s hash (None: no hash)."""
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    t0 = time.perf_counter()
    h = make() if make else None
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            if h is not None:
                h.update(view[:n])
    return time.perf_counter() - t0


class _Crc32:
    """zlib.crc32 behind hashlib's ``update``."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)


def _unchecked_twin(corpus: str, twin: str) -> None:
    """`twin`: hard links to `corpus`'s files under a manifest of the earlier format (none)."""
    os.makedirs(twin)
    for name in ("tokens.bin", "documents.bin"):
        os.link(os.path.join(corpus, name), os.path.join(twin, name))
    with open(os.path.join(corpus, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    manifest.pop("digests")
    manifest["format"] = "meshtrain-tokens/1"
    with open(os.path.join(twin, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def cost(gb: float, root: str) -> dict:
    """Times prepare's digests and the check on opening a corpus of about `gb` GB."""
    from meshtrain.data import digest, prepare_corpus
    from meshtrain.data.tokens import TokenCorpus

    jsonl, corpus = os.path.join(root, "docs.jsonl"), os.path.join(root, "corpus")
    log(f"writing {gb} GB of JSONL")
    write_jsonl(jsonl, gb)
    spent = [0.0]
    update = digest.RunningDigest.update

    def timed_update(self, data) -> None:
        t0 = time.perf_counter()
        update(self, data)
        spent[0] += time.perf_counter() - t0

    digest.RunningDigest.update = timed_update  # type: ignore[method-assign]
    try:
        log("preparing")
        prepare_s = _timed(lambda: prepare_corpus([jsonl], corpus, progress=False))
    finally:
        digest.RunningDigest.update = update  # type: ignore[method-assign]
    again_s = _timed(lambda: prepare_corpus([jsonl], corpus, progress=False))
    os.remove(jsonl)
    sizes = {n: os.path.getsize(os.path.join(corpus, n)) for n in sorted(os.listdir(corpus))}
    log("opening")
    warm = [_timed(lambda: TokenCorpus(corpus)) for _ in range(3)]
    cold = []
    for _ in range(2):
        _drop_from_cache(corpus)
        cold.append(_timed(lambda: TokenCorpus(corpus)))
    twin = os.path.join(root, "unchecked")
    _unchecked_twin(corpus, twin)
    unchecked = [_timed(lambda: TokenCorpus(twin)) for _ in range(3)]
    tokens = os.path.join(corpus, "tokens.bin")
    makers = {"read": None, "crc32": _Crc32, "sha256": hashlib.sha256, "blake2b": hashlib.blake2b}
    log("reading the token file through each hash")
    hashed = {
        k: statistics.median(read_hashed(tokens, m) for _ in range(3)) for k, m in makers.items()
    }
    return {
        "file_bytes": sizes,
        "prepare_s": round(prepare_s, 2),
        "prepare_digest_s": round(spent[0], 3),
        "prepare_again_noop_s": round(again_s, 3),
        "open_checked_warm_s": [round(t, 3) for t in warm],
        "open_checked_cold_s": [round(t, 3) for t in cold],
        "open_unchecked_s": [round(t, 4) for t in unchecked],
        "read_token_file_warm_s": {k: round(v, 3) for k, v in hashed.items()},
        "read_token_file_warm_gb_per_s": {
            k: round(sizes["tokens.bin"] / v / 1e9, 2) for k, v in hashed.items()
        },
    }


def _device() -> str:
    """The CPU, in words."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "")
    except OSError:
        pass
    return f"CPU: {os.cpu_count()} cores ({model}, shared with other jobs)"


def main(argv=None) -> None:
    args = parse_args(argv)
    seed = random.randrange(2**31) if args.seed is None else args.seed
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        if args.cost:
            record = {"benchmark": "corpus_cost", "gb": args.gb, **cost(args.gb, root)}
        else:
            record = {"benchmark": "corpus_soak", "seed": seed, **soak(args.trials, seed, root)}
    emit(
        {
            **record,
            "device": _device(),
            "jax": version("jax"),
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "command": "python benchmarks/corpus_soak.py " + " ".join(sys.argv[1:]),
        }
    )


if __name__ == "__main__":
    main()
