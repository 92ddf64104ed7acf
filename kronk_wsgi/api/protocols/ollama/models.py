"""Ollama's model listing and management: names as Ollama resolves them, /api/tags, /api/ps, /api/show, pull,
delete and copy."""

import hashlib
import json
import re
import uuid
from pathlib import Path
from typing import Iterator, Mapping, Optional

import flask
import gevent
from flask import Response, jsonify

from .... import __version__, hub
from ....catalog import input_modalities, local_file
from ....config import ModelSampling, ModelSpec, cache_dir
from ....describe import ModelFacts, file_facts, model_facts
from ....engine.chat_template import fill_in_middle
from ....engine.gguf_file import BadModelFile
from ....model_registry import ModelRegistry, canonical_name, hub_source, tag_of
from ....serving import offload
from ....serving.reasoning import reasons
from ... import pulling
from ...body import parse_body
from ...client import client_watch
from ...errors import ApiError, invalid
from ...state import state
from .protocol import PROTOCOL, bp, line, timestamp
from .schemas import DEFAULTS, CopyBody, Named

VERSION = "0.13.0"  # the Ollama release whose API this package answers
NEVER = "2318-01-01T00:00:00Z"  # expires_at of a model kept loaded for good (Ollama's far future)
ALIASES = "ollama-aliases.json"  # /api/copy's names, in the cache directory: every worker and restart sees them


# A name /api/copy makes, as Ollama's names go: up to three parts of letters, digits, '_', '.' and '-' separated
# by '/', and a tag; no part starts with '.' or '-' (so no path, ``../x``, leads anywhere).
COPY_NAME = re.compile(r"[A-Za-z0-9_][\w.-]{0,79}(?:/[A-Za-z0-9_][\w.-]{0,79}){0,2}(?::[A-Za-z0-9_][\w.-]{0,79})?")


def _name(model_id: str) -> str:
    """A model id as Ollama's clients show it: with a tag."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else model_id + ":latest"


def _alias_key(name: str) -> str:
    """A name as copies are kept by, as Ollama compares names: case-insensitive, no tag meaning ``latest``."""
    return _name(name).lower()


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
    alias = _aliases().get(_alias_key(name))
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


def facts_of(model_id: str) -> Optional[tuple[Path, ModelFacts]]:
    return offload.call(gevent.get_hub().threadpool, file_facts, state().models.get(model_id))


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


def _listing(registry: ModelRegistry) -> list[dict]:
    """Runs in a worker thread: every model a client can name, configured, pulled and copied, as /api/tags lists
    them."""
    models = registry.models()
    rows, seen = [], set()
    for model_id, spec in list(models.items()):
        found = file_facts(spec)
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
    by_name = {row["name"]: row for row in rows}
    for copy_name, model_id in _aliases().items():  # each a model id, listed above as _name(model_id) if still there
        source = by_name.get(_name(model_id))
        if source is not None and copy_name not in by_name:
            rows.append({**source, "name": copy_name, "model": copy_name})
    return rows


def _tag_row(name: str, path: Optional[Path], facts: Optional[ModelFacts]) -> dict:
    stat = path.stat() if path else None
    return {"name": name, "model": name, "modified_at": timestamp(stat.st_mtime if stat else 0),
            "size": stat.st_size if stat else 0, "digest": _digest(path), "details": _details(facts)}


# -- listing and describing -------------------------------------------------------------------------------------

@bp.route("/api/version", methods=["GET", "HEAD"])
def version():
    """The Ollama API version answered here, and this server's own."""
    return jsonify({"version": VERSION, "server": f"kronk-wsgi {__version__}"})


