"""Pytree paths as strings: the one spelling used in messages and comparisons."""

from __future__ import annotations


def path_str(path) -> str:
    """A pytree or NNX path as ``blocks/attn/q/0``: dict keys, sequence indices, NamedTuple
    field names and plain strings all print as their bare value."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)
