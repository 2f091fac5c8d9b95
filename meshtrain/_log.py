"""The ``meshtrain`` logger: where the library says what a run does (the run summary).

It logs at INFO and propagates, so a program's own logging setup (a handler on the root
logger, or on this one) decides where the lines go; absl, which orbax imports, gives the root
logger a stderr handler (``logging.basicConfig``) when none is set, so a plain script or a
notebook shows them as ``INFO:meshtrain:...``. Where no handler would show them, they are
printed to stdout. Silence them with ``logging.getLogger("meshtrain").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOG"]

LOG = logging.getLogger("meshtrain")


class _Fallback(logging.Handler):
    """Prints a record to stdout when nobody else would: no other handler on the meshtrain
    logger and none on the root logger (Python's own fallback shows warnings only)."""

    def emit(self, record: logging.LogRecord) -> None:
        if len(LOG.handlers) > 1 or logging.getLogger().handlers:
            return
        try:
            print(self.format(record), file=sys.stdout, flush=True)
        except Exception:  # a closed stream must not stop training
            self.handleError(record)


if not any(isinstance(h, _Fallback) for h in LOG.handlers):
    LOG.addHandler(_Fallback())
if LOG.level == logging.NOTSET:
    LOG.setLevel(logging.INFO)