@bp.route("/api/tags", methods=["GET", "HEAD"])
def tags():
    """Configured models and the GGUF files in the hub's cache."""
    return jsonify({"models": offload.call(gevent.get_hub().threadpool, _listing, state().models)})


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
            "expires_at": NEVER if expires is None else timestamp(expires),
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
    modalities = offload.call(gevent.get_hub().threadpool, input_modalities, spec, loaded.engine if loaded else None)
    return jsonify({
        "modelfile": f"# Served by kronk-wsgi {__version__}\nFROM {path.name}\n",
        "parameters": _parameters(loaded.sampling if loaded else spec.sampling.over_file(facts.sampling)[0], spec.stop),
        "template": template, "details": _details(facts), "model_info": info,
        "capabilities": _capabilities(facts, template, modalities), "modified_at": timestamp(path.stat().st_mtime),
    })


def _parameters(sampling: ModelSampling, stop: list[str]) -> str:
    """The sampling a request that sets none gets, and the model's stops, as a Modelfile's PARAMETER lines read."""
    values = {"temperature": DEFAULTS.temperature, "top_k": DEFAULTS.top_k, "top_p": DEFAULTS.top_p,
              "repeat_penalty": DEFAULTS.repetition_penalty, **sampling.model_dump(exclude_none=True)}
    lines = [f"{key:<15}{value}" for key, value in values.items()]
    return "\n".join(lines + [f"{'stop':<15}{json.dumps(text)}" for text in stop])


def _capabilities(facts: ModelFacts, template: str, modalities: list[str]) -> list[str]:
    """What the model does here: every model completes, embeds and takes tools (written into its prompt where
    its template has none); thinking where its template has thinking tags; insert where its vocabulary can;
    vision and audio where its projector reads them."""
    found = ["completion", "tools", "embedding"]
    found += [{"image": "vision", "audio": "audio"}[kind] for kind in modalities if kind != "text"]
    if reasons(template):
        found.append("thinking")
    if fill_in_middle(facts.control, "", "") is not None:
        found.append("insert")
    return found


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
    yield line({"status": "pulling manifest"})
    for item in news:
        if isinstance(item, pulling.Progress):
            yield line({"status": f"pulling {digest[7:19]}", "digest": digest, "total": item.total or 0,
                         "completed": item.done})
        elif isinstance(item, pulling.Pulled):
            yield line({"status": f"pulling {digest[7:19]}", "digest": digest, "total": item.size,
                         "completed": item.size})
            yield line({"status": "verifying sha256 digest"})
            yield line({"status": "writing manifest"})
            yield line({"status": "success"})
        elif isinstance(item, pulling.PullFailed):
            yield line({"error": item.message})
        else:
            yield line({"status": f"pulling {digest[7:19]}", "digest": digest})


@bp.delete("/api/delete")
def delete():
    """Remove a pulled model's file from the hub's cache, or a name /api/copy made."""
    body = parse_body(Named, json_type=False)
    name = body.named
    aliases, key = _aliases(), _alias_key(name)
    if key in aliases:
        del aliases[key]
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
    if not COPY_NAME.fullmatch(body.destination):
        raise invalid(f"{body.destination[:100]!r} is not a model name: letters, digits, '_', '.' and '-', up to "
                      "three parts separated by '/', and a tag after ':'", param="destination")
    model_id = model_id_of(body.source)
    models = state().models.configured
    if offload.call(gevent.get_hub().threadpool, _configured, models, body.destination) is not None:
        raise invalid(f"{body.destination!r} already answers for a model: a copy cannot take its name",
                      param="destination")
    aliases = _aliases()
    aliases[_alias_key(body.destination)] = model_id
    offload.call(gevent.get_hub().threadpool, _write_aliases, aliases)
    return Response(status=200)


@bp.route("/api/create", methods=["POST"])
@bp.route("/api/push", methods=["POST"])
@bp.route("/api/blobs/<digest>", methods=["HEAD", "POST"])
def not_here(digest: str = ""):
    """Modelfiles, blobs and a registry to push to are Ollama's own: this server serves GGUF files."""
    raise invalid("/api/create, /api/push and /api/blobs are not supported: kronk-wsgi serves GGUF files from its "
                  "configuration or the Hugging Face hub (pull hf.co/{owner}/{repo}:{quant})")
