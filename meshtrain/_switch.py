"""A per-thread switch, on while a ``with`` block traces (`Switch.on`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class Switch:
    """A flag that is on inside ``with switch.on():`` in this thread, and off elsewhere."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        """Turns the switch on for the block (nested blocks restore what was before)."""
        before = self.is_on
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = before

    @property
    def is_on(self) -> bool:
        """Whether this runs inside `on`."""
        return getattr(self._local, "on", False)
