"""Stored Responses: the response objects clients may fetch again, and the conversations they continue.

Kept in one SQLite file, shared by the worker processes of a server (SQLite
locks the file for them), readable by its owner only. Every call here does
blocking I/O: the API runs it in the app's store thread, never on the event
loop, one call at a time, so a read sees every write made before it. Each
response is its owner's (a digest of the API key that made it): another key
sees none of it. A response stores only the messages it adds to its
conversation and the id of the one it continues; a background response also keeps
its stream's events, for clients that resume it, and the worker running it, whose
heartbeat says it still does: a run whose worker stopped beating for
``ORPHAN_SECONDS`` is marked failed by whichever worker looks next. At most ``keep`` responses, and
``max_bytes`` of them and their events, are kept; the oldest go first. The store
also keeps the fingerprints of Messages requests that ask for cache diagnostics.
"""

import hashlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Optional

_SCHEMA = """
CREATE TABLE IF NOT EXISTS stored_responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,       -- owner_of() the API key that made it; "" on a server without keys
    created REAL NOT NULL,
    previous TEXT,             -- the response it continues, whose conversation comes before its messages
    response TEXT NOT NULL,    -- the response object, as GET returns it
    messages TEXT NOT NULL,    -- the chat messages it adds to the conversation (its input and its answer)
    size INTEGER NOT NULL      -- bytes of response and messages
);
CREATE INDEX IF NOT EXISTS stored_responses_created ON stored_responses (created);
CREATE TABLE IF NOT EXISTS prompt_fingerprints (
    id TEXT PRIMARY KEY,       -- the message (msg_...) whose request this was
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    fingerprint TEXT NOT NULL  -- digests of the request's parts, for cache diagnostics (api/cache_diagnostics.py)
);
CREATE TABLE IF NOT EXISTS background_events (
    id TEXT NOT NULL,          -- the background response whose stream this is
    sequence INTEGER NOT NULL, -- the event's sequence_number
    frame TEXT NOT NULL,       -- the event as it went out (an SSE frame)
    PRIMARY KEY (id, sequence)
);
CREATE TABLE IF NOT EXISTS background_runs (
    id TEXT PRIMARY KEY,       -- a background response that has not ended
    worker TEXT NOT NULL,      -- the worker process running it
    beat REAL NOT NULL         -- when that worker last said it is alive (time.time())
);
CREATE TABLE IF NOT EXISTS background_event_bytes (
    id TEXT PRIMARY KEY,       -- a background response with stored events
    bytes INTEGER NOT NULL     -- what its events hold: the budget counts it without reading every event
);
"""

# A conversation is the chain of its responses, newest first: the one asked for, and each it continues.
_CHAIN = """
WITH RECURSIVE chain(id, previous, messages, depth) AS (
    SELECT id, previous, messages, 0 FROM stored_responses WHERE id = ? AND owner = ?
    UNION ALL
    SELECT r.id, r.previous, r.messages, chain.depth + 1
    FROM stored_responses r JOIN chain ON r.id = chain.previous AND r.owner = ?
)
SELECT previous, messages FROM chain ORDER BY depth DESC
"""


# A background run whose worker has not beaten for this long is taken to be dead with its worker.
ORPHAN_SECONDS = 5.0
_ORPHANED = json.dumps({"code": "server_error", "message": "the worker running the response stopped before it "
                                                           "was done"})


def owner_of(api_key: str) -> str:
    """Who a key's responses belong to: a digest of it, never the key itself; "" without a key."""
    return hashlib.sha256(b"kronk-wsgi responses:" + api_key.encode()).hexdigest()[:32] if api_key else ""


