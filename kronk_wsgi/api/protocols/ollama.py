"""The Ollama API: /api/chat and /api/generate as NDJSON, embeddings, and the model listing and management
that Ollama's clients look at first.

Models answer by Ollama's ``name:tag`` names: a configured id as itself or
``id:latest``, a GGUF file in the hub's cache as ``hf.co/{owner}/{repo}:{quant}``
(served as it is, once pulled). Options follow Ollama's defaults and names;
docs/PROTOCOLS.rst says what each field does here.
"""

import datetime
import hashlib
import json
import re
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, Mapping, Optional, Union

import flask
import gevent
import pydantic
from flask import Blueprint, Response, jsonify

from ... import __version__, hub
from ...catalog import local_file
from ...config import ModelSpec, cache_dir
from ...describe import ModelFacts, model_facts
from ...engine.chat_template import fill_in_middle
from ...engine.gguf_file import BadModelFile
from ...engine.sampling import SamplingParams
from ...model_registry import ModelRegistry, canonical_name, hub_source, tag_of
from ...serving import offload
from ...serving.events import ChoiceEnd, Event, Failed, Finished, Logprobs, ReasoningDelta, TextDelta, ToolCall
from ...serving.reasoning import reasons
from ...serving.session import GenerationStats
from .. import pulling
from ..body import parse_body
from ..client import client_watch
from ..errors import ApiError, invalid
from ..planning import JSON_OBJECT, GenerationRequest, ReplyFormat, ToolUse
from ..protocol import Framing, Protocol
from ..response import Encoder, respond, run_to_end
from ..schemas import FunctionDefinition, Strict, template_tool, template_tool_call, template_variables
from ..sessions import start_embedding, start_generation, use_model
from ..sse import compact_json
from ..state import record, state
from .openai_chat import by_choice, token_text

# A line every Ollama client reads as "nothing new yet": a reply's delta with no text.
KEEPALIVE = '{"message":{"role":"assistant","content":""},"response":"","done":false}\n'
NDJSON = Framing("application/x-ndjson", KEEPALIVE)

bp = Blueprint("ollama", __name__)

VERSION = "0.13.0"  # the Ollama release whose API this module answers
NEVER = "2318-01-01T00:00:00Z"  # expires_at of a model kept loaded for good (Ollama's far future)
ALIASES = "ollama-aliases.json"  # /api/copy's names, in the cache directory: every worker and restart sees them


def running() -> Response:
    """GET / : the probe Ollama's clients make before anything else."""
    return Response("Ollama is running", mimetype="text/plain")


PROTOCOL = Protocol(
    "ollama", bp, prefixes=("/api/",), error_body=lambda error: {"error": error.message}, framing=NDJSON,
    open_paths=("/",), unknown_below=("/api/",), root=running,
    # What changes the models on disk, as the admin API does: behind the admin keys.
    admin_paths=("/api/pull", "/api/delete", "/api/copy", "/api/create", "/api/push", "/api/blobs/"),
)


# -- bodies -------------------------------------------------------------------------------------------------

Duration = Union[int, float, str]
Think = Union[bool, Literal["low", "medium", "high"]]
Format = Union[Literal["", "json"], dict[str, Any]]


