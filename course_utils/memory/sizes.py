"""Byte sizes: parse "4GiB" and friends, format byte counts, round up to allocator blocks."""
from __future__ import annotations

import math
import re
from typing import Union

from ..i18n import _

BytesLike = Union[int, float, str]

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


# --- sizes ---------------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: BytesLike) -> int:
    """Bytes from an int (or integral float) or a string such as "64MiB", "1.5 GiB", "500MB".

    Binary units (KiB, MiB, GiB, TiB, and the bare K, M, G, T) are powers of 1024; decimal units
    (KB, MB, GB, TB) are powers of 1000. Raises ValueError for anything that is not a positive size.
    """
    if isinstance(value, bool):
        raise ValueError(_("a memory size must be a number of bytes or a string like '64MiB', got {value!r}").format(
            value=value))
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(_("a memory size in bytes must be a whole number, got {value!r}").format(value=value))
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(_("cannot read {value!r} as a memory size; write e.g. 512, '64MiB', '1.5GiB' or "
                                "'500MB'").format(value=value))
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(_("a memory size must be a number of bytes or a string like '64MiB', got {kind}").format(
            kind=type(value).__name__))
    if n <= 0:
        raise ValueError(_("a memory size must be positive, got {value!r}").format(value=value))
    return n


def format_bytes(n: float, *, english: bool = False) -> str:
    """CUDA's style: '512 bytes', '1.50 KiB', '20.00 MiB', '2.00 GiB'. "bytes" is in the language set, unless
    `english` (for a message worded as CUDA's, which stays in English and is parsed as such)."""
    if abs(n) < 1024:
        return f"{int(n)} bytes" if english else _("{n} bytes").format(n=int(n))
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} TiB"


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block if block > 1 else n
