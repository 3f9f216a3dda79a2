"""Byte counts as a person reads them in job messages and logs."""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB")


def size_text(n: int) -> str:
    """``512 B``, ``12.5 KiB``, ``3.0 MiB``: bytes below 1 KiB, then the
    largest binary unit that keeps the number at or above 1 (so a small
    file never reads as "0 MiB")."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    unit = _UNITS[0]
    for unit in _UNITS:
        value /= 1024
        if round(value, 1) < 1024:  # 1023.96 KiB reads as 1.0 MiB, not 1,024.0 KiB
            break
    return f"{value:,.1f} {unit}"
