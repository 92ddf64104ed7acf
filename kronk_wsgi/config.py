"""Settings: defaults < TOML file < KRONK_* environment variables < flags.

Every setting has one name. In the environment and in Flask's app.config it is
``KRONK_<NAME>``; in the TOML file it is ``<name>`` in lower case, with models
as tables (``[models.<id>]``).
"""

import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field

DEMO_MODEL_ID = "kronk-demo"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(address: str) -> str:
    """The host of ``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if address.startswith("["):
        return address[1:].partition("]")[0]
    return address.rpartition(":")[0] if ":" in address else address


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and why."""


class Speculative(BaseModel):
    """Speculative decoding of a model's replies: drafts checked several tokens in one decode call (engines that
    can: llama.cpp). ``type`` "ngram" drafts by n-gram lookup in the prompt and the reply; "draft" with
    ``draft_model``, a GGUF file of a smaller model with the same vocabulary (llama-server's --model-draft), run
    on llama.cpp beside it, a slot of its own per slot. ``n_max``: the longest draft; ``n_min``: the shortest,
    checked wherever a match (or the draft model) offers that many whether it pays or not (0: as long as pays, or
    none); ``p_min``: a draft model's draft stops at a token it gives less than this probability."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ngram", "draft"] = "ngram"
    n_max: int = Field(64, ge=1, le=64)
    n_min: int = Field(0, ge=0, le=64)
    p_min: float = Field(0.0, ge=0, le=1)
    draft_model: Optional[str] = None

    @pydantic.model_validator(mode="after")
    def _draft_model_with_its_type(self) -> "Speculative":
        if (self.type == "draft") != (self.draft_model is not None):
            raise ValueError('type "draft" takes a draft_model, and only it does')
        if self.n_min > self.n_max:
            raise ValueError(f"n_min {self.n_min} is more than n_max {self.n_max}, the longest draft")
        return self


class ModelSampling(BaseModel):
    """A model's own sampling defaults, used where a request is silent (llama-server's names, as in its flags and
    a GGUF file's ``general.sampling.*``); a field left out keeps the file's value, else the protocol's default."""

    model_config = ConfigDict(extra="forbid")

    temperature: Optional[float] = Field(None, ge=0)
    top_k: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repeat_penalty: Optional[float] = Field(None, gt=0)
    repeat_last_n: Optional[int] = Field(None, ge=-1)  # -1: the whole context
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None  # a request without a seed draws with this one (llama-server's --seed)

    def over_file(self, written: Mapping[str, Any]) -> tuple["ModelSampling", list[str]]:
        """These settings over a model file's own (``general.sampling.*`` by the keys' last part), and the file's
        keys this server does not apply: samplers it lacks (XTC, Mirostat), an order, a value out of bounds."""
        taken, left = {}, []
        for key, value in written.items():
            name = FILE_SAMPLING.get(key)
            try:
                if name is None:
                    raise ValueError(key)
                taken[name] = getattr(ModelSampling(**{name: value}), name)
            except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
                left.append(key)
        given = self.model_dump(exclude_none=True)
        return ModelSampling(**{**taken, **given}), sorted(left)


# A GGUF file's general.sampling keys (their last part) that this server's sampler applies, by ModelSampling's names
FILE_SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "penalty_repeat": "repeat_penalty", "penalty_last_n": "repeat_last_n"}