class Options(Strict):
    """Ollama's model options. Those that say how to run on the machine are the configuration's to decide."""

    # Sampling and the reply, honoured.
    seed: Optional[int] = None
    num_predict: Optional[int] = None
    top_k: Optional[Annotated[int, pydantic.Field(ge=0)]] = None
    top_p: Optional[Annotated[float, pydantic.Field(gt=0, le=1)]] = None
    min_p: Optional[Annotated[float, pydantic.Field(ge=0, le=1)]] = None
    temperature: Optional[Annotated[float, pydantic.Field(ge=0, le=100)]] = None  # past 100: as flat as it gets
    repeat_penalty: Optional[Annotated[float, pydantic.Field(ge=0.01, le=10)]] = None
    repeat_last_n: Optional[Annotated[int, pydantic.Field(ge=-1)]] = None
    presence_penalty: Optional[Annotated[float, pydantic.Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[float, pydantic.Field(ge=-2, le=2)]] = None
    stop: Optional[list[str]] = None
    num_ctx: Optional[Annotated[int, pydantic.Field(ge=1)]] = None
    # Samplers this server does not have: only their "off" values.
    typical_p: Optional[float] = None
    tfs_z: Optional[float] = None
    mirostat: Optional[int] = None
    mirostat_tau: Optional[float] = None  # used by mirostat only
    mirostat_eta: Optional[float] = None
    # No effect in Ollama either, or none here: no context shift (a prompt that does not fit is a 400).
    num_keep: Optional[int] = None
    penalize_newline: Optional[bool] = None
    # The machine: threads, batches, GPUs and memory maps are the server's configuration.
    numa: Optional[bool] = None
    num_batch: Optional[int] = None
    num_gpu: Optional[int] = None
    main_gpu: Optional[int] = None
    low_vram: Optional[bool] = None
    f16_kv: Optional[bool] = None
    logits_all: Optional[bool] = None
    vocab_only: Optional[bool] = None
    use_mmap: Optional[bool] = None
    use_mlock: Optional[bool] = None
    embedding_only: Optional[bool] = None
    num_thread: Optional[int] = None

    @pydantic.field_validator("typical_p", "tfs_z", "mirostat")
    @classmethod
    def _off(cls, value: Optional[float], info: pydantic.ValidationInfo) -> Optional[float]:
        off = 0 if info.field_name == "mirostat" else 1
        if value is not None and value != off:
            raise ValueError(f"this server has no {info.field_name} sampling: only {off} (off) is taken")
        return value

    @pydantic.field_validator("num_predict")
    @classmethod
    def _predict(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and (value == 0 or value < -2):
            raise ValueError("num_predict is a number of tokens, or -1 (no limit) or -2 (fill the context)")
        return value


# Ollama's defaults, where they differ from OpenAI's.
DEFAULTS = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1)


class ToolFunction(Strict):
    name: str
    arguments: dict[str, Any]
    index: Optional[int] = None


class ToolCallBody(Strict):
    function: ToolFunction
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: Optional[str] = None
    images: Optional[list[str]] = None
    tool_calls: Optional[list[ToolCallBody]] = None
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None

    def for_template(self, index: int) -> dict:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [template_tool_call(c.id or f"call_{index}_{n}", c.function.name,
                                                        c.function.arguments) for n, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id or ""
            if self.tool_name:
                message["name"] = self.tool_name
        if self.thinking and self.role == "assistant":  # an earlier answer's, for the template to render or not
            message["reasoning_content"] = message["thinking"] = self.thinking
        return message


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class Generating(Strict):
    """What /api/chat and /api/generate share."""

    model: Annotated[str, pydantic.Field(min_length=1)]
    stream: bool = True
    format: Optional[Format] = None
    options: Optional[Options] = None
    keep_alive: Optional[Duration] = None
    think: Optional[Think] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, pydantic.Field(ge=0, le=20)]] = None

    def options_or_defaults(self) -> Options:
        return self.options or Options()


class ChatBody(Generating):
    messages: list[Message] = []
    tools: Optional[list[Tool]] = None


class GenerateBody(Generating):
    prompt: str = ""
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[int]] = None
    raw: bool = False
    images: Optional[list[str]] = None
    # Image generation, which this server does not do.
    width: Optional[int] = None
    height: Optional[int] = None
    steps: Optional[int] = None


class EmbedBody(Strict):
    model: Annotated[str, pydantic.Field(min_length=1)]
    input: Union[str, Annotated[list[str], pydantic.Field(max_length=2048)]]
    truncate: bool = True
    options: Optional[Options] = None
    keep_alive: Optional[Duration] = None
    dimensions: Optional[int] = None


class EmbeddingsBody(Strict):
    model: Annotated[str, pydantic.Field(min_length=1)]
    prompt: str
    options: Optional[Options] = None
    keep_alive: Optional[Duration] = None


class Named(Strict):
    """A body that names one model, as ``model`` or (deprecated) ``name``."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: bool = False  # /api/show: arrays of the file's metadata too
    stream: bool = True  # /api/pull
    # /api/pull: the hub is reached as the server's environment says (HF_ENDPOINT, HF_TOKEN)
    insecure: bool = False
    username: Optional[str] = None
    password: Optional[str] = None

    @property
    def named(self) -> str:
        name = self.model or self.name
        if not name:
            raise invalid("model is required", param="model")
        return name


class CopyBody(Strict):
    source: Annotated[str, pydantic.Field(min_length=1)]
    destination: Annotated[str, pydantic.Field(min_length=1, max_length=200)]


# -- names ----------------------------------------------------------------------------------------------------

def _name(model_id: str) -> str:
    """A model id as Ollama's clients show it: with a tag."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else model_id + ":latest"


