"""llama-server's routes: completion and infill, the tokenizer and the template, the server's properties and slots,
and its health probe."""

import os
from typing import Any, Optional, Union

from flask import jsonify, request

from .... import __version__
from ....engine.tokenizer import Tokenizer
from ....serving import offload
from ....serving.pool import LoadedModel
from ...body import parse_body
from ...errors import ApiError, invalid
from ...media import MEDIA_MARKER
from ...planning import Drafting, Ending, GenerationRequest, SlotChoice, known_ids, media_prompt, render_chat
from ...ranking import document_text, rank
from ...response import respond
from ...schemas import grammar_fields, template_tool, template_variables
from ...sessions import start_generation, use_model
from ...state import record, state
from ..service import readiness_status
from ..tokens import text_of
from .encoder import CompletionEncoder
from .protocol import bp
from .schemas import (
    SAMPLER_ORDER, ApplyTemplateBody, CompletionBody, DetokenizeBody, InfillBody, Mixed, RerankBody, TokenizeBody,
)

FIM_BATCH = 2048  # the batch llama-server fits an infill's prefix and suffix into (its default)
FIM_PROJECT = "myproject\n"
FIM_FILE = "filename\n"
SNIPPET = "\n\n--- snippet ---\n\n"  # what separates extra files for a model without a file separator token
DRAFT_PARAMS = ("speculative.n_max", "speculative.n_min", "speculative.p_min")  # the body's names for them


def _model(given: Optional[str]) -> str:
    return given if given is not None else state().settings.default_model


def mixed_tokens(tokenizer: Tokenizer, prompt: Mixed, param: str, add_special: bool,
                 parse_special: bool = True) -> list[int]:
    """A prompt's tokens: its texts tokenized each alone, its ids as they are (400 for one outside the vocabulary,
    naming its place in ``param``); BOS (and EOS) as the model asks, with ``add_special``, when it starts with a
    text."""
    parts = [prompt] if isinstance(prompt, str) else prompt
    known_ids(tokenizer.vocab_size, [part if isinstance(part, int) else 0 for part in parts], param)  # texts as 0
    tokens: list[int] = []
    for position, part in enumerate(parts):
        if isinstance(part, int):
            tokens.append(part)
        elif position == 0 and add_special:
            tokens.extend(tokenizer.prompt(part, parse_special))
        else:
            tokens.extend(tokenizer.encode(part, parse_special))
    return tokens


def _bias(tokenizer: Tokenizer, given: Any) -> tuple[tuple[int, float], ...]:
    """A logit bias as pairs of token id and bias: ids as they are, a text's every token; false bans the token."""
    pairs = given.items() if isinstance(given, dict) else (given or ())
    out = []
    for key, value in pairs:
        if isinstance(value, str) or value is True:
            raise invalid(f"logit_bias: the bias of {key!r} must be a number, or false", param="logit_bias")
        bias = float("-inf") if value is False else float(value)
        if isinstance(key, str) and key.isascii() and key.isdigit() and isinstance(given, dict):
            key = int(key)
        if isinstance(key, (bool, float)):
            raise invalid(f"logit_bias: {key!r} is neither a token id nor a text", param="logit_bias")
        ids = [key] if isinstance(key, int) else tokenizer.encode(key, False)
        out.extend((token, bias) for token in ids)
    return tuple(out)


