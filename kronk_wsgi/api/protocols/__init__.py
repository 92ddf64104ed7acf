"""The registry of protocols: every API module kronk_wsgi serves, the first one the default for other paths.

A new protocol is one module that defines its ``PROTOCOL`` (see protocol.py)
and one line here.
"""

from . import (
    admin, anthropic, cohere, console, llama_server, ollama, openai_chat, openai_completions, openai_embeddings,
    openai_responses, service, sglang, tokens,
)
from ..protocol import Protocols

PROTOCOLS = Protocols([
    service.PROTOCOL,
    openai_chat.PROTOCOL,
    openai_responses.PROTOCOL,
    openai_completions.PROTOCOL,
    openai_embeddings.PROTOCOL,
    tokens.PROTOCOL,
    anthropic.PROTOCOL,
    admin.PROTOCOL,
    console.PROTOCOL,
    sglang.PROTOCOL,
    ollama.PROTOCOL,
    llama_server.PROTOCOL,
    cohere.PROTOCOL,
])
