"""The Ollama API: /api/chat and /api/generate as NDJSON, embeddings, and the model listing and management
that Ollama's clients look at first.

Models answer by Ollama's ``name:tag`` names: a configured id as itself or
``id:latest``, a GGUF file in the hub's cache as ``hf.co/{owner}/{repo}:{quant}``
(served as it is, once pulled). Options follow Ollama's defaults and names;
docs/PROTOCOLS.rst says what each field does here.

Its parts: the protocol (protocol.py), the bodies (schemas.py), generating (views.py), the NDJSON lines
(encoder.py), and the models as Ollama names, lists and manages them (models.py).
"""

from . import models, views  # noqa: F401 (their routes join the blueprint)
from .protocol import PROTOCOL

__all__ = ["PROTOCOL"]
