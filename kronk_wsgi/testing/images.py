"""Small images made without an imaging library: PNG files of one colour or a seeded noise, for requests that
carry images."""

import struct
import zlib

import numpy as np


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 40, 40), noise_seed: int = -1) -> bytes:
    """A ``width`` x ``height`` RGB PNG: one ``colour``, or (with ``noise_seed`` >= 0) seeded random pixels."""
    if noise_seed >= 0:
        pixels = np.random.default_rng(noise_seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        pixels = np.broadcast_to(np.array(colour, dtype=np.uint8), (height, width, 3))
    rows = b"".join(b"\0" + pixels[y].tobytes() for y in range(height))  # filter 0 before each row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
