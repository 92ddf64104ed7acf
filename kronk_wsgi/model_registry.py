"""The models a server answers for: those configured, and the GGUF files pulled into the hub's cache, each under
its one canonical name ``hf.co/{owner}/{repo}:{tag}``.

The configuration is read, never written. What was pulled is the hub's cache on
disk, which every worker shares and a restart keeps: a worker finds a pulled
model by looking there (``find``, from a worker thread) and remembers it, so
every worker answers for the same names. Reads (``get``, ``models``) take no lock:
a writer replaces the mapping of pulled models whole, under a lock of its own.
"""

import re
import types
from pathlib import Path
from typing import Mapping, Optional

from gevent import monkey

from . import hub
from .catalog import local_file
from .config import ModelSpec

# A real lock, not gevent's: writers are worker threads.
_allocate_lock = monkey.get_original("_thread", "allocate_lock")

HUB_NAME = re.compile(r"(?:hf\.co|huggingface\.co)/([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([\w.-]+))?\Z")
QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=\.gguf$|[.-])", re.IGNORECASE)


def hub_source(name: str) -> Optional[tuple[str, Optional[str]]]:
    """(repository, tag or None) of an ``hf.co/{owner}/{repo}:{tag}`` name; None for any other name."""
    match = HUB_NAME.match(name)
    if match is None:
        return None
    repo_id, tag = match.groups()
    return repo_id, None if tag in (None, "latest") else tag


def tag_of(filename: str) -> str:
    """The tag a pulled file answers by: the quantization its name carries, else its name."""
    match = QUANT.search(Path(filename).name)
    return match.group(1) if match else filename


def canonical_name(repo_id: str, filename: str) -> str:
    return f"hf.co/{repo_id}:{tag_of(filename)}"


class ModelRegistry:
    """The configured models (``configured``, read-only) and the pulled ones this worker has found."""

    def __init__(self, configured: Mapping[str, ModelSpec]) -> None:
        self.configured = types.MappingProxyType(dict(configured))
        self._pulled: Mapping[str, ModelSpec] = types.MappingProxyType({})
        self._lock = _allocate_lock()

    def get(self, model_id: str) -> Optional[ModelSpec]:
        """The model's spec, configured or found pulled; None if this worker knows no such model."""
        spec = self.configured.get(model_id)
        return spec if spec is not None else self._pulled.get(model_id)

    def __contains__(self, model_id: str) -> bool:
        return self.get(model_id) is not None

    def models(self) -> dict[str, ModelSpec]:
        """Every model known now, configured first (a copy)."""
        return {**self.configured, **self._pulled}

    def find(self, name: str) -> Optional[str]:
        """Blocking (it reads the hub's cache): the model id a canonical hub name answers for, remembered if it is
        a file pulled before (by any worker); the file of a configured model is that model. None if none."""
        if name in self.configured:
            return name
        source = hub_source(name)
        if source is None:
            return None
        repo_id, tag = source
        for cached in hub.cached_files():
            if cached.repo_id == repo_id and (tag is None or tag.lower() in (
                    tag_of(cached.filename).lower(), cached.filename.lower())):
                return self._served_as(cached, self._configured_files())
        return None

    def pulled(self) -> list[str]:
        """Blocking (it reads the hub's cache): the canonical names of the pulled files that are no configured
        model's, as every worker sees them."""
        configured = self._configured_files()
        names = (self._served_as(cached, configured) for cached in hub.cached_files())
        return list(dict.fromkeys(name for name in names if name not in self.configured))

    def _configured_files(self) -> dict[Path, str]:
        files = {}
        for model_id, spec in self.configured.items():
            path = local_file(spec)
            if path is not None:
                files.setdefault(path.resolve(), model_id)
        return files

    def _served_as(self, cached: hub.CachedFile, configured: dict[Path, str]) -> str:
        """The id a cached file is served as: a configured model's, or its canonical name (remembered)."""
        model_id = configured.get(cached.path.resolve())
        if model_id is not None:
            return model_id
        canonical = canonical_name(cached.repo_id, cached.filename)
        if canonical not in self._pulled:
            with self._lock:
                self._pulled = types.MappingProxyType(
                    {**self._pulled, canonical: ModelSpec(repo_id=cached.repo_id, filename=cached.filename)})
        return canonical

    def forget(self, model_id: str) -> None:
        """A pulled model's file was removed."""
        with self._lock:
            pulled = dict(self._pulled)
            pulled.pop(model_id, None)
            self._pulled = types.MappingProxyType(pulled)
