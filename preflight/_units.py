"""Byte sizes: parse what users write ("24GiB", "80GB", 1 << 30) and format bytes for people."""

from __future__ import annotations

import math
import numbers
import operator
import re
from fractions import Fraction

__all__ = ["MAX_BYTES", "parse_bytes", "format_bytes", "margin_text", "signed_percent"]

MAX_BYTES = 2**64  # a 64-bit address space: no device holds more, and every size here fits a float exactly enough
_MAX_DIGITS = 40  # digits a size may have (2**64 has 20): longer strings are rejected before any arithmetic

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str | None = None) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an int (numpy integers too) or a float, a number of bytes, or a string with a unit: B, SI (kB, MB, GB,
    TB: powers of 1000) or binary (KiB, MiB, GiB, TiB: powers of 1024), case-insensitive:
    ``parse_bytes("24GiB") == 24 * 2**30``. A string without a unit (``"80"``) is refused with a hint: it is more
    often 80 GB meant than 80 bytes.
    ``name`` (e.g. ``"budget"``) is the argument the value came from, named in the error.

    Raises:
        ValueError: the value is negative, not finite, more than `MAX_BYTES`, or a string that is not a size, with
            the accepted forms.
    """
    prefix = f"`{name}`: " if name else ""  # the messages below read as sentences after it, or alone
    number: Fraction | None = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = Fraction(operator.index(value))
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{prefix}A size should be a finite number of bytes, got {value!r}. Pass e.g. 24GiB "
                             "or 80GB.")
        number = Fraction(float(value))
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS and len(match.group(1)) <= _MAX_DIGITS:
            number = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
            if not match.group(2) and number:  # "80": 80 bytes, or the 80 GB the user meant? Ask, never guess.
                digits = match.group(1)
                raise ValueError(f"{prefix}{value!r} has no unit. Did you mean {digits}GB or {digits}GiB? Write the "
                                 f"unit ({digits}B for bytes), or pass an int for a number of bytes.")
        elif match and match.group(2).lower() in _UNITS:
            number = Fraction(10) ** len(match.group(1))  # too many digits to be a size: rejected just below
    if number is None:
        raise ValueError(
            f"{prefix}Cannot read {_shown(value)} as a size. Use a number of bytes or a number with a unit, "
            "e.g. 24GiB, 80GB, 512MiB (GB = 10^9 bytes, GiB = 2^30 bytes)."
        )
    if number < 0:
        raise ValueError(f"{prefix}A size cannot be negative, got {_shown(value)}.")
    if number > MAX_BYTES:
        raise ValueError(f"{prefix}{_shown(value)} is more than any memory (a 64-bit address space is 16 EiB). Pass "
                         "the device's memory, e.g. 24GiB or 80GB.")
    return int(number)


def _shown(value: object) -> str:
    """``value`` for an error message, shortened when it is a very long number or string."""
    text = repr(value) if not isinstance(value, numbers.Integral) or isinstance(value, bool) else str(int(value))
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


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


def signed_percent(fraction: float, digits: int = 1) -> str:
    """``fraction`` as a signed percentage rounded to ``digits``, without a negative zero: ``+0.00%``, never
    ``-0.00%`` for a difference that rounds to nothing."""
    value = round(fraction * 100, digits)
    return f"{value + 0.0 if value else 0.0:+.{digits}f}%"


def margin_text(fraction: float) -> str:
    """How far a prediction is from a measurement, in words: ``"1.2% above"``, ``"0.4% below"``, ``"equal to"``."""
    value = round(abs(fraction) * 100, 1)
    if not value:
        return "equal to"
    return f"{value:.1f}% {'above' if fraction > 0 else 'below'}"
