"""Big-endian integers read at many positions of a numpy byte buffer at once: shared by the
column-at-a-time TupleData parse (pgoutput) and the binary vector converters (pgtypes)."""

from __future__ import annotations

import numpy as np


def read_uint(buf: np.ndarray, positions: np.ndarray, width: int) -> np.ndarray:
    """Big-endian unsigned ints of ``width`` bytes at ``positions`` (callers check the bounds)."""
    safe = np.clip(positions, 0, max(len(buf) - width, 0))
    value = np.zeros(len(positions), dtype=np.int64)
    for offset in range(width):
        value = (value << 8) | buf[safe + offset].astype(np.int64)
    return value


def uint64_at(buf: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Big-endian unsigned 64-bit ints at ``positions`` (in bounds), exact past 2^63 too."""
    if not len(positions):
        return np.zeros(0, np.uint64)
    return buf[positions[:, None] + np.arange(8)].view(">u8").reshape(-1).astype(np.uint64)