class ResponseStore:
    """Responses by id, in a SQLite file."""

    def __init__(self, path: Path, most: int, max_bytes: int) -> None:
        self.path = path
        self.most = most
        self.max_bytes = max_bytes
        self._db: Optional[sqlite3.Connection] = None

    def _connection(self) -> sqlite3.Connection:
        # Made in, and used only from, the app's one store thread.
        if self._db is None:
            if not self.path.parent.exists():
                self.path.parent.mkdir(mode=0o700, parents=True)
            # Created 0600 before SQLite opens it: its -wal and -shm files take the same mode.
            os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
            self._db = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            if self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'responses'").fetchone():
                with self._db:  # a store written before responses had owners: each keeps its whole conversation
                    self._db.execute("INSERT OR IGNORE INTO stored_responses SELECT id, '', created, NULL, response, "
                                     "conversation, length(response) + length(conversation) FROM responses")
                    self._db.execute("DROP TABLE responses")
        return self._db

    def put(self, response: dict, owner: str, previous: Optional[str], messages: list[dict]) -> None:
        """Keep a response and the messages it adds; forget the oldest beyond the limits. A cancelled response
        stays cancelled: only a cancelled one replaces it."""
        body, added = json.dumps(response), json.dumps(messages)
        db = self._connection()
        with db:
            db.execute("INSERT INTO stored_responses VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                       "previous = excluded.previous, response = excluded.response, messages = excluded.messages, "
                       "size = excluded.size WHERE json_extract(stored_responses.response, '$.status') != "
                       "'cancelled' OR json_extract(excluded.response, '$.status') = 'cancelled'",
                       (response["id"], owner, time.time(), previous, body, added, len(body) + len(added)))
            beyond = db.execute("DELETE FROM stored_responses WHERE created <= (SELECT created FROM "
                                "stored_responses ORDER BY created DESC LIMIT 1 OFFSET ?)", (self.most,)).rowcount
            if beyond:
                for table in ("background_events", "background_event_bytes"):
                    db.execute(f"DELETE FROM {table} WHERE id NOT IN (SELECT id FROM stored_responses)")
            total = db.execute("SELECT COALESCE(SUM(size), 0) FROM stored_responses").fetchone()[0] + \
                db.execute("SELECT COALESCE(SUM(bytes), 0) FROM background_event_bytes").fetchone()[0]
            while total > self.max_bytes:
                oldest = db.execute("SELECT id, size FROM stored_responses ORDER BY created LIMIT 64").fetchall()
                for response_id, size in oldest:
                    if total <= self.max_bytes:
                        break
                    db.execute("DELETE FROM stored_responses WHERE id = ?", (response_id,))
                    total -= size + self._forget_events(db, response_id)

    def get(self, response_id: str, owner: str) -> Optional[dict]:
        """The owner's response object; None if there is none. A background one whose worker died is marked
        failed first."""
        db = self._connection()
        query = "SELECT response FROM stored_responses WHERE id = ? AND owner = ?"
        row = db.execute(query, (response_id, owner)).fetchone()
        if row is None:
            return None
        response = json.loads(row[0])
        if response.get("background") and response.get("status") in ("queued", "in_progress"):
            alive = db.execute("SELECT 1 FROM background_runs WHERE id = ? AND beat >= ?",
                               (response_id, time.time() - ORPHAN_SECONDS)).fetchone()
            if alive is None:
                with db:
                    self._fail(db, [response_id])
                response = json.loads(db.execute(query, (response_id, owner)).fetchone()[0])
        return response

    def run_started(self, response_id: str, worker: str) -> None:
        """Say that ``worker`` runs a background response (its heartbeat begins now)."""
        db = self._connection()
        with db:
            db.execute("INSERT OR REPLACE INTO background_runs VALUES (?, ?, ?)", (response_id, worker, time.time()))

    def run_ended(self, response_id: str) -> None:
        db = self._connection()
        with db:
            db.execute("DELETE FROM background_runs WHERE id = ?", (response_id,))

    def beat(self, worker: str) -> None:
        """``worker`` is alive, with its runs; mark failed the runs of workers that stopped beating."""
        db = self._connection()
        now = time.time()
        with db:
            db.execute("UPDATE background_runs SET beat = ? WHERE worker = ?", (now, worker))
            dead = [row[0] for row in db.execute("SELECT id FROM background_runs WHERE beat < ?",
                                                 (now - ORPHAN_SECONDS,))]
            self._fail(db, dead)

    @staticmethod
    def _fail(db: sqlite3.Connection, response_ids: list[str]) -> None:
        """Mark unfinished background responses failed: their worker is gone."""
        for response_id in response_ids:
            db.execute("UPDATE stored_responses SET response = json_set(response, '$.status', 'failed', '$.error', "
                       "json(?)) WHERE id = ? AND json_extract(response, '$.status') IN ('queued', 'in_progress')",
                       (_ORPHANED, response_id))
            db.execute("DELETE FROM background_runs WHERE id = ?", (response_id,))

    def conversation(self, response_id: str, owner: str) -> Optional[list[dict]]:
        """The chat messages of the owner's response and of every one it continues; None if one of them is gone."""
        chain = self._connection().execute(_CHAIN, (response_id, owner, owner)).fetchall()
        if not chain or chain[0][0] is not None:  # nothing, or the oldest one kept continues one that is not
            return None
        return [message for _, messages in chain for message in json.loads(messages)]

    def cancel(self, response_id: str, owner: str) -> Optional[dict]:
        """Mark the owner's response cancelled if it is queued or in progress; the response as it is then."""
        db = self._connection()
        with db:
            db.execute("UPDATE stored_responses SET response = json_set(response, '$.status', 'cancelled') "
                       "WHERE id = ? AND owner = ? AND json_extract(response, '$.status') IN ('queued', "
                       "'in_progress')", (response_id, owner))
        return self.get(response_id, owner)

    def put_fingerprint(self, message_id: str, owner: str, fingerprint: dict) -> None:
        """Keep a Messages request's fingerprint; forget the oldest beyond ``keep``."""
        db = self._connection()
        with db:
            db.execute("INSERT OR REPLACE INTO prompt_fingerprints VALUES (?, ?, ?, ?)",
                       (message_id, owner, time.time(), json.dumps(fingerprint)))
            db.execute("DELETE FROM prompt_fingerprints WHERE created <= (SELECT created FROM prompt_fingerprints "
                       "ORDER BY created DESC LIMIT 1 OFFSET ?)", (self.most,))

    def fingerprint(self, message_id: str, owner: str) -> Optional[dict]:
        """The owner's fingerprint of a message's request; None if there is none."""
        row = self._connection().execute("SELECT fingerprint FROM prompt_fingerprints WHERE id = ? AND owner = ?",
                                         (message_id, owner)).fetchone()
        return None if row is None else json.loads(row[0])

    def add_events(self, response_id: str, frames: list[tuple[int, str]]) -> None:
        """Keep a background response's stream events (sequence number, frame), for clients that resume it."""
        if not frames:
            return
        db = self._connection()
        with db:
            db.executemany("INSERT OR REPLACE INTO background_events VALUES (?, ?, ?)",
                           [(response_id, sequence, frame) for sequence, frame in frames])
            db.execute("INSERT INTO background_event_bytes VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET "
                       "bytes = bytes + excluded.bytes", (response_id, sum(len(frame) for _, frame in frames)))

    def events(self, response_id: str, owner: str, after: int) -> list[tuple[int, str]]:
        """The owner's background response's stream events after sequence number ``after``, in order."""
        return self._connection().execute(
            "SELECT e.sequence, e.frame FROM background_events e JOIN stored_responses r ON r.id = e.id "
            "WHERE e.id = ? AND r.owner = ? AND e.sequence > ? ORDER BY e.sequence",
            (response_id, owner, after)).fetchall()

    def delete(self, response_id: str, owner: str) -> bool:
        """Forget the owner's response; whether there was one."""
        db = self._connection()
        with db:
            deleted = db.execute("DELETE FROM stored_responses WHERE id = ? AND owner = ?",
                                 (response_id, owner)).rowcount > 0
            if deleted:
                self._forget_events(db, response_id)
            return deleted

    @staticmethod
    def _forget_events(db: sqlite3.Connection, response_id: str) -> int:
        """Delete a response's stream events; the bytes they held."""
        held = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM background_event_bytes WHERE id = ?",
                          (response_id,)).fetchone()[0]
        db.execute("DELETE FROM background_events WHERE id = ?", (response_id,))
        db.execute("DELETE FROM background_event_bytes WHERE id = ?", (response_id,))
        return held
