"""Sealed reasoning: text a client keeps and hands back (``reasoning.encrypted_content``) that only this server
can open, and that cannot be changed on the way.

Fernet (AES-128-CBC with HMAC-SHA256, from the cryptography package) under one key per server, kept in the
cache directory, readable by its owner only, and made by whichever worker needs it first.
"""

from pathlib import Path
from typing import Optional

from cryptography.fernet import Fernet, InvalidToken

from ..private_files import owner_only_key


class Sealer:
    """Seals and opens text with the key at ``path`` (made on first use)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fernet: Optional[Fernet] = None

    def _key(self) -> Fernet:
        if self._fernet is None:
            self._fernet = Fernet(owner_only_key(self.path, Fernet.generate_key))
        return self._fernet

    def seal(self, text: str) -> str:
        return self._key().encrypt(text.encode("utf-8")).decode("ascii")

    def open(self, token: str) -> str:
        """The sealed text; ValueError if this server did not seal it, or it was changed."""
        try:
            return self._key().decrypt(token.encode("ascii")).decode("utf-8")
        except (InvalidToken, UnicodeError, ValueError):
            raise ValueError("not sealed by this server, or changed since") from None
