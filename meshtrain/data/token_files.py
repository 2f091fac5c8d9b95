"""Appending the tokenising workers' results to a prepared corpus's token and document files
(`meshtrain.data.prepare`), counting as they go."""

from __future__ import annotations

import hashlib
from typing import BinaryIO

import numpy as np

from meshtrain.data.digest import RunningDigest


class TokenFiles:
    """Writes results into open ``tokens.bin`` and ``documents.bin`` files.

    The document file starts with offset 0 and gets each closed document's end offset; the
    counts, the largest id, the SHA-256 of the token bytes and both files' digests
    (`meshtrain.data.digest`) follow what was written.

    Attributes:
        tokens: token ids written.
        documents: documents closed.
        max_id: the largest token id written (-1 before any).
    """

    def __init__(self, tokens_file: BinaryIO, documents_file: BinaryIO):
        self._tokens_file = tokens_file
        self._documents_file = documents_file
        self._digest = hashlib.sha256()
        self._tokens_digest, self._documents_digest = RunningDigest(), RunningDigest()
        self.tokens = 0
        self.documents = 0
        self.max_id = -1
        self._write_offsets(np.zeros(1, np.int64))

    def write(self, result) -> None:
        """Appends one unit's result, ``(flat ids, document lengths, whether the last closes)``.

        Args:
            result: a worker's result (`meshtrain.data.workers.run_units`): every document's
                ids in one array, their lengths, and whether the last document ends here (a
                text file's pieces leave it open for the next).
        """
        flat, lengths, closes = result
        data = flat.tobytes()
        self._tokens_file.write(data)
        self._digest.update(data)
        self._tokens_digest.update(data)
        if len(flat):
            self.max_id = max(self.max_id, int(flat.max()))
        if not len(lengths):
            return
        ends = self.tokens + np.cumsum(lengths)
        self.tokens = int(ends[-1])
        if not closes:
            ends = ends[:-1]
        if len(ends):
            self._write_offsets(ends.astype(np.int64))
            self.documents += len(ends)

    def _write_offsets(self, offsets: np.ndarray) -> None:
        """Appends int64 document offsets to the document file and its digest."""
        data = offsets.tobytes()
        self._documents_file.write(data)
        self._documents_digest.update(data)

    @property
    def sha256(self) -> str:
        """The hex SHA-256 of the token bytes written so far."""
        return self._digest.hexdigest()

    @property
    def digests(self) -> tuple[str, str]:
        """The digests (`meshtrain.data.digest`) of the token and document bytes written so far."""
        return self._tokens_digest.hexdigest(), self._documents_digest.hexdigest()
