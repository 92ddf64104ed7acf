"""A real headless Chromium (Debian's chromium-headless-shell), driven over its DevTools protocol."""

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import requests
import websocket

BINARIES = ("chromium-headless-shell", "chromium", "chromium-browser")


def find_chromium() -> Optional[str]:
    return next(filter(None, map(shutil.which, BINARIES)), None)


class Browser:
    """One page of a headless Chromium: navigate, run JavaScript, take screenshots."""

    def __init__(self, binary: str, width: int = 1280, height: int = 900) -> None:
        self._profile = tempfile.mkdtemp(prefix="kronk-chromium-")
        self._proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # Debian's binary is a shell script that runs the browser as its child
        )
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self._proc.poll() is not None:
                raise RuntimeError("Chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self._socket = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self._ids = itertools.count(1)

    def send(self, method: str, **params: Any) -> dict:
        """Call a DevTools method and return its result (events on the way are skipped)."""
        call_id = next(self._ids)
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def goto(self, url: str) -> None:
        self.send("Page.enable")
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def js(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises are awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, seconds: float = 30.0) -> Any:
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + seconds
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not true within {seconds} s: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        """Stop the browser and every process it started (its whole session), then remove its profile."""
        self._socket.close()
        try:
            for sig, seconds in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                os.killpg(self._proc.pid, sig)
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    self._proc.poll()  # reaps the script once it has exited
                    try:
                        os.killpg(self._proc.pid, 0)
                    except ProcessLookupError:  # none left
                        return
                    time.sleep(0.05)
        finally:
            shutil.rmtree(self._profile, ignore_errors=True)
