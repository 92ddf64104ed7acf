"""Stored Responses: the response objects clients may fetch again, and the conversations they continue.

Kept in one SQLite file, shared by the worker processes of a server (SQLite
locks the file for them). Every call here does blocking I/O: the API runs it in
the app's worker thread, never on the event loop. At most ``keep`` responses
are kept; the oldest go first.
"""

import json
import sqlite3
import time
from pathlib import Path
from typing import Optional

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    response TEXT NOT NULL,      -- the response object, as GET returns it
    conversation TEXT NOT NULL   -- the chat messages it ended, as previous_response_id continues them
)
"""


class ResponseStore:
    """Responses by id, in a SQLite file."""

    def __init__(self, path: Path, keep: int) -> None:
        self.path = path
        self.keep = keep
        self._db: Optional[sqlite3.Connection] = None

    def _connection(self) -> sqlite3.Connection:
        # Made in, and used only from, the app's one worker thread.
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
        return self._db

    def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep a finished response; forget the oldest beyond ``keep``."""
        db = self._connection()
        with db:
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                       (response["id"], time.time(), json.dumps(response), json.dumps(conversation)))
            db.execute("DELETE FROM responses WHERE id NOT IN "
                       "(SELECT id FROM responses ORDER BY created DESC LIMIT ?)", (self.keep,))

    def get(self, response_id: str) -> Optional[tuple[dict, list[dict]]]:
        """The response object and its conversation, or None."""
        row = self._connection().execute(
            "SELECT response, conversation FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether there was one."""
        db = self._connection()
        with db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