def infill_tokens(tokenizer: Tokenizer, body: InfillBody, context: int) -> list[int]:
    """The infill prompt as llama-server lays it out: the extra files (repo-level, where the vocabulary has the
    tokens for it), then prefix, suffix and middle markers; the prefix and suffix cut to fit its batch (3:1).

    The extra files keep their last tokens that fit the context with room for the reply (``n_predict``, else a
    quarter of the context). llama-server leaves them the context less its batch and twice its own
    ``--n-predict``: with its defaults, 2 tokens.
    """
    fim = tokenizer.fim_ids
    if not {"pre", "suf", "mid"} <= fim.keys():
        raise invalid("this model has no fill-in-the-middle tokens: /infill needs a model trained for it")
    pre, suf, mid, rep, sep = fim["pre"], fim["suf"], fim["mid"], fim.get("rep"), fim.get("sep")

    def plain(text: str) -> list[int]:
        return tokenizer.encode(text, False)

    prefix = mixed_tokens(tokenizer, body.input_prefix, "input_prefix", False, False)
    suffix = mixed_tokens(tokenizer, body.input_suffix, "input_suffix", False, False)
    prompt = mixed_tokens(tokenizer, body.prompt, "prompt", False) if body.prompt else []
    extra = [rep, *plain(FIM_PROJECT)] if rep is not None else []
    for chunk in body.input_extra:
        extra += [sep, *plain(chunk.filename + "\n")] if sep is not None else plain(SNIPPET)
        extra += plain(chunk.text)
    if sep is not None:
        extra += [sep, *plain(FIM_FILE)]
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (FIM_BATCH // 4)):]
    suffix = suffix[:min(len(suffix), max(0, FIM_BATCH // 4 - (2 + len(prompt))))]
    head = [tokenizer.bos_id] if tokenizer.add_bos else []
    tokens = head + [pre, *prefix, *prompt, suf, *suffix, mid]
    reply = body.limit if body.limit is not None else context // 4
    extra_take = min(max(0, context - len(tokens) - reply), len(extra))
    return extra[len(extra) - extra_take:] + tokens


def generation_settings(body: CompletionBody, model_id: str, context: int,
                        bias: tuple[tuple[int, float], ...] = ()) -> dict:
    """The settings echoed back with an answer, under llama-server's names; ``bias`` as token ids, with the end
    tokens an ignore_eos bans (null: minus infinity, as llama-server writes it)."""
    fields = body.model_dump(exclude={"model", "prompt", "response_fields", "input_prefix", "input_suffix",
                                      "input_extra", "logit_bias", "samplers", "json_schema", "lora", "id_slot",
                                      "cache_prompt", "n_cmpl", "return_tokens", "return_progress", "n_cache_reuse",
                                      "sse_ping_interval", "speculative_n_max", "speculative_n_min",
                                      "speculative_p_min"})
    limit = body.limit if body.limit is not None else -1
    return {**fields, "n_ctx": context, "model": model_id, "n_predict": limit, "max_tokens": limit,
            "seed": body.seed if body.seed != -1 else 4294967295, "grammar": body.grammar or "",
            "samplers": list(body.sampler_chain()), "lora": [],
            "logit_bias": [{"bias": None if value == float("-inf") else value, "token": token} for token, value in bias]}


def _complete(body: CompletionBody, build) -> Any:
    """Generate for ``build(model)``'s prompts: streamed or whole, one object per prompt and completion. A
    multimodal prompt goes as its text, with its media."""
    model_id = _model(body.model)
    with use_model(model_id) as model:
        tokenizer, context = model.engine.tokenizer, model.engine.context_length
        body = body.with_model_defaults(model.sampling)
        media = body.media()

        def prepare() -> tuple[list[list[int]], tuple[tuple[int, float], ...], list[str]]:
            built = build(model, media)
            return built, _bias(tokenizer, body.logit_bias), [
                tokenizer.decode([t for t in p if t >= 0]).decode("utf-8", "replace") for p in built]

        prompts, bias, texts = offload.call(model.prep, prepare)
        window = context if body.repeat_last_n == -1 else body.repeat_last_n
        given = [text if isinstance(text, str) else tokens
                 for (_, text), tokens in zip(body.prompts(), prompts)] if media else prompts
        generation = GenerationRequest(
            model_id, prompt_param="prompt", prompts=given, media=media, n=body.n_cmpl,
            sampling=body.sampling(bias, window),
            stop=tuple(body.stop), max_tokens=body.limit, max_tokens_param="n_predict",
            top_logprobs=body.n_probs or None, token_ids=True, ending=Ending(ignore_eos=body.ignore_eos),
            reply_format=grammar_fields(body.grammar, body.json_schema),
            slot=None if body.id_slot == -1 else SlotChoice(body.id_slot, "id_slot"),
            drafting=Drafting(body.speculative_n_max, body.speculative_n_min, body.speculative_p_min, DRAFT_PARAMS),
        )
        session = start_generation(generation)
        banned = tuple((token, float("-inf")) for token in sorted(model.end_ids)) if body.ignore_eos else ()
    options = {"return_tokens": body.return_tokens, "n_probs": body.n_probs,
               "timings_per_token": body.timings_per_token, "return_progress": body.return_progress,
               "response_fields": body.response_fields}
    settings = generation_settings(body, model_id, context, bias + banned)
    encoder = CompletionEncoder(model_id, prompts, texts, body.n_cmpl, settings, options, session.stats,
                                record().started)
    return respond(session, encoder, body.stream)


@bp.post("/completion")
@bp.post("/completions")
def completion():
    """Continue each prompt (llama-server's native completion)."""
    body = parse_body(CompletionBody, json_type=False)
    return _complete(body, lambda model, media: [
        media_prompt(model, p, None, media)[0] if media and isinstance(p, str)
        else mixed_tokens(model.engine.tokenizer, p, where, True) for where, p in body.prompts()])


@bp.post("/infill")
def infill():
    """Code for the gap between ``input_prefix`` and ``input_suffix``, in the model's fill-in-the-middle tokens."""
    body = parse_body(InfillBody, json_type=False)
    return _complete(body, lambda model, media: [infill_tokens(model.engine.tokenizer, body,
                                                               model.engine.context_length)])


@bp.post("/tokenize")
def tokenize():
    """A text's tokens (with ``with_pieces``, each with its text, or its bytes where they are no whole text)."""
    body = parse_body(TokenizeBody, json_type=False)
    with use_model(_model(body.model)) as model:
        tokenizer = model.engine.tokenizer

        def run() -> list:
            tokens = mixed_tokens(tokenizer, body.content, "content", body.add_special, body.parse_special)
            return [{"id": t, "piece": _piece(tokenizer, t)} for t in tokens] if body.with_pieces else tokens

        return jsonify({"tokens": offload.call(model.prep, run)})


def _piece(tokenizer: Tokenizer, token: int) -> Union[str, list[int]]:
    piece = tokenizer.piece(token) or tokenizer.token_text(token).encode()
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


@bp.post("/detokenize")
def detokenize():
    """The text of some tokens."""
    body = parse_body(DetokenizeBody, json_type=False)
    with use_model(_model(body.model)) as model:
        return jsonify({"content": text_of(model, body.tokens)})


@bp.post("/apply-template")
def apply_template():
    """The prompt the model's chat template makes of the messages, without generating."""
    body = parse_body(ApplyTemplateBody, json_type=False)
    with use_model(_model(body.model)) as model:
        tools = [template_tool(t.function.name, t.function.description, t.function.parameters)
                 for t in body.tools or ()]
        prompt = render_chat(model, [m.for_template() for m in body.messages], tools,
                             variables=template_variables(None, body.chat_template_kwargs),
                             generation_prompt=body.add_generation_prompt)
        return jsonify({"prompt": prompt.text})


@bp.post("/rerank")
@bp.post("/reranking")
@bp.post("/v1/rerank")
@bp.post("/v1/reranking")
def rerank():
    """The documents scored against the query by a reranker model, best first: in Jina's shape, or in TEI's when the
    body gives ``texts``."""
    body = parse_body(RerankBody, json_type=False)
    tei = body.texts is not None
    texts = [document_text(d) for d in body.documents] if body.documents is not None else body.texts
    param = "documents" if body.documents is not None else "texts"
    model_id = _model(body.model)
    ranking = rank(model_id, body.query, texts, param, body.top_n)
    results = ranking.entries(texts, body.return_documents, "score" if tei else "relevance_score",
                              tei and body.return_text)
    if tei:
        return jsonify(results)
    usage = {"prompt_tokens": ranking.prompt_tokens, "total_tokens": ranking.prompt_tokens}
    return jsonify({"model": model_id, "object": "list", "usage": usage, "results": results})


def _slot_settings(model: LoadedModel) -> dict:
    defaults = CompletionBody(prompt="").with_model_defaults(model.sampling)
    return {"id": 0, "id_task": -1, "n_ctx": model.engine.context_length, "speculative": model.speculation is not None,
            "is_processing": False, "params": generation_settings(defaults, model.id, model.engine.context_length),
            "prompt": "", "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1,
                                         "n_decoded": 0, "stopping_word": ""}}


@bp.get("/props")
def props():
    """The server's properties, of the default model (or ``?model=``): its settings, slots, file and template."""
    kronk = state()
    model_id = _model(request.args.get("model"))
    with use_model(model_id) as model:
        return jsonify({
            "default_generation_settings": _slot_settings(model), "total_slots": kronk.settings.parallel,
            "model_alias": model_id, "model_path": os.path.basename(str(model.path)),
            "chat_template": model.template.source, "chat_template_caps": {},
            "modalities": {"vision": "image" in model.engine.modalities, "audio": "audio" in model.engine.modalities},
            "media_marker": MEDIA_MARKER, "build_info": f"kronk_wsgi {__version__}",
            "is_sleeping": False, "samplers": list(SAMPLER_ORDER),
        })


@bp.post("/props")
def set_props():
    """llama-server changes nothing here either unless started to; this server has no settings to change at run time."""
    raise ApiError(501, "this server's properties are set in its configuration, not at run time",
                   code="not_supported")


@bp.get("/slots")
def slots():
    """Each slot of the default model (or ``?model=``): its state and what it holds."""
    model_id = _model(request.args.get("model"))
    with use_model(model_id) as model:
        states = model.scheduler.states
        if request.args.get("fail_on_no_slot") and all(s != "idle" for s in states.values()):
            raise ApiError(503, "no slot available", code="no_slot_available")
        return jsonify([
            {"id": number, "id_task": -1, "n_ctx": model.engine.context_length,
             "speculative": model.speculation is not None,
             "is_processing": slot_state != "idle", "state": slot_state,
             "next_token": {"has_next_token": slot_state != "idle", "has_new_line": False, "n_remain": -1,
                            "n_decoded": 0, "stopping_word": ""}}
            for number, slot_state in enumerate(states[slot] for slot in model.scheduler.slots)
        ])


@bp.get("/health")
@bp.get("/v1/health")
def health():
    """200 ``{"status": "ok"}`` once the default model is loaded; 503 while it loads, after it failed to, and while
    the server drains (the SGLang gateway registers a worker by this probe too)."""
    status = readiness_status()
    if status == "ready":
        return jsonify({"status": "ok"})
    message = {"loading": "Loading model", "draining": "the server is shutting down"}.get(
        status, "the model failed to load")
    raise ApiError(503, message, code="unavailable")