def _aliases() -> dict[str, str]:
    path = cache_dir() / ALIASES
    try:
        aliases = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return aliases if isinstance(aliases, dict) else {}


def _write_aliases(aliases: dict[str, str]) -> None:
    path = cache_dir() / ALIASES
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
    partial.write_text(json.dumps(aliases, indent=1, sort_keys=True))
    partial.replace(path)


def _configured(models: Mapping[str, ModelSpec], name: str) -> Optional[str]:
    """Runs in a worker thread: the model a name answers for as Ollama resolves names (case-insensitive, no tag
    meaning ``latest``), and a hub name the file of a model answers for; None if none."""
    base, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
    for model_id in models:
        id_base, _, id_tag = model_id.rpartition(":") if ":" in model_id.rsplit("/", 1)[-1] else (model_id, "", "latest")
        if id_base.lower() == base.lower() and id_tag.lower() == tag.lower():
            return model_id
    source = hub_source(name)
    if source is None:
        return None
    repo_id, quant = source
    for model_id, spec in models.items():
        if spec.repo_id == repo_id and (quant is None or quant.lower() in (
                (spec.quant or "").lower(), (spec.filename or "").lower(), tag_of(spec.filename or "").lower())):
            return model_id
    return None


def _find(registry: ModelRegistry, name: str) -> Optional[str]:
    """Runs in a worker thread: the model id a name answers for, a configured model first (as Ollama resolves
    names), then a name /api/copy made, then a GGUF file in the hub's cache (see ModelRegistry.find). None if
    none."""
    found = _configured(registry.configured, name)
    if found is not None:
        return found
    alias = _aliases().get(name)
    if alias is not None:
        return _configured(registry.configured, alias) or (registry.find(alias) if alias != name else None)
    return registry.find(name)


def model_id_of(name: str) -> str:
    """The configured (or pulled) model a name answers for; 404 in Ollama's words if none."""
    found = offload.call(gevent.get_hub().threadpool, _find, state().models, name)
    if found is None:
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise ApiError(404, f"model {shown!r} not found, try pulling it first", code="model_not_found", param="model")
    return found


def _facts(spec: ModelSpec) -> Optional[tuple[Path, ModelFacts]]:
    """Runs in a worker thread: the model's file and what it says, if the file is on this machine."""
    path = local_file(spec)
    if path is None or not path.is_file():
        return None
    try:
        return path, model_facts(path)
    except (OSError, BadModelFile):
        return None


def facts_of(model_id: str) -> Optional[tuple[Path, ModelFacts]]:
    return offload.call(gevent.get_hub().threadpool, _facts, state().models.get(model_id))


