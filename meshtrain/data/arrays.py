"""User arrays: an ``.npz`` of ``inputs`` and ``targets``, or arrays in memory."""

from __future__ import annotations

import zipfile

import numpy as np

from meshtrain.data.batches import Dataset, Rows
from meshtrain.data.config import common_problems, min_size
from meshtrain.problem import raise_if
from meshtrain.validate import is_int


def read_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The "inputs" and "targets" arrays of an .npz; a one-line ValueError for anything else."""
    save = "np.savez(path, inputs=..., targets=...)"
    try:
        npz = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        npz = e
    if not isinstance(npz, np.lib.npyio.NpzFile):
        with open(path, "rb") as f:
            head = f.read(512)
        if not head:
            what = "it is empty (0 bytes)"
        elif isinstance(npz, np.ndarray):
            what = "it holds a single .npy array"
        elif head.startswith(b"PK"):
            what = f"it is a damaged zip: {npz}"
        else:
            try:
                head.decode("utf-8")
            except UnicodeDecodeError:
                what = "it is not a zip archive, as .npz files are"
            else:
                what = "it looks like text"
        text = ", or use --data.source text to train on a text file" if "text" in what else ""
        raise ValueError(
            f"data.path={path!r} is not an .npz archive ({what}); source='arrays' needs the "
            f"arrays saved with {save}{text}"
        )
    with npz:
        missing = {"inputs", "targets"} - set(npz.files)
        if missing:
            raise ValueError(
                f"data.path={path!r}: .npz lacks {sorted(missing)} (has {npz.files}); "
                f"save it with {save}"
            )
        arrays = []
        for name in ("inputs", "targets"):
            try:
                arrays.append(npz[name])
            except ValueError:  # numpy's advice to unpickle it
                raise ValueError(
                    f"data.path={path!r}: array {name!r} holds Python objects (dtype object), "
                    f"which are not loaded; save numeric arrays with {save}"
                ) from None
    return arrays[0], arrays[1]


def make_arrays_dataset(
    inputs: np.ndarray,
    targets: np.ndarray,
    *,
    batch_size: int,
    seed: int = 0,
    val_fraction: float = 0.05,
    seq_len: int | None = None,
    vocab_size: int | None = None,
) -> Dataset:
    """Builds a dataset from in-memory arrays; the last rows are held out.

    1-D integer `targets` make a "classify" dataset (numeric inputs [N, F], cast to
    float32); 2-D integer `inputs` and `targets` of one shape [N, T] make an "lm" dataset.

    Args:
        inputs: [N, F] numbers (classify) or [N, T] token ids (lm).
        targets: [N] class ids (classify) or [N, T] token ids (lm).
        batch_size: global batch size.
        seed: shuffle seed.
        val_fraction: share of rows held out, from the end.
        seq_len: for lm, if given, must equal T (a check).
        vocab_size: class/token count; defaults to the largest id + 1.

    Returns:
        a `Dataset`.
    """
    return arrays_dataset(
        inputs,
        targets,
        "data",
        batch_size=batch_size,
        seed=seed,
        val_fraction=val_fraction,
        seq_len=seq_len,
        vocab_size=vocab_size,
    )


def arrays_dataset(
    inputs, targets, what: str, *, batch_size, seed, val_fraction, seq_len=None, vocab_size=None
) -> Dataset:
    """`make_arrays_dataset`, its errors starting with `what` (where the arrays came from)."""
    raise_if(common_problems(batch_size=batch_size, seed=seed, val_fraction=val_fraction))
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    if len(inputs) != len(targets):
        raise ValueError(
            f"{what}: inputs has {len(inputs)} rows but targets has {len(targets)}; they must match"
        )
    if not np.issubdtype(targets.dtype, np.integer):
        raise ValueError(f"{what}: targets dtype {targets.dtype} must be integer (class/token ids)")
    if targets.ndim == 1:
        if inputs.ndim != 2 or not np.issubdtype(inputs.dtype, np.number):
            raise ValueError(
                f"{what}: classify inputs must be a numeric [N, F] array, got {inputs.dtype} "
                f"{inputs.shape}; reshape to (N, -1)"
            )
        kind, ids, inputs = "classify", targets, inputs.astype(np.float32)
    elif targets.ndim == 2:
        if inputs.shape != targets.shape or not np.issubdtype(inputs.dtype, np.integer):
            raise ValueError(
                f"{what}: lm inputs must be integer tokens shaped like targets {targets.shape}, "
                f"got {inputs.dtype} {inputs.shape}"
            )
        if seq_len is not None and seq_len != inputs.shape[1]:
            raise ValueError(f"data seq_len={seq_len}: the arrays have T={inputs.shape[1]}")
        kind, ids, inputs = "lm", np.stack([inputs, targets]), inputs.astype(np.int32)
    else:
        raise ValueError(
            f"{what}: targets must be 1-D class ids or 2-D token ids, got shape {targets.shape}"
        )
    if ids.size and ids.min() < 0:
        raise ValueError(f"{what}: class/token ids must be non-negative")
    n_ids = int(ids.max(initial=0)) + 1
    if vocab_size is not None and (not is_int(vocab_size) or vocab_size < n_ids):
        raise ValueError(
            f"data vocab_size={vocab_size!r}: must be an integer above the largest id {n_ids - 1}"
        )
    n, n_val = len(inputs), int(len(inputs) * val_fraction)
    if not n or (val_fraction > 0 and n_val == 0) or n - n_val < batch_size:
        need = min_size(batch_size, 1, val_fraction)
        split = f"batch_size={batch_size} for training, val_fraction={val_fraction} held out"
        if not n:
            raise ValueError(f"{what} has no rows; give at least {need} rows ({split})")
        if n - n_val < batch_size:
            raise ValueError(
                f"{what} has {n} rows, {n - n_val} after holding out {n_val}, fewer than "
                f"batch_size={batch_size}; give at least {need} rows or lower batch_size"
            )
        raise ValueError(
            f"{what}: val_fraction={val_fraction} of {n} rows holds out none; raise "
            f"val_fraction, give at least {need} rows, or set val_fraction=0"
        )
    split, targets = n - n_val, targets.astype(np.int32)
    train, val = Rows(inputs[:split], targets[:split]), Rows(inputs[split:], targets[split:])
    return Dataset(kind, int(vocab_size or n_ids), train, val, batch_size, seed)
