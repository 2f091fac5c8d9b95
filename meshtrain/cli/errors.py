"""How the ``meshtrain`` command reports a mistake: one line on stderr, exit code 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["UsageError", "guarded", "say_error"]

DEBUG = "MESHTRAIN_DEBUG"


class UsageError(ValueError):
    """A mistake on the command line itself (a flag, its value, a file it names)."""


def say_error(name: str, message: str) -> None:
    """Prints `message` as ``meshtrain NAME: error: ...`` lines on stderr."""
    prefix = f"meshtrain {name}: error: " if name else "meshtrain: error: "
    for line in str(message).splitlines() or [""]:
        print(prefix + line, file=sys.stderr, flush=True)


def guarded(name: str, work: Callable[[], int]) -> int:
    """Runs `work`; a refusal becomes one line per problem and exit code 2.

    ValueError (a `RunCheckError` or a config's own check), a `DistributedError` and an
    OSError naming a file become lines; a `NonFiniteError` stops with exit code 1, Ctrl-C
    with 130. With ``MESHTRAIN_DEBUG=1`` everything but a `UsageError` raises as is.
    """
    from meshtrain.distributed import DistributedError

    debug = bool(os.environ.get(DEBUG))
    try:
        return work()
    except UsageError as e:
        say_error(name, str(e))
        return 2
    except (ValueError, DistributedError) as e:
        if debug:
            raise
        say_error(name, f"{e} ({DEBUG}=1 shows the traceback)")
        return 2
    except OSError as e:
        if debug or e.filename is None:
            raise
        say_error(name, f"{e.filename}: {e.strerror or e}; check the path")
        return 2
    except RuntimeError as e:
        from meshtrain.train.hooks import NonFiniteError

        if not isinstance(e, NonFiniteError) or debug:
            raise
        print(f"meshtrain {name}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"meshtrain {name}: interrupted", file=sys.stderr)
        return 130