def _size_label(parameters: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= scale:
            return f"{parameters / scale:.1f}{unit}".replace(".0" + unit, unit)
    return str(parameters)


def _details(facts: Optional[ModelFacts]) -> dict:
    if facts is None:
        return {"parent_model": "", "format": "gguf", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}
    return {"parent_model": "", "format": "gguf", "family": facts.architecture, "families": [facts.architecture],
            "parameter_size": _size_label(facts.parameters), "quantization_level": facts.quantization}


def _digest(path: Optional[Path]) -> str:
    """The file's SHA-256 where the hub's cache names its blob by it; else a hash of its path, size and time."""
    if path is None:
        return ""
    blob = path.resolve()
    if hub.SHA256.fullmatch(blob.name):
        return blob.name
    stat = path.stat()
    return hashlib.sha256(f"{blob}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()


def _timestamp(seconds: Optional[float] = None) -> str:
    when = datetime.datetime.fromtimestamp(time.time() if seconds is None else seconds, datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _listing(models: dict[str, ModelSpec]) -> list[dict]:
    """Runs in a worker thread: every model a client can name, configured and pulled, as /api/tags lists them."""
    rows, seen = [], set()
    for model_id, spec in list(models.items()):
        found = _facts(spec)
        path, facts = found if found else (None, None)
        seen.add(path.resolve() if path else None)
        rows.append(_tag_row(_name(model_id), path, facts))
    for cached in hub.cached_files():
        if cached.path.resolve() in seen:
            continue
        seen.add(cached.path.resolve())
        try:
            facts = model_facts(cached.path)
        except (OSError, BadModelFile):
            continue
        rows.append(_tag_row(canonical_name(cached.repo_id, cached.filename), cached.path, facts))
    return rows


def _tag_row(name: str, path: Optional[Path], facts: Optional[ModelFacts]) -> dict:
    stat = path.stat() if path else None
    return {"name": name, "model": name, "modified_at": _timestamp(stat.st_mtime if stat else 0),
            "size": stat.st_size if stat else 0, "digest": _digest(path), "details": _details(facts)}


# -- listing and describing -------------------------------------------------------------------------------------

@bp.route("/api/version", methods=["GET", "HEAD"])
def version():
    """The Ollama API version answered here, and this server's own."""
    return jsonify({"version": VERSION, "server": f"kronk-wsgi {__version__}"})


@bp.route("/api/tags", methods=["GET", "HEAD"])
def tags():
    """Configured models and the GGUF files in the hub's cache."""
    return jsonify({"models": offload.call(gevent.get_hub().threadpool, _listing, state().models.models())})


@bp.get("/api/ps")
def ps():
    """Loaded models: memory, context and when they are unloaded if left unused."""
    pool = state().pool
    rows = []
    for model in pool.loaded():
        found = facts_of(model.id)
        expires = pool.expires(model)
        rows.append({
            **_tag_row(_name(model.id), found[0] if found else None, found[1] if found else None),
            "size": model.memory, "size_vram": 0, "context_length": model.engine.context_length,
            "expires_at": NEVER if expires is None else _timestamp(expires),
        })
    for row in rows:
        row.pop("modified_at")
    return jsonify({"models": rows})


@bp.post("/api/show")
def show():
    """A model's details, metadata, template and what it can do."""
    body = parse_body(Named, json_type=False)
    model_id = model_id_of(body.named)
    found = facts_of(model_id)
    if found is None:
        raise ApiError(404, f"model {body.named!r} is not on this machine yet: it downloads on its first use",
                       code="model_not_found", param="model")
    path, facts = found
    spec = state().models.get(model_id)
    loaded = state().pool.loaded_model(model_id)
    context = loaded.engine.context_length if loaded else (spec.context_length or facts.context_length)
    info = {key: value if body.verbose or not isinstance(value, list) else None
            for key, value in facts.metadata.items() if key != "tokenizer.chat_template"}
    info["general.parameter_count"] = facts.parameters
    if context:
        info[f"{facts.architecture}.context_length"] = context  # the context served here
    template = facts.template_source(spec.chat_template)
    return jsonify({
        "modelfile": f"# Served by kronk-wsgi {__version__}\nFROM {path.name}\n", "parameters": _parameters(),
        "template": template, "details": _details(facts), "model_info": info,
        "capabilities": _capabilities(facts, template), "modified_at": _timestamp(path.stat().st_mtime),
    })


def _parameters() -> str:
    defaults = {"temperature": DEFAULTS.temperature, "top_k": DEFAULTS.top_k, "top_p": DEFAULTS.top_p,
                "repeat_penalty": DEFAULTS.repetition_penalty}
    return "\n".join(f"{key:<15}{value}" for key, value in defaults.items())


def _capabilities(facts: ModelFacts, template: str) -> list[str]:
    """What the model does here: every model completes, embeds and takes tools (written into its prompt where
    its template has none); thinking where its template has thinking tags; insert where its vocabulary can."""
    found = ["completion", "tools", "embedding"]
    if reasons(template):
        found.append("thinking")
    if fill_in_middle(facts.control, "", "") is not None:
        found.append("insert")
    return found


# -- generating -------------------------------------------------------------------------------------------------

MAX_KEEP_ALIVE = 10 * 365 * 86400


def keep_alive_seconds(value: Optional[Duration]) -> Optional[float]:
    """A keep_alive as seconds (negative: for good); None if not given. 400 if it is not a duration."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif re.fullmatch(r"-?\d+(\.\d+)?", value.strip()):
        seconds = float(value.strip())
    else:
        units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
        match = re.fullmatch(r"(-?)((?:\d+(?:\.\d+)?(?:h|ms|m|s|us|µs|ns))+)", value.strip())
        if match is None:
            raise invalid(f"keep_alive {value[:50]!r} is not a duration such as 5m, 1h30m or 300 (seconds)",
                          param="keep_alive")
        seconds = sum(float(number) * units[unit]
                      for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns)", match.group(2)))
        seconds = -seconds if match.group(1) else seconds
    if seconds > MAX_KEEP_ALIVE:
        raise invalid(f"keep_alive is longer than {MAX_KEEP_ALIVE:.0f} seconds (ten years); a negative one keeps "
                      "the model loaded for good", param="keep_alive")
    return seconds


def requested_keep_alive(value: Optional[Duration]) -> Optional[float]:
    """A request's keep_alive as seconds (``keep_alive_seconds``); 0, which unloads the model for everyone, is 403
    unless the request's key is an admin key (or the server has no keys)."""
    seconds = keep_alive_seconds(value)
    if seconds == 0 and not record().admin:
        raise ApiError(403, "keep_alive 0 unloads the model for everyone: on a server with API keys that takes an "
                       "admin key (or POST /admin/models/{id}/unload)", code="admin_only", param="keep_alive")
    return seconds


def sampling(options: Options) -> SamplingParams:
    """Ollama's options as sampling parameters, Ollama's defaults where they are left out."""
    window = options.repeat_last_n
    return SamplingParams(
        temperature=DEFAULTS.temperature if options.temperature is None else options.temperature,
        top_p=DEFAULTS.top_p if options.top_p is None else options.top_p,
        top_k=DEFAULTS.top_k if options.top_k is None else options.top_k,
        min_p=options.min_p or 0.0,
        repetition_penalty=DEFAULTS.repetition_penalty if options.repeat_penalty is None else options.repeat_penalty,
        presence_penalty=options.presence_penalty or 0.0, frequency_penalty=options.frequency_penalty or 0.0,
        seed=options.seed, repetition_window=64 if window is None else (1 << 30 if window == -1 else window),
    )


def reply_format(value: Optional[Format]) -> Optional[ReplyFormat]:
    if not value:
        return None
    if value == "json":
        return ReplyFormat(JSON_OBJECT, strict=False, param="format")
    return ReplyFormat(value, strict=True, param="format")


def thinking(body: Generating, template: Optional[str], name: str) -> Optional[bool]:
    """``think`` as the template's switch; 400 if thinking is asked of a model whose template has none."""
    if body.think is None:
        return None
    wanted = body.think is not False
    if wanted and (template is None or not reasons(template)):
        raise invalid(f"{name!r} does not support thinking", param="think")
    return wanted


def _template_of(model_id: str) -> Optional[str]:
    loaded = state().pool.loaded_model(model_id)
    if loaded is not None:
        return loaded.template.source
    found = facts_of(model_id)
    return found[1].template_source(state().models.get(model_id).chat_template) if found else None


def generation_request(body: Generating, model_id: str, **prompt: Any) -> GenerationRequest:
    """What the shared fields ask for, with the prompt (messages or prompts) the endpoint made."""
    options = body.options_or_defaults()
    max_tokens = options.num_predict if options.num_predict and options.num_predict > 0 else None
    return GenerationRequest(
        model_id, reply_format=reply_format(body.format), sampling=sampling(options),
        stop=tuple(options.stop or ()), max_tokens=max_tokens, max_tokens_param="options.num_predict",
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None, context=options.num_ctx,
        context_param="options.num_ctx",
        template_vars=template_variables(body.think if isinstance(body.think, str) else None), **prompt,
    )


def _no_images(images: Optional[list[str]], param: str) -> None:
    if images:
        raise invalid("this server has no vision: its models read text only", param=param)


@bp.post("/api/chat")
def chat():
    """The next message of a conversation, streamed as NDJSON unless ``stream`` is false."""
    body = parse_body(ChatBody, json_type=False)
    for index, message in enumerate(body.messages):
        _no_images(message.images, f"messages[{index}].images")
    model_id = model_id_of(body.model)
    keep_alive = requested_keep_alive(body.keep_alive)
    if not body.messages:
        return _load_or_unload(model_id, body.model, keep_alive, chat=True)
    tools = None
    if body.tools:
        tools = ToolUse(tuple(template_tool(t.function.name, t.function.description, t.function.parameters)
                              for t in body.tools),
                        strict=frozenset(t.function.name for t in body.tools if t.function.strict))
    request = generation_request(
        body, model_id, prompt_param="messages", messages=[m.for_template(i) for i, m in enumerate(body.messages)],
        tools=tools, thinking=thinking(body, _template_of(model_id), body.model),
    )
    return _answer(request, body, keep_alive, chat=True)


@bp.post("/api/generate")
def generate():
    """A completion of ``prompt`` (in the chat template unless ``raw``; between it and ``suffix`` if given)."""
    body = parse_body(GenerateBody, json_type=False)
    _no_images(body.images, "images")
    for field in ("width", "height", "steps"):
        if getattr(body, field) is not None:
            raise invalid("this server does not generate images", param=field)
    if body.template:
        raise invalid("template: Ollama's Go templates are not run here; the model's chat template is used "
                      "(or send raw prompts)", param="template")
    if body.context:
        raise invalid("context is not kept here: send the conversation to /api/chat", param="context")
    model_id = model_id_of(body.model)
    keep_alive = requested_keep_alive(body.keep_alive)
    if not body.prompt and body.suffix is None:
        return _load_or_unload(model_id, body.model, keep_alive, chat=False)
    if body.suffix is not None:
        found = facts_of(model_id)
        filled = fill_in_middle(found[1].control if found else (), body.prompt, body.suffix)
        if filled is None:
            raise invalid(f"{body.model!r} does not support insert: its vocabulary has no fill-in-the-middle tokens",
                          param="suffix")
        request = generation_request(body, model_id, prompt_param="prompt", prompts=[filled])
    elif body.raw:
        if body.system:
            raise invalid("system is not used with raw prompts: write it into the prompt", param="system")
        request = generation_request(body, model_id, prompt_param="prompt", prompts=[body.prompt])
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        request = generation_request(body, model_id, prompt_param="prompt", messages=messages,
                                     thinking=thinking(body, _template_of(model_id), body.model))
    return _answer(request, body, keep_alive, chat=False)


def _answer(request: GenerationRequest, body: Generating, keep_alive: Optional[float], chat: bool) -> Response:
    session = start_generation(request)
    encoder = OllamaEncoder(body.model, chat, body.logprobs, session.stats, session.started, record().load_seconds)
    response = respond(session, encoder, body.stream)
    _set_keep_alive_after(response, request.model, keep_alive)
    return response


def _set_keep_alive_after(response: Response, model_id: str, keep_alive: Optional[float]) -> None:
    """Apply a keep_alive once the response has gone out (and its session has let the model go)."""
    if keep_alive is not None:
        pool = state().pool
        response.call_on_close(lambda: pool.set_keep_alive(model_id, keep_alive))


def _load_or_unload(model_id: str, name: str, keep_alive: Optional[float], chat: bool) -> Response:
    """An empty prompt: load the model (done_reason "load"), or with keep_alive 0 unload it ("unload")."""
    pool = state().pool
    if keep_alive == 0:
        pool.set_keep_alive(model_id, 0)  # now if unused, else when its requests end
        reason = "unload"
    else:
        with use_model(model_id):
            pass
        if keep_alive is not None:
            pool.set_keep_alive(model_id, keep_alive)
        reason = "load"
    line = {"model": name, "created_at": _timestamp(), "done": True, "done_reason": reason}
    line.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return jsonify(line)


# -- encoding ---------------------------------------------------------------------------------------------------

def _line(obj: dict) -> str:
    return compact_json(obj) + "\n"


def _tool_call(event: ToolCall, number: int) -> dict:
    try:
        arguments = json.loads(event.arguments)
    except ValueError:  # a call cut short by max_tokens: its text as it is
        arguments = {"": event.arguments}
    return {"id": "call_" + event.id, "function": {"index": number, "name": event.name, "arguments": arguments}}


class OllamaEncoder(Encoder):
    """NDJSON lines: a delta per piece of text, thinking or tool call, then a last line with done, done_reason and
    Ollama's statistics in nanoseconds; a failure after the first line is one more line with ``error``."""

    protocol = PROTOCOL

    def __init__(self, name: str, chat: bool, logprobs: bool, stats: GenerationStats, started: float,
                 load_seconds: float) -> None:
        """``stats`` are the session's, filled in as it runs; ``started`` is when the request began (monotonic)."""
        super().__init__()
        self.name = name
        self.chat = chat
        self.with_logprobs = logprobs
        self.stats = stats
        self.started = started
        self.load_seconds = load_seconds
        self.reason = "stop"
        self.calls = 0

    def _delta(self, content: str = "", thinking: str = "", calls: Optional[list[dict]] = None,
               logprobs: Optional[list[dict]] = None, done: bool = False) -> dict:
        line: dict[str, Any] = {"model": self.name, "created_at": _timestamp()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            line["message"] = message
        else:
            line["response"] = content
            if thinking:
                line["thinking"] = thinking
        if logprobs:
            line["logprobs"] = logprobs
        line["done"] = done
        return line

    def _logprobs(self) -> Optional[list[dict]]:
        if not self.with_logprobs:
            return None
        return [{"token": token_text(t.piece), "logprob": t.logprob, "bytes": list(t.piece),
                 "top_logprobs": [{"token": token_text(p), "logprob": lp, "bytes": list(p)} for p, lp in t.top]}
                for t in self.take_logprobs()]

    def _stats(self, finished: Finished) -> dict:
        now = time.monotonic()
        first = self.stats.time_to_first_token
        waited = self.stats.queue_wait or 0.0
        first_at = self.started + (first if first is not None else now - self.started)
        return {
            "done_reason": self.reason, "total_duration": _ns(now - self.started),
            "load_duration": _ns(self.load_seconds), "prompt_eval_count": finished.usage.prompt_tokens,
            "prompt_eval_duration": _ns(max(0.0, first_at - self.started - waited)),
            "eval_count": finished.usage.completion_tokens, "eval_duration": _ns(max(0.0, now - first_at)),
        }

    def start(self) -> Iterator[str]:
        yield _line(self._delta())

    def text(self, event: TextDelta) -> Iterator[str]:
        yield _line(self._delta(event.text, logprobs=self._logprobs()))

    def reasoning(self, event: ReasoningDelta) -> Iterator[str]:
        yield _line(self._delta(thinking=event.text))

    def tool_call(self, event: ToolCall) -> Iterator[str]:
        self.calls += 1
        yield _line(self._delta(calls=[_tool_call(event, self.calls - 1)]))

    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        self.reason = "length" if event.reason == "length" else "stop"
        rest = self._logprobs()
        if rest:
            yield _line(self._delta(logprobs=rest))

    def finished(self, event: Finished) -> Iterator[str]:
        yield _line({**self._delta(done=True), **self._stats(event)})

    def failed(self, event: Failed) -> Iterator[str]:
        yield _line({"model": self.name, "created_at": _timestamp(), "error": event.message, "done": True})

    def whole(self, output: list[Event], finished: Finished) -> dict:
        events = by_choice(output, 1)[0]
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        calls = [_tool_call(e, n) for n, e in enumerate(e for e in events if isinstance(e, ToolCall))]
        end = next(e for e in events if isinstance(e, ChoiceEnd))
        self.reason = "length" if end.reason == "length" else "stop"
        for event in events:
            if isinstance(event, Logprobs):
                self.logprobs(event)
        return {**self._delta(text, thought, calls, self._logprobs(), done=True), **self._stats(finished)}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


# -- embeddings -----------------------------------------------------------------------------------------------

@bp.post("/api/embed")
def embed():
    """Embeddings of one text or a list of texts (L2-normalised), too long ones cut to the context unless
    ``truncate`` is false."""
    body = parse_body(EmbedBody, json_type=False)
    if body.dimensions is not None:
        raise invalid("dimensions is not supported: these models give vectors of one size", param="dimensions")
    model_id = model_id_of(body.model)
    keep_alive = requested_keep_alive(body.keep_alive)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    started = time.monotonic()
    session = start_embedding(model_id, inputs, param="input", truncate=body.truncate)
    output, finished = run_to_end(session)
    response = jsonify({
        "model": body.model, "embeddings": [e.vector.astype(float).tolist() for e in output],
        "total_duration": _ns(time.monotonic() - started), "load_duration": _ns(record().load_seconds),
        "prompt_eval_count": finished.usage.prompt_tokens,
    })
    _set_keep_alive_after(response, model_id, keep_alive)
    return response


@bp.post("/api/embeddings")
def embeddings():
    """The older endpoint: one text's embedding."""
    body = parse_body(EmbeddingsBody, json_type=False)
    model_id = model_id_of(body.model)
    keep_alive = requested_keep_alive(body.keep_alive)
    if not body.prompt:
        return jsonify({"embedding": []})
    output, _ = run_to_end(start_embedding(model_id, [body.prompt], param="prompt"))
    response = jsonify({"embedding": output[0].vector.astype(float).tolist()})
    _set_keep_alive_after(response, model_id, keep_alive)
    return response


# -- managing -------------------------------------------------------------------------------------------------

@bp.post("/api/pull")
def pull():
    """Download an ``hf.co/{owner}/{repo}:{quant}`` GGUF file into the hub's cache, its progress as Ollama's
    status lines; the model answers by that name once it is there."""
    body = parse_body(Named, json_type=False)
    name = body.named
    source = hub_source(name)
    if source is None:
        raise invalid(f"{name[:100]!r}: this server pulls GGUF files from the Hugging Face hub, named "
                      "hf.co/{owner}/{repo}:{quant}; it has no registry of its own", param="model")
    repo_id, quant = source
    try:
        hub.check_filename(quant)
        filename = _resolve_pull(repo_id, quant)
    except hub.HubError as exc:
        raise ApiError(400, str(exc), code="pull_failed", param="model") from None
    settings = state().settings
    news = pulling.pull(repo_id, filename, None, settings.keepalive_interval, settings.load_timeout,
                        client_watch(flask.request.environ))
    digest = "sha256:" + hashlib.sha256(f"{repo_id}/{filename}".encode()).hexdigest()
    frames = _pull_lines(news, digest)
    if body.stream:
        return PROTOCOL.stream(frames)
    last = json.loads(list(frames)[-1])
    if "error" in last:
        raise ApiError(500, last["error"], code="pull_failed")
    return jsonify(last)


def _resolve_pull(repo_id: str, quant: Optional[str]) -> str:
    """The file a pull fetches: the one the tag names, else the only one, else Q4_K_M (Ollama's choice)."""
    try:
        return pulling.resolve(repo_id, quant, None)
    except hub.HubError:
        if quant is not None:
            raise
        return pulling.resolve(repo_id, "Q4_K_M", None)


def _pull_lines(news: Iterator[pulling.News], digest: str) -> Iterator[str]:
    yield _line({"status": "pulling manifest"})
    for item in news:
        if isinstance(item, pulling.Progress):
            yield _line({"status": f"pulling {digest[7:19]}", "digest": digest, "total": item.total or 0,
                         "completed": item.done})
        elif isinstance(item, pulling.Pulled):
            yield _line({"status": f"pulling {digest[7:19]}", "digest": digest, "total": item.size,
                         "completed": item.size})
            yield _line({"status": "verifying sha256 digest"})
            yield _line({"status": "writing manifest"})
            yield _line({"status": "success"})
        elif isinstance(item, pulling.PullFailed):
            yield _line({"error": item.message})
        else:
            yield _line({"status": f"pulling {digest[7:19]}", "digest": digest})


@bp.delete("/api/delete")
def delete():
    """Remove a pulled model's file from the hub's cache, or a name /api/copy made."""
    body = parse_body(Named, json_type=False)
    name = body.named
    aliases = _aliases()
    if name in aliases:
        del aliases[name]
        offload.call(gevent.get_hub().threadpool, _write_aliases, aliases)
        return Response(status=200)
    model_id = model_id_of(name)
    kronk = state()
    spec = kronk.models.get(model_id)
    pulled = spec.repo_id is not None and spec == ModelSpec(repo_id=spec.repo_id, filename=spec.filename)
    if not pulled or hub_source(model_id) is None:
        raise invalid(f"{name!r} is in the server's configuration: remove it there", param="model")
    if kronk.pool.loaded_model(model_id) is not None and not kronk.pool.unload(model_id, "deleted"):
        raise ApiError(409, f"{name!r} is in use: delete it once its requests end", code="model_in_use")
    try:
        offload.call(gevent.get_hub().threadpool, _remove_file, spec)
    except hub.HubError as exc:
        raise ApiError(404, str(exc), code="model_not_found", param="model") from None
    kronk.models.forget(model_id)
    return Response(status=200)


def _remove_file(spec: ModelSpec) -> None:
    """Runs in a worker thread: remove the cached file a pulled model is served from."""
    path = local_file(spec)
    filename = next((f.filename for f in hub.cached_files() if f.path == path), None)
    if filename is None:
        raise hub.HubError(f"nothing of {spec.repo_id} is in the hub's cache")
    hub.remove(spec.repo_id, filename)


@bp.post("/api/copy")
def copy():
    """Another name for a model, kept in the cache directory for every worker."""
    body = parse_body(CopyBody, json_type=False)
    model_id_of(body.source)
    models = state().models.configured
    if offload.call(gevent.get_hub().threadpool, _configured, models, body.destination) is not None:
        raise invalid(f"{body.destination!r} already answers for a model: a copy cannot take its name",
                      param="destination")
    aliases = _aliases()
    aliases[body.destination] = aliases.get(body.source, body.source)
    offload.call(gevent.get_hub().threadpool, _write_aliases, aliases)
    return Response(status=200)


@bp.route("/api/create", methods=["POST"])
@bp.route("/api/push", methods=["POST"])
@bp.route("/api/blobs/<digest>", methods=["HEAD", "POST"])
def not_here(digest: str = ""):
    """Modelfiles, blobs and a registry to push to are Ollama's own: this server serves GGUF files."""
    raise invalid("/api/create, /api/push and /api/blobs are not supported: kronk-wsgi serves GGUF files from its "
                  "configuration or the Hugging Face hub (pull hf.co/{owner}/{repo}:{quant})")
