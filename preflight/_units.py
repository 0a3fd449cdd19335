"""Byte sizes: parse what users write ("24GiB", "80GB", 1 << 30) and format bytes for people."""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an int, a float, or a string with an optional SI (kB, MB, GB, TB: powers of 1000) or binary
    (KiB, MiB, GiB, TiB: powers of 1024) unit, case-insensitive: ``parse_bytes("24GiB") == 24 * 2**30``.

    Raises:
        ValueError: the value is negative, or a string that is not a size, with the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"Expected a size in bytes, got {value!r}.")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"A size cannot be negative, got {value!r}.")
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ValueError(
        f"Cannot read {value!r} as a size. Use a number of bytes or a number with a unit, "
        "e.g. 24GiB, 80GB, 512MiB (GB = 10^9 bytes, GiB = 2^30 bytes)."
    )


def format_bytes(n: int | float | None) -> str:
    """Format a byte count with binary units: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    if n is None:
        return "unknown"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"
