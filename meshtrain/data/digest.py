"""Digests of a prepared corpus's files, so that a run notices bytes that changed since
`prepare_corpus` wrote them.

`prepare_corpus` records, in the manifest's ``digests`` entry, the algorithm, the digest of
every file a run reads (``files``: token ids, document offsets, the tokenizer) and one of the
manifest's own content (``manifest``); the ``tokens`` source checks them each time it opens the
corpus (`meshtrain.data.tokens`).

The digest is zlib's CRC-32, read in 8 MiB blocks: about twice SHA-256's speed and three times
BLAKE2b's (``benchmarks/corpus_soak.py --cost``), and certain to catch every change confined
to 32 consecutive bits, a single flipped byte included. It guards against damage (a bad disk, a
truncated copy, a file replaced by mistake), not against files forged on purpose.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence

ALGORITHM = "crc32"
BLOCK_BYTES = 8 << 20  # read at a time when checking a file


class RunningDigest:
    """The digest of the bytes given so far, for a file written piece by piece."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes | memoryview) -> None:
        """Adds `data` (the bytes that follow those given before)."""
        self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        """The digest so far, as 8 hex digits."""
        return f"{self._crc:08x}"


def file_digest(path: str, block_bytes: int = BLOCK_BYTES) -> str:
    """The digest of the file at `path`, read `block_bytes` at a time into one buffer.

    Args:
        path: the file.
        block_bytes: bytes read at a time (the memory it takes).

    Returns:
        the file's digest, as 8 hex digits (the `RunningDigest` of its bytes).
    """
    digest, buffer = RunningDigest(), bytearray(block_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def manifest_digest(manifest: dict) -> str:
    """The digest of a manifest's content but its own recorded digest (key order and spacing
    do not count)."""
    entry = manifest.get("digests")
    if isinstance(entry, dict):
        manifest = {**manifest, "digests": {k: v for k, v in entry.items() if k != "manifest"}}
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{zlib.crc32(text.encode('ascii')):08x}"


def with_digests(manifest: dict, files: dict[str, str]) -> dict:
    """`manifest` with its ``digests`` entry: the algorithm, `files` (name: digest) and the
    digest of the whole (`manifest_digest`)."""
    out = {**manifest, "digests": {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}}
    out["digests"]["manifest"] = manifest_digest(out)
    return out


def manifest_problem(manifest: dict, name: str, required: Sequence[str]) -> str:
    """ "" when `manifest`'s ``digests`` entry is whole, names every file in `required` and
    matches the manifest's content; else what is wrong, in words (the manifest file is `name`)."""
    entry = manifest.get("digests")
    files = entry.get("files") if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or not isinstance(files, dict):
        return f"{name} lost its digests entry"
    if entry.get("algorithm") != ALGORITHM:
        return f"{name} records digests of an unknown algorithm {entry.get('algorithm')!r}"
    missing = [f for f in required if not isinstance(files.get(f), str)]
    if missing:
        return f"{name} records no digest of {missing[0]}"
    if entry.get("manifest") != manifest_digest(manifest):
        return (
            f"{name} changed since `meshtrain prepare` wrote it (its content no longer matches "
            "its digest)"
        )
    return ""


def files_problem(directory: str, manifest: dict) -> str:
    """ "" when every file the (checked) manifest records still has its digest; else the first
    that does not, in words."""
    for name, want in manifest["digests"]["files"].items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        have = file_digest(path)
        if have != want:
            return (
                f"{path} changed since `meshtrain prepare` wrote it (its {ALGORITHM} is {have}; "
                f"the manifest records {want})"
            )
    return ""
