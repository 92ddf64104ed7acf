"""A raw-socket HTTP/1.1 client, to watch SSE frames (or NDJSON lines) as they arrive and to hang up mid-stream."""

import json
import socket
import time


class RawStream:
    """One POST over a plain socket; read the status, headers and SSE frames."""

    def __init__(self, host: str, port: int, path: str, body: dict, headers: dict | None = None) -> None:
        self.sock = socket.create_connection((host, port), timeout=30)
        payload = json.dumps(body).encode()
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
                 f"Content-Length: {len(payload)}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        self._buffer = b""
        self._text = ""
        head = self._read_until(b"\r\n\r\n")
        status_line, *header_lines = head.decode().split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        self._chunked = self.headers.get("transfer-encoding") == "chunked"
        self._eof = False
        self.ended = False

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            self._eof = True
        return data

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buffer:
            data = self._recv()
            if not data:
                raise EOFError("connection closed")
            self._buffer += data
        head, _, self._buffer = self._buffer.partition(marker)
        return head

    def _read_body_piece(self) -> bool:
        """Move more body text into the text buffer; False at the end of the body."""
        if not self._chunked:
            data = self._buffer or self._recv()
            self._buffer = b""
            self._text += data.decode()
            return bool(data)
        size = int(self._read_until(b"\r\n").split(b";")[0], 16)
        if size == 0:
            self.ended = True  # the chunked body's own end, not a cut connection
            return False
        while len(self._buffer) < size + 2:
            data = self._recv()
            if not data:
                raise EOFError("connection closed inside a chunk")
            self._buffer += data
        self._text += self._buffer[:size].decode()
        self._buffer = self._buffer[size + 2:]
        return True

    def frames(self, separator: str = "\n\n"):
        """Yield (arrival time, frame text) for each SSE frame (with ``separator`` "\n": NDJSON line) until the
        body ends."""
        while True:
            while separator in self._text:
                frame, _, self._text = self._text.partition(separator)
                yield time.monotonic(), frame
            try:
                if not self._read_body_piece():
                    return
            except EOFError:
                return

    def body(self) -> str:
        while self._read_body_piece():
            pass
        return self._text

    def close(self) -> None:
        self.sock.close()


def data_of(frame: str):
    """The JSON (or [DONE]) of a data frame."""
    assert frame.startswith("data: "), frame
    payload = frame[len("data: "):]
    return payload if payload == "[DONE]" else json.loads(payload)
