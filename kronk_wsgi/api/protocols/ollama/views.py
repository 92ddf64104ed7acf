"""Ollama's /api/chat, /api/generate, /api/embed and /api/embeddings."""

import re
import time
from typing import Any, Optional

from flask import Response, jsonify

from ....engine.chat_template import fill_in_middle
from ....engine.sampling import WHOLE_CONTEXT, SamplingParams
from ....serving.reasoning import reasons
from ...body import parse_body
from ...errors import ApiError, invalid
from ...media import MediaInput, inputs, joined
from ...planning import JSON_OBJECT, MODEL_SAMPLING, GenerationRequest, ReplyFormat, ToolUse, Window
from ...ranking import document_text, rank
from ...response import respond, run_to_end
from ...schemas import left_out, template_tool, template_variables
from ...sessions import start_embedding, start_generation, use_model
from ...state import record, state
from .encoder import OllamaEncoder
from .models import facts_of, model_id_of
from .protocol import bp, nanoseconds, timestamp
from .schemas import (
    DEFAULTS, ChatBody, Duration, EmbedBody, EmbeddingsBody, Format, GenerateBody, Generating, Options, RerankBody,
)

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
        seed=options.seed, repetition_window=64 if window is None else (WHOLE_CONTEXT if window == -1 else window),
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
        sampling_defaulted=left_out(options, MODEL_SAMPLING),  # a model's settings have Ollama's names
        stop=tuple(options.stop or ()), max_tokens=max_tokens, max_tokens_param="options.num_predict",
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        window=None if options.num_ctx is None else Window(options.num_ctx, "options.num_ctx"),
        template_vars=template_variables(body.think if isinstance(body.think, str) else None), **prompt,
    )


@bp.post("/api/chat")
def chat():
    """The next message of a conversation, streamed as NDJSON unless ``stream`` is false."""
    body = parse_body(ChatBody, json_type=False)
    media = inputs(MediaInput(data, f"messages[{index}].images[{place}]")
                   for index, message in enumerate(body.messages) for place, data in enumerate(message.image_data()))
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
        tools=tools, thinking=thinking(body, _template_of(model_id), body.model), media=media,
    )
    return _answer(request, body, keep_alive, chat=True)


@bp.post("/api/generate")
def generate():
    """A completion of ``prompt`` (in the chat template unless ``raw``; between it and ``suffix`` if given)."""
    body = parse_body(GenerateBody, json_type=False)
    media = inputs(MediaInput(data, f"images[{place}]") for place, data in enumerate(body.image_data()))
    if media and body.suffix is not None:
        raise invalid("images go with a prompt, not with suffix (fill-in-the-middle)", param="images")
    prompt = joined([*(given.data for given in media.values()), body.prompt])  # images before the text, as Ollama
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
        request = generation_request(body, model_id, prompt_param="prompt", prompts=[prompt], media=media)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": prompt}]
        request = generation_request(body, model_id, prompt_param="prompt", messages=messages,
                                     thinking=thinking(body, _template_of(model_id), body.model), media=media)
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
    line = {"model": name, "created_at": timestamp(), "done": True, "done_reason": reason}
    line.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return jsonify(line)


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
        "total_duration": nanoseconds(time.monotonic() - started), "load_duration": nanoseconds(record().load_seconds),
        "prompt_eval_count": finished.usage.prompt_tokens,
    })
    _set_keep_alive_after(response, model_id, keep_alive)
    return response


@bp.post("/api/rerank")
def rerank():
    """The documents scored against the query by a reranker model, best first."""
    body = parse_body(RerankBody, json_type=False)
    model_id = model_id_of(body.model)
    keep_alive = requested_keep_alive(body.keep_alive)
    texts = [document_text(d) for d in body.documents]
    started = time.monotonic()
    ranking = rank(model_id, body.query, texts, "documents", body.top_n)
    response = jsonify({
        "model": body.model, "results": ranking.entries(texts, body.return_documents), "total_duration": nanoseconds(time.monotonic() - started),
        "load_duration": nanoseconds(record().load_seconds), "prompt_eval_count": ranking.prompt_tokens,
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