class ModelSpec(BaseModel):
    """One served model: where its file comes from and how to run it."""

    model_config = ConfigDict(extra="forbid")

    # A local model file; for a model on gRPC workers (engine "grpc") a GGUF file or a folder of Hugging Face
    # tokenizer files, or nothing: the workers' tokenizer then
    path: Optional[str] = None
    repo_id: Optional[str] = None  # or a GGUF file in a Hugging Face hub repository,
    filename: Optional[str] = None  # named by its file name,
    quant: Optional[str] = None  # or by its quantization (Q4_K_M, ...), or neither if the repository has one
    revision: Optional[str] = None
    demo: Optional[str] = None  # or a generated demo model of this size ("tiny", "medium")
    context_length: Optional[int] = Field(None, ge=16)  # default: the file's own
    chat_template: Optional[str] = None  # a built-in name or Jinja text; default: the file's
    # A llama.cpp model's multimodal projector (llama-server's --mmproj): images (and sounds) in its prompts. A
    # GGUF file's path; with repo_id, a file of that repository, whose own mmproj file is taken (pulled with the
    # model) if none is named; "none": no projector.
    mmproj: Optional[str] = None
    # Texts that end every reply of this model as its end-of-turn token does (Ollama's Modelfile `stop`): what
    # ends a base model's turn, or a chat format's marker the file lacks. Added to each request's own stops.
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=16)
    # The most tokens a reply has where its request sets no limit (llama-server's --n-predict, Ollama's
    # num_predict); default: the room left in the context
    max_tokens: Optional[int] = Field(None, ge=1)
    # "auto": the first engine of the registry that runs the file and takes the engine_options;
    # or "ctransformers", "llama.cpp", or "package.module:KIND"
    engine: str = "auto"
    # Options of the model's engine (ctransformers: model_type, prefill_chunk; llama.cpp: gpu_layers),
    # checked by the engine when the app starts
    engine_options: dict[str, Any] = Field(default_factory=dict)
    # Off unless given: on these machines it pays only where replies repeat the prompt (docs/BENCHMARKS.rst)
    speculative: Optional[Speculative] = None
    sampling: ModelSampling = Field(default_factory=ModelSampling)
    # "inline": the engine runs in each worker process; "process": in one runner process per host, which every
    # worker process's requests share (its slots, its batches, its prompt cache), over a Unix socket
    runner: Literal["inline", "process"] = "inline"

    def describe(self) -> str:
        """Where the model comes from, in a few words."""
        if self.repo_id is not None:
            return " ".join(filter(None, (self.repo_id, self.filename or self.quant, self.revision and f"@{self.revision}")))
        if self.path is None and self.demo is None:
            return "gRPC workers " + ", ".join(map(str, self.engine_options.get("workers") or ()))
        return self.path if self.path is not None else f"demo model ({self.demo})"

    @property
    def draft_model(self) -> Optional[Path]:
        """The file of the model its replies are drafted with, if speculation drafts with one."""
        path = self.speculative and self.speculative.draft_model
        return Path(path).expanduser() if path else None

    @pydantic.model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        sources = [self.path is not None, self.repo_id is not None, self.demo is not None]
        if sum(sources) > 1 or (sum(sources) == 0 and self.engine != "grpc"):
            raise ValueError("give exactly one of path, repo_id (+ filename) or demo (or none, for engine \"grpc\")")
        if (self.filename is not None or self.quant is not None or self.revision is not None) and self.repo_id is None:
            raise ValueError("filename, quant and revision belong with a repo_id")
        if self.filename is not None and self.quant is not None:
            raise ValueError("give filename or quant, not both")
        if self.runner == "process" and self.engine == "grpc":
            raise ValueError('runner "process" runs a local engine: a model on gRPC workers has none')
        if self.mmproj not in (None, "none") and not self._inline_llamacpp:
            raise ValueError("mmproj is read by the llama.cpp engine running inline (runner \"inline\"): images do not "
                             "reach a ctransformers model, gRPC workers or a runner process yet")
        return self

    @property
    def _inline_llamacpp(self) -> bool:
        """Whether the model may run on the llama.cpp engine in the worker itself (where a projector is read)."""
        return self.engine not in ("ctransformers", "grpc") and self.runner == "inline"

    @property
    def takes_projector(self) -> bool:
        """Whether the model loads a multimodal projector: one it names, or its repository's own."""
        return self.mmproj != "none" and self._inline_llamacpp and (self.mmproj is not None or self.repo_id is not None)


