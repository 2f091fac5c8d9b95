"""Quantities written for people: byte counts in decimal units."""


def fmt_bytes(n: float) -> str:
    """``1.50 MB`` style (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
