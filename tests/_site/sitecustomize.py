"""Run by every Python process of a test run (``tests/_site`` is on ``PYTHONPATH``): keeps
from the shared compilation cache what jaxlib's CPU client cannot read back (`_cache_guard`)."""

import os
import sys

if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import _cache_guard
    finally:
        del sys.path[0]
    _cache_guard.install()
