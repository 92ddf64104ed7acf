"""The registry of engine kinds, in order of preference for "auto".

A new engine is one module that defines its ``KIND`` (see ``EngineKind`` in
base.py) and one line here. Any other kind can be named as
``package.module:KIND``.
"""

import importlib
from pathlib import Path
from typing import Any, Optional, Sequence

from . import ctransformers_engine, grpc_engine, llamacpp_engine
from .base import EngineError, EngineKind, Fit


class EngineKinds:
    """The kinds by name, and the choice "auto" makes for a file."""

    def __init__(self, kinds: Sequence[EngineKind]) -> None:
        self.all = tuple(kinds)
        self.automatic = tuple(kind for kind in self.all if kind.auto)  # those "auto" chooses from
        self._by_name = {kind.name: kind for kind in self.all}

    def get(self, name: str) -> EngineKind:
        """A registered kind by name, or any EngineKind as 'package.module:NAME'; EngineError if there is none."""
        if name in self._by_name:
            return self._by_name[name]
        module, _, attr = name.partition(":")
        try:
            kind = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise EngineError(f"unknown engine {name!r}: {exc}") from None
        if not isinstance(kind, EngineKind):
            raise EngineError(f"engine {name!r} is not an EngineKind")
        return kind

    def verdicts(self, path: Path) -> list[tuple[EngineKind, Fit]]:
        """Each kind "auto" chooses from with what it makes of the file, in order of preference."""
        return [(kind, kind.fit(path)) for kind in self.automatic]

    def choose(self, path: Path, wanted: str = "auto", options: Optional[dict[str, Any]] = None) -> EngineKind:
        """The kind that runs a file: ``wanted``, or for "auto" the first installed kind that runs it and takes
        the model's ``options``. EngineError if there is none, saying why each kind cannot."""
        if wanted != "auto":
            return self.get(wanted)
        reasons = []
        for kind, verdict in self.verdicts(path):
            why = verdict.problem
            if why is None and options:
                try:
                    kind.check_options(options)
                except ValueError as exc:
                    why = str(exc)
            if why is None and kind.available():
                return kind
            reasons.append(f"{kind.name}: {why or 'not installed (' + kind.missing + ')'}")
        raise EngineError(f"no engine can run {path.name}: " + "; ".join(reasons))


ENGINES = EngineKinds([
    ctransformers_engine.KIND,
    llamacpp_engine.KIND,
    grpc_engine.KIND,
])
