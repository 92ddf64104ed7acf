"""A local stand-in for the Hugging Face hub: the download protocol huggingface-hub speaks, over real HTTP.

Point HF_ENDPOINT at it. It serves the files of its repositories with the
headers huggingface-hub reads (X-Repo-Commit, X-Linked-Etag = the SHA-256,
X-Linked-Size), honours Range requests, lists a repository's tree, and can
misbehave on demand: drop the connection part way through a file once, or
serve bytes that do not match the SHA-256 it announces.
"""

import hashlib
import http.server
import json
import re
import threading
import urllib.parse
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Repositories of files; ``with FakeHub() as hub``, then ``hub.url``."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.cut_once: dict[str, int] = {}  # file name -> bytes sent before the connection drops, once
        self.corrupt: set[str] = set()  # file names served with a byte changed
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.delay = 0.0  # seconds between 64 KiB pieces of a file

    def add(self, repo_id: str, filename: str, data: bytes) -> None:
        self.repos.setdefault(repo_id, {})[filename] = data

    def add_file(self, repo_id: str, path: Path, filename: str = "") -> None:
        self.add(repo_id, filename or path.name, path.read_bytes())

    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, handler: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        path = urllib.parse.urlparse(handler.path).path
        self.requests.append((handler.command, path, handler.headers.get("Range", "")))
        tree = re.fullmatch(r"/api/models/(.+?)/tree/[^/]+/?", path)
        if tree:
            return self._tree(handler, urllib.parse.unquote(tree.group(1)))
        resolve = re.fullmatch(r"/(.+?)/resolve/[^/]+/(.+)", path)
        repo_id, filename = (urllib.parse.unquote(g) for g in resolve.groups()) if resolve else ("", "")
        data = self.repos.get(repo_id, {}).get(filename)
        if data is None:
            return self._send(handler, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, body)
        sha = hashlib.sha256(data).hexdigest()
        if filename in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        headers = {"X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{sha}"', "ETag": f'"{sha}"',
                   "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes"}
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", handler.headers.get("Range", ""))
        if ranged and body:
            start = int(ranged.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        status = 206 if start else 200
        cut = self.cut_once.pop(filename, None) if body else None
        self._send(handler, status, data[start:], headers, body, cut)

    def _tree(self, handler, repo_id: str) -> None:
        files = self.repos.get(repo_id)
        if files is None:
            return self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, True)
        entries = [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name,
                    "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                   for name, data in sorted(files.items())]
        self._send(handler, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, True)

    def _send(self, handler, status: int, data: bytes, headers: dict, body: bool, cut=None) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if not body:
            return
        sent = 0
        for at in range(0, len(data), 1 << 16):
            piece = data[at:at + (1 << 16)]
            if cut is not None and sent + len(piece) > cut:
                handler.wfile.write(piece[:cut - sent])
                handler.wfile.flush()
                handler.close_connection = True
                handler.connection.shutdown(2)
                return
            handler.wfile.write(piece)
            sent += len(piece)
            if self.delay:
                threading.Event().wait(self.delay)
