"""Small media files made without an imaging or sound library, for requests that carry them: PNG images of one
colour or a seeded noise, and WAV sounds."""

import io
import struct
import wave
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


def wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV file of a tone."""
    samples = (np.sin(np.arange(int(seconds * rate)) / 10) * 8000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.tobytes())
    return out.getvalue()
