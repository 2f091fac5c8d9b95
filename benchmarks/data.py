"""Data pipeline speed: `prepare` throughput, and the ``tokens`` loader against the train step.

Cases, one JSON line each on stdout (progress on stderr):

- ``prepare``: `mt.prepare_corpus` on `--mb` MB of this Python's standard-library source,
  written as one text file and as a JSONL of one document per module, with the byte-level
  tokenizer and a byte-level BPE (`--vocab` tokens, trained here on the first MB), on 1 and
  2 worker processes. ``mb_per_s`` is input MB over the whole call's wall time (worker start
  included; the no-op re-run's time is ``noop_s``); ``mb_per_cpu_s`` is input MB over the CPU
  seconds of this process and its workers, which a machine shared with other jobs does not
  change as much as the wall time.
- ``loader``: batches/s of the ``tokens`` source at the default job's batch (32 × 128),
  packed and plain, read by one process (all rows: the most one process ever reads).
- ``step``: the default ``meshtrain train`` job's step time (its model, mesh and strategy on 8
  simulated CPU devices), median of `--steps` steps after compiling; each loader line's
  ``ratio`` is loader batches/s × step seconds: how many times faster the loader is than the
  step needs (above 1: the loader is not the bottleneck).

    python benchmarks/data.py           # 16 MB, every case; a few minutes on 2 cores
    python benchmarks/data.py --quick   # 1 MB, fewer cases, a 2-layer model's step
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

from _common import emit, logger, parser

log = logger("data")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser("prepare throughput and loader speed", quick="smoke test: small and fast", steps=10)
    p.add_argument("--mb", type=float, default=16.0, help="MB of text to prepare")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    p.add_argument("--batches", type=int, default=200, help="loader batches to time")
    return p.parse_args(argv)


def write_inputs(root: str, corpus: bytes) -> dict[str, str]:
    """The corpus as one text file and as a JSONL of one document per stdlib module."""
    text = os.path.join(root, "corpus.txt")
    with open(text, "wb") as f:
        f.write(corpus)
    jsonl = os.path.join(root, "corpus.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for doc in corpus.decode("utf-8", errors="replace").split("\n# ==== "):
            if doc:
                f.write(json.dumps({"text": doc}) + "\n")
    return {"text": text, "jsonl": jsonl}


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its finished children."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_prepare(mt, inputs, tokenizers, workers_list, root, env) -> dict[str, str]:
    """Times `prepare_corpus` per case; returns one prepared directory per tokenizer."""
    out_dirs = {}
    for kind, path in inputs.items():
        size = os.path.getsize(path)
        for name, tok in tokenizers.items():
            for workers in workers_list:
                out = os.path.join(root, f"{kind}-{name}-{workers}")
                cpu = _cpu_s()
                start = time.perf_counter()
                manifest = mt.prepare_corpus(
                    path, out, tokenizer=tok, workers=workers, progress=False
                )
                wall = time.perf_counter() - start
                cpu = _cpu_s() - cpu
                start = time.perf_counter()
                again = mt.prepare_corpus(path, out, tokenizer=tok, workers=workers, progress=False)
                noop = time.perf_counter() - start
                assert again["up_to_date"]
                out_dirs.setdefault(name, out)
                emit(
                    {
                        "case": "prepare",
                        "input": kind,
                        "tokenizer": name,
                        "vocab_size": manifest["tokenizer"]["vocab_size"],
                        "workers": workers,
                        "mb": round(size / 1e6, 3),
                        "wall_s": round(wall, 3),
                        "mb_per_s": round(size / 1e6 / wall, 3),
                        "cpu_s": round(cpu, 3),
                        "mb_per_cpu_s": round(size / 1e6 / cpu, 3),
                        "tokens": manifest["num_tokens"],
                        "documents": manifest["num_documents"],
                        "noop_s": round(noop, 3),
                        **env,
                    }
                )
                log(f"prepare {kind} {name} workers={workers}: {size / 1e6 / wall:.2f} MB/s")
    return out_dirs


def bench_loader(mt, directory: str, packing: bool, n: int) -> float:
    """Batches/s of the tokens source at the default job's batch shape."""
    defaults = mt.DataConfig()
    config = mt.DataConfig(
        source="tokens",
        path=directory,
        seq_len=defaults.seq_len,
        batch_size=defaults.batch_size,
        packing=packing,
    )
    it = mt.make_dataset(config).train_iter()
    for _ in range(5):  # grain's threads start
        next(it)
    start = time.perf_counter()
    for _ in range(n):
        next(it)
    rate = n / (time.perf_counter() - start)
    it.close()
    return rate


def step_seconds(quick: bool, steps: int) -> tuple[float, str]:
    """Median step time of the default job (a 2-layer variant under --quick)."""
    import dataclasses

    import jax

    from meshtrain.cli.train import TrainJob, build_trainer
    from meshtrain.layout import shard_batch

    job = TrainJob()
    job = dataclasses.replace(
        job, save=False, train=dataclasses.replace(job.train, run_dir="", progress=False)
    )
    if quick:
        job = dataclasses.replace(job, gpt=dataclasses.replace(job.gpt, n_layers=2))
    trainer = build_trainer(job, say=log)
    batches = [shard_batch(next(trainer._iter), trainer.mesh, trainer.rules) for _ in range(3)]
    state = trainer.state
    state, m = trainer._step(state, batches[0])  # compile
    jax.block_until_ready(m)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        state, m = trainer._step(state, batches[i % 3])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    return statistics.median(times), job.model_config().describe()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.mb, args.vocab, args.batches, args.steps = 1.0, 1024, 50, 3
    import jax

    import meshtrain as mt
    from meshtrain.data import stdlib_corpus, train_bpe

    mt.simulate_devices(8)
    env = {
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "cores": os.cpu_count(),
        "jax_version": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    corpus = stdlib_corpus(int(args.mb * 1e6))
    log(f"training a {args.vocab}-token BPE on 1 MB")
    bpe = train_bpe([corpus[:1_000_000].decode("utf-8", errors="replace")], args.vocab)
    tokenizers = {"bytes": "bytes", f"bpe{args.vocab}": bpe}
    with tempfile.TemporaryDirectory() as root:
        inputs = write_inputs(root, corpus)
        if args.quick:
            inputs = {"jsonl": inputs["jsonl"]}
        workers = (1,) if args.quick else (1, 2)
        prepared = bench_prepare(mt, inputs, tokenizers, workers, root, env)
        step_s, model = step_seconds(args.quick, args.steps)
        emit({"case": "step", "model": model, "step_s": round(step_s, 4), **env})
        for name, directory in prepared.items():
            for packing in (True, False):
                rate = bench_loader(mt, directory, packing, args.batches)
                emit(
                    {
                        "case": "loader",
                        "tokenizer": name,
                        "packing": packing,
                        "batch": [mt.DataConfig().batch_size, mt.DataConfig().seq_len],
                        "batches_per_s": round(rate, 1),
                        "step_s": round(step_s, 4),
                        "ratio": round(rate * step_s, 1),
                        **env,
                    }
                )
                log(f"loader {name} packing={packing}: {rate:.0f} batches/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