class McpServerSpec(BaseModel):
    """One MCP server the operator lets this server call, as llama-server's ``mcpServers`` JSON has it: a
    ``command`` (with ``args``, ``env``, ``cwd``) run over stdio, or a streamable HTTP ``url`` (with ``headers``);
    ``timeout_ms`` for each call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Optional[Literal["stdio", "http", "streamable-http", "streamableHttp"]] = None
    command: Optional[str] = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: Optional[str] = None
    url: Optional[Annotated[str, Field(pattern=r"^https?://")]] = None
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_ms: int = Field(30_000, ge=1)

    @pydantic.model_validator(mode="after")
    def _one_way(self) -> "McpServerSpec":
        if (self.command is None) == (self.url is None):
            raise ValueError("an MCP server has a command (stdio) or a url (streamable HTTP), one of them")
        return self


def _mcp_servers_from_text(value: Any) -> Any:
    """MCP servers from the environment or a flag: JSON, or the path of a JSON file; either llama-server's
    ``{"mcpServers": {...}}`` or the mapping itself."""
    if isinstance(value, str):
        text = value if value.lstrip().startswith("{") else Path(value).expanduser().read_text()
        value = json.loads(text)
    if isinstance(value, dict) and set(value) == {"mcpServers"}:
        value = value["mcpServers"]
    return value


def _models_from_text(value: Any) -> Any:
    """Models from the environment: JSON, or ``id=path[,id=path...]``; any other value as it is."""
    if not isinstance(value, str):
        return value
    if value.lstrip().startswith("{"):
        return json.loads(value)
    models = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        model_id, sep, path = item.partition("=")
        if not sep or not model_id or not path:
            raise ValueError(f"expected id=path, got {item!r}")
        models[model_id.strip()] = {"path": path.strip()}
    return models


class Settings(BaseModel):
    """The validated settings of one app, read and never written once made (models pulled at run time are the
    model registry's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: dict[str, ModelSpec] = Field(default_factory=lambda: {DEMO_MODEL_ID: ModelSpec(demo="tiny")})
    default_model: Optional[str] = None  # default: the only model, or the demo model
    # What `kronk-wsgi serve` pulls from the hub and serves when no model is configured: "owner/repo:QUANT";
    # empty: the generated demo model.
    default_pull: str = "bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"
    parallel: int = Field(1, ge=1)  # slots per model
    threads: Optional[int] = Field(None, ge=1)  # ggml threads per decode call; default: see threads_per_call
    workers: int = Field(1, ge=1)  # gunicorn worker processes
    queue_depth: int = Field(2, ge=1)  # admission places per slot
    admission_timeout: float = Field(180.0, gt=0)
    # Seconds a model's load (with its download, for a hub model not in the cache yet) or a pull may take.
    load_timeout: float = Field(1800.0, gt=0)
    # Requests that may wait in line for a model's admission place; past it a 429 at once. None: no limit.
    max_waiting: Optional[int] = Field(64, ge=0)
    # Background responses not finished yet, per API key and in all (each worker); past either a 429.
    max_key_background: int = Field(16, ge=1)
    max_background: int = Field(64, ge=1)
    keepalive_interval: float = Field(15.0, gt=0)
    request_timeout: float = Field(3600.0, gt=0)
    drain_timeout: float = Field(120.0, ge=0)  # on shutdown, seconds running streams may go on
    api_keys: list[str] = Field(default_factory=list)  # empty: no auth
    admin_keys: list[str] = Field(default_factory=list)  # for /admin; empty: open only if api_keys is empty too
    cors_origins: list[str] = Field(default_factory=list)  # web origins allowed to call the API ("*": any)
    # Host header names served ("*": any); empty: any, except the standalone server bound to a loopback
    # address, which serves the loopback names only (a DNS-rebinding page names its own host)
    allowed_hosts: list[str] = Field(default_factory=list)
    # Reverse proxies in front that append the client's address to X-Forwarded-For (nginx: 1); the request
    # log and the Host check then see the client, not the proxy. 0: the direct peer.
    proxy_hops: int = Field(0, ge=0)
    responses_db: Optional[str] = None  # the SQLite file of stored Responses; default: in the cache directory
    responses_keep: int = Field(10_000, ge=1)  # stored Responses kept; the oldest go first
    responses_max_mb: int = Field(512, ge=1)  # and at most this much of them
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_body_values: int = Field(20_000, ge=100)  # JSON values in one body (validation time grows with them)
    # Prompt tokens one embedding or rerank request may give its model in all (each input within the context too)
    max_request_tokens: int = Field(131_072, ge=1)
    body_timeout: float = Field(30.0, gt=0)  # seconds for a request body to arrive (408 after)
    write_timeout: float = Field(60.0, gt=0)  # seconds one write of a response may take before the server hangs up
    max_loaded_models: Optional[int] = Field(None, ge=1)  # models loaded at once per worker; None: no limit
    max_memory_mb: Optional[int] = Field(None, ge=1)  # estimated memory of loaded models per worker; None: no limit
    idle_unload_seconds: Optional[float] = Field(None, gt=0)  # unload a model unused this long (not the default)
    # Saved slot states (llama.cpp engine): per model and worker in RAM (default: an eighth of the machine's
    # memory, at most 4096; 0: none), and on disk in prompt_cache_dir, shared by every worker (0: none)
    prompt_cache_ram_mb: Optional[int] = Field(None, ge=0)
    prompt_cache_dir: Optional[str] = None  # default: prompt-cache in the cache directory
    prompt_cache_disk_mb: int = Field(4096, ge=0)
    # Whose prompts may reuse whose cached prefixes: "key", each API key's its own (with no api_keys, everyone's
    # together); "shared", every key's together (one tenant with many keys). Timing and cached_tokens would
    # otherwise tell one key what another sent.
    prompt_cache_scope: Literal["key", "shared"] = "key"
    # A request naming a model this server does not know: "not_found" (a 404), or "default": served by the default
    # model, as llama-server serving one model serves any name (for clients that send a name of their own).
    unknown_model: Literal["not_found", "default"] = "not_found"
    # Where llama-server's POST /slots/{id}?action=save and restore keep their files; None: those actions are off.
    slot_save_path: Optional[str] = None
    # What the worker processes share at run time: their models' runners (runner "process": sockets and locks),
    # the gRPC workers added and removed through the admin API. Default: a directory `kronk-wsgi serve` makes for
    # its workers; embedded, one per process unless set.
    runner_dir: Optional[str] = None
    # The MCP servers whose tools this server may call (GET and POST /tools): by name (see McpServerSpec)
    mcp_servers: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")], McpServerSpec] = Field(
        default_factory=dict)
    # The URL prefixes of the MCP servers a request may name (Responses' mcp tools, Anthropic's mcp_servers), each
    # scheme, host and port and a path from "/"; empty: a request may name only mcp_servers, by their names
    mcp_allow: list[Annotated[str, Field(pattern=r"^https?://[^/?#]+/")]] = Field(default_factory=list)
    # The URL prefixes of the images a request may name by URL (fetched here, no redirect followed, within
    # media.FETCH_SECONDS and MAX_MEDIA_BYTES), as mcp_allow's; empty: a request sends its images themselves
    media_allow: list[Annotated[str, Field(pattern=r"^https?://[^/?#]+/")]] = Field(default_factory=list)
    bind: str = "127.0.0.1:8000"

    @pydantic.field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: Any) -> Any:
        return _models_from_text(value)

    @pydantic.field_validator("mcp_servers", mode="before")
    @classmethod
    def _parse_mcp_servers(cls, value: Any) -> Any:
        try:
            return _mcp_servers_from_text(value)
        except OSError as exc:
            raise ValueError(f"the MCP servers' file cannot be read: {exc}") from None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _default_to_the_only_model(cls, data: Any) -> Any:
        """default_model, when not given and there is one model: that one."""
        if isinstance(data, dict) and data.get("default_model") is None:
            models = _models_from_text(data.get("models", {DEMO_MODEL_ID: None}))
            if isinstance(models, dict) and len(models) == 1:
                return {**data, "default_model": next(iter(models))}
        return data

    @pydantic.field_validator("api_keys", "admin_keys", "cors_origins", "allowed_hosts", "mcp_allow", "media_allow",
                              mode="before")
    @classmethod
    def _parse_list(cls, value: Any) -> Any:
        """From the environment: comma-separated, or a JSON list."""
        if isinstance(value, str):
            return json.loads(value) if value.lstrip().startswith("[") else [key.strip() for key in value.split(",")]
        return value

    @pydantic.field_validator("cors_origins")
    @classmethod
    def _check_origins(cls, origins: list[str]) -> list[str]:
        if any(not origin.strip() for origin in origins):
            raise ValueError("an origin is empty")
        return origins

    @pydantic.field_validator("api_keys", "admin_keys")
    @classmethod
    def _check_keys(cls, keys: list[str]) -> list[str]:
        """An empty key would let anyone in: refuse it, rather than turn authentication off."""
        for key in keys:
            if not key.strip():
                raise ValueError("an API key is empty; leave api_keys unset for no authentication")
            if any(c.isspace() for c in key):
                raise ValueError("an API key contains whitespace")
        return keys

    @pydantic.model_validator(mode="after")
    def _check_default(self) -> "Settings":
        if not self.models:
            raise ValueError("models: at least one model is needed")
        if self.default_model is None:
            raise ValueError(f"default_model: name one of the models {sorted(self.models)}")
        if self.default_model not in self.models:
            raise ValueError(f"default_model {self.default_model!r} is not one of the models {sorted(self.models)}")
        return self

    def loopback_bind(self) -> bool:
        """Whether the server listens on a loopback address only."""
        return host_name(self.bind) in LOOPBACK_HOSTS

    def prompt_cache_ram_bytes(self) -> int:
        if self.prompt_cache_ram_mb is not None:
            return self.prompt_cache_ram_mb * 1_000_000
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(physical // 8, 4096 * 1_000_000)

    def prompt_cache_path(self) -> Path:
        return Path(self.prompt_cache_dir).expanduser() if self.prompt_cache_dir else cache_dir() / "prompt-cache"

    def concurrent_calls(self, batched: bool) -> int:
        """Decode calls of one model that run at once on this machine.

        ctransformers slots each make their own calls (workers x parallel);
        the slots of a ``batched`` engine (llama.cpp) share one call (workers).
        """
        return self.workers * (1 if batched else self.parallel)

    def threads_per_call(self, batched: bool) -> int:
        """ggml threads of one decode call: the setting, else the cores shared evenly by the calls running at once."""
        if self.threads is not None:
            return self.threads
        return max(1, (os.cpu_count() or 1) // self.concurrent_calls(batched))

    def check_cores(self, batched: bool) -> None:
        """Refuse oversubscription: spinning ggml threads beyond the cores are 100x slower."""
        cores = os.cpu_count() or 1
        threads = self.threads_per_call(batched)
        used = self.concurrent_calls(batched) * threads
        if used > cores:
            slots = "" if batched else f" x parallel ({self.parallel})"
            raise ConfigError(
                f"workers ({self.workers}){slots} x threads ({threads}) = {used} compute threads,"
                f" but this machine has {cores} cores; lower KRONK_WORKERS{'' if batched else ', KRONK_PARALLEL'}"
                " or KRONK_THREADS"
            )


FIELDS = tuple(Settings.model_fields)


def cache_dir() -> Path:
    """kronk_wsgi's directory under the user's cache (XDG_CACHE_HOME honoured): demo models, prepared copies."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kronk_wsgi"


def config_key(name: str) -> str:
    """The app.config / environment name of a setting."""
    return "KRONK_" + name.upper()


def read_config(
    config_file: Optional[str] = None,
    environ: Mapping[str, str] = os.environ,
    flags: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """Raw KRONK_* values from the TOML file, the environment and flags, in that order."""
    raw: dict[str, Any] = {}
    config_file = config_file or environ.get("KRONK_CONFIG")
    if config_file:
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {config_file}: {exc}") from None
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ConfigError(f"config file {config_file}: unknown keys {sorted(unknown)}")
        raw.update({config_key(k): v for k, v in data.items()})
    raw.update({config_key(k): environ[config_key(k)] for k in FIELDS if config_key(k) in environ})
    raw.update({config_key(k): v for k, v in (flags or {}).items() if v is not None})
    return raw


def settings_from_config(config: Mapping[str, Any]) -> Settings:
    """Validate the KRONK_* keys of a Flask config (or any mapping)."""
    values = {name: config[config_key(name)] for name in FIELDS if config.get(config_key(name)) is not None}
    try:
        return Settings(**values)
    except (pydantic.ValidationError, json.JSONDecodeError) as exc:
        raise ConfigError(f"invalid kronk_wsgi configuration: {exc}") from None
