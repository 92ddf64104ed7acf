"""A generation request, as every protocol builds it from its body, and the plan that turns it into a job.

Each protocol's view reads its body into one ``GenerationRequest``;
``check`` refuses what is wrong whatever the model, before admission, and
``plan`` renders, tokenizes and constrains it for one loaded model. Both
raise ``ApiError``s that name the body's own fields.
"""

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jsonschema
import jsonschema.protocols

from ..config import ModelSampling
from ..engine.base import Media, MediaError, shared_prefix
from ..engine.chat_template import ChatTemplate, ChatTemplateError, RenderedPrompt
from ..engine.generate import DecodeOptions
from ..engine.grammar import (Grammar, GrammarError, bounded_integers, ebnf_grammar, json_schema_grammar, lark_after,
                              lark_json)
from ..engine.sampling import WHOLE_CONTEXT, SamplingParams, sampling_problem
from ..engine.speculation import Speculation
from ..serving import offload
from ..serving.formats import HERMES, CallFormat, ToolCallRules, format_of
from ..serving.jobs import EmbeddingJob, GenerationJob, RerankJob, ReplyReading
from ..serving.pool import LoadedModel
from ..serving.reasoning import opens_thinking, reasoning_of
from .errors import ApiError, PromptTooLong, invalid
from .media import MARKER, MediaInput, first_param

JSON_OBJECT = {"type": "object"}
MAX_CHOICES = 16  # choices (prompts times n) in one request
# What one schema may hold: checking and compiling grow with its size, and a regular expression's
# compilation can grow faster than its length.
MAX_SCHEMA_NODES = 10_000
MAX_SCHEMA_DEPTH = 64
MAX_PATTERN_LENGTH = 1_000
LARGEST_INTEGER = 2**63 - 1

Prompt = Union[str, list[int]]  # text, or token ids taken as they are


@dataclasses.dataclass(frozen=True)
class ReplyFormat:
    """What the reply must be: JSON valid against ``schema`` (with ``strict``, every keyword enforced), or text
    that a ``gbnf`` grammar (llama.cpp's grammar format) matches."""

    schema: Optional[dict]
    strict: bool
    param: str  # where the request gave it
    gbnf: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """The tools a request offers (as chat templates take them) and how the model may use them.

    ``choice`` "none" parses no calls; "required" (or a ``name``) starts the
    reply inside a call whose arguments are constrained to the tool's schema.
    With ``strict`` tools and "auto", a call the model opens is constrained the
    same way, and a call is taken only if its arguments validate. With
    ``max_calls`` a reply ends at that many calls.
    """

    tools: tuple[dict, ...]
    strict: frozenset[str] = frozenset()
    choice: str = "auto"  # "auto", "none" or "required"
    name: Optional[str] = None
    max_calls: Optional[int] = None
    # Tools whose input is text in a Lark grammar, by name: called in the raw form (see serving/tool_calls.py),
    # the input constrained to the grammar; each is strict.
    raw_inputs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The tools the model may call (OpenAI's allowed_tools), by name; None: all. The prompt shows them all,
    # so it stays the same from one request to the next.
    allowed: Optional[frozenset[str]] = None

    @property
    def forced(self) -> bool:
        return self.choice == "required" or self.name is not None

    def callable(self) -> list[dict]:
        """The tools the model may call."""
        return [t for t in self.tools if self.allowed is None or t["function"]["name"] in self.allowed]


@dataclasses.dataclass(frozen=True)
class Ending:
    """Where a reply may end besides its stop texts and its limit: at the model's end tokens (with ``ignore_eos``
    not: it goes on to its limit, as SGLang and vLLM have it), at ``stop_ids`` as at those, and at neither before
    ``min_tokens`` tokens."""

    ignore_eos: bool = False
    stop_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    stop_ids_param: str = "stop_token_ids"


@dataclasses.dataclass(frozen=True)
class Window:
    """A smaller context window than the model's, for prompt and reply (Ollama's num_ctx), and the body's name
    for it."""

    tokens: int
    param: str


@dataclasses.dataclass(frozen=True)
class SlotChoice:
    """The slot to run on, by number (llama-server's id_slot), and the body's name for it."""

    number: int
    param: str


@dataclasses.dataclass(frozen=True)
class Drafting:
    """Speculative decoding as a request sets it: the longest draft (0: none), the shortest draft checked, and a
    draft model's least probability of a drafted token, each None where the model's setting holds; ``params``
    names the three as the body does."""

    n_max: Optional[int] = None
    n_min: Optional[int] = None
    p_min: Optional[float] = None
    params: tuple[str, str, str] = ("n_max", "n_min", "p_min")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One request for generation, whatever protocol it came in.

    The prompt is chat ``messages`` rendered by the model's template, or else
    each of the raw ``prompts``; each gets ``n`` replies. ``thinking``
    switches a reasoning model's thinking on or off where its template can,
    and ``thinking_budget`` closes it after that many tokens. ``max_tokens``
    None means up to the context's end. ``prompt_param`` and
    ``max_tokens_param`` are the body's names for the prompt and the limit,
    named in errors.
    """

    model: str
    prompt_param: str
    messages: Optional[list[dict]] = None
    continue_final: bool = False  # the last message is the assistant's, and the reply continues it (a prefill)
    truncate: bool = False  # the oldest messages (after a leading system message) go until the prompt fits
    prompts: Sequence[Prompt] = ()
    n: int = 1
    tools: Optional[ToolUse] = None
    reply_format: Optional[ReplyFormat] = None
    thinking: Optional[bool] = None
    thinking_budget: Optional[int] = None
    reasoning_apart: bool = True  # the thinking is read apart from the answer; else it stays in its text
    # Variables the chat template reads (chat_template_kwargs, reasoning_effort), as the client named them.
    template_vars: Optional[Mapping[str, Any]] = None
    sampling: SamplingParams = SamplingParams()
    # The sampling fields the request left to its protocol's default: the model's own default takes their place
    sampling_defaulted: frozenset[str] = frozenset()
    stop: tuple[str, ...] = ()
    max_tokens: Optional[int] = None
    max_tokens_param: str = "max_tokens"
    top_logprobs: Optional[int] = None
    token_ids: bool = False  # each generated token's id is reported (TokenIds)
    not_offered: tuple[str, ...] = ()  # hosted tools the request named that this server cannot run (said, not hidden)
    ending: Ending = Ending()
    window: Optional[Window] = None
    # Hints of what the prompt cache should keep: the conversation's prefix through each of these many
    # ``messages`` (Anthropic's cache_control breakpoints), and the part a prompt shares with the last one
    # sent with the same key (OpenAI's prompt_cache_key).
    cache_breaks: tuple[int, ...] = ()
    cache_key: Optional[str] = None
    cache_scope: str = ""  # whose cached prefixes the prompt may reuse (Slot.enter); set by the server, not a client
    slot: Optional[SlotChoice] = None  # None: the best free one
    drafting: Drafting = Drafting()
    # The images and sounds the messages hold, by the key their markers carry (see api/media.py)
    media: Mapping[str, MediaInput] = dataclasses.field(default_factory=dict)

    @property
    def calls_tools(self) -> bool:
        """Whether tool calls are parsed out of the reply."""
        return bool(self.tools and self.tools.tools) and self.tools.choice != "none"


def check(request: GenerationRequest) -> None:
    """Refuse, before any model is involved, what no model could answer."""
    tools = request.tools
    names = {t["function"]["name"] for t in tools.tools} if tools is not None else set()
    if tools is not None and tools.name is not None and tools.name not in names:
        raise invalid(f"tool_choice names {tools.name!r}, which is not among the tools", param="tool_choice")
    if tools is not None and tools.allowed is not None and not tools.allowed:
        raise invalid("tool_choice allows no tool: name at least one, or send tool_choice none", param="tool_choice")
    if tools is not None and tools.allowed is not None and not tools.allowed <= names:
        unknown = ", ".join(sorted(tools.allowed - names))
        raise invalid(f"tool_choice allows {unknown}, which is not among the tools", param="tool_choice")
    if request.reply_format is not None and request.calls_tools:
        raise invalid("a JSON response format together with tools is not supported yet: "
                      "send tool_choice none, or no response format", param=request.reply_format.param)
    if len(request.prompts or [None]) * request.n > MAX_CHOICES:
        raise invalid(f"at most {MAX_CHOICES} choices (prompts times n) per request", param="n")
    for tool in tools.tools if tools else ():
        if tool["function"]["name"] in tools.strict:
            _check_schema(tool["function"]["parameters"], "tools",
                          f"the parameters of tool {tool['function']['name']!r}")
    if request.reply_format is not None and request.reply_format.schema is not None:
        _check_schema(request.reply_format.schema, request.reply_format.param, "the response format's schema")


def plan(model: LoadedModel, request: GenerationRequest) -> GenerationJob:
    """The job that answers a checked ``request`` on ``model``: its prompts' tokens, how replies are decoded and read.

    400 if the template cannot take the messages or tools, if a prompt does
    not fit the context (with ``truncate``, once the oldest messages are gone
    and it still does not), or if a schema cannot be enforced.
    """
    while True:
        try:
            return _plan(model, request)
        except ApiError as exc:
            shorter = _without_oldest(request.messages) if request.truncate else None
            if exc.code != "context_length_exceeded" or shorter is None:
                raise
            request = dataclasses.replace(request, messages=shorter)


def _without_oldest(messages: Optional[list[dict]]) -> Optional[list[dict]]:
    """The conversation without its oldest turn (a leading system message stays, and the tool results that
    answered the turn go with it); None if only one turn is left."""
    if not messages:
        return None
    head = 1 if messages[0]["role"] == "system" else 0
    rest = messages[head + 1:]
    while rest and rest[0]["role"] == "tool":
        rest = rest[1:]
    return messages[:head] + rest if rest else None


def _plan(model: LoadedModel, request: GenerationRequest) -> GenerationJob:
    tokenizer = model.engine.tokenizer
    reading, grammar_text, grammar_after = ReplyReading(), None, ""
    texts: Sequence[Union[Prompt, RenderedPrompt]] = request.prompts
    if request.messages is not None:
        rendered = render_chat(model, request.messages, request.tools.tools if request.tools else None,
                               request.thinking, request.continue_final, request.template_vars)
        texts = [rendered]
        reading = reply_reading(model.template, rendered.text, request.reasoning_apart)
        if request.calls_tools:
            reading, grammar_text, grammar_after = _tool_reading(model, request.tools, reading)
    if request.reply_format is not None:
        grammar_text = offload.call(model.prep, _format_grammar, request.reply_format)  # may take a second
        grammar_after = reading.reasoning.close if reading.inside_thinking else ""  # the answer follows the thinking
    after_prompt = reading.reply_start
    if reading.inside_thinking and reading.reply_start:  # a forced call comes after the thinking: left empty
        after_prompt = reading.reasoning.close + "\n\n" + reading.reply_start
        reading = dataclasses.replace(reading, inside_thinking=False)
    context = _context(model, request)
    _check_media(model, request.media)
    held: list[Media] = []
    token_lists = [_prompt_tokens(model, context, text, after_prompt, request, held) for text in texts]
    room = context - max(map(len, token_lists))
    asked = request.max_tokens if request.max_tokens is not None else model.max_tokens
    limit = room if asked is None else min(asked, room)  # clamped, as llama-server does
    ending = request.ending
    stop_ids = frozenset(known_ids(tokenizer.vocab_size, ending.stop_ids, ending.stop_ids_param, indexed=False))
    decode = DecodeOptions(
        end_ids=stop_ids | (frozenset() if ending.ignore_eos else model.end_ids), min_tokens=ending.min_tokens,
        end_texts=() if ending.ignore_eos else model.end_texts,
        max_tokens=limit,
        sampling=_sampling(model, request), stop=request.stop, shown=reading.shown(tokenizer),
        grammar=_grammar(model, grammar_text, grammar_after, request), constrain_after=grammar_after,
        thinking_close=reading.reasoning.close if reading.inside_thinking else "",
        thinking_budget=request.thinking_budget, top_logprobs=request.top_logprobs, token_ids=request.token_ids,
        speculation=_speculation(model, request),
    )
    refused = model.engine.refusal(decode)
    if refused is not None:
        what, why = refused
        param = {"grammar": request.reply_format.param if request.reply_format is not None else "tools",
                 "repetition_window": "repeat_last_n"}.get(what, what)
        raise invalid(f"{param}: {why}", param=param)
    save_at = _save_points(model, request, texts[0], token_lists[0]) if model.prompt_cache is not None else ()
    return GenerationJob(token_lists, request.n, tokenizer, decode, reading, save_at, request.cache_scope,
                         _slot(model, request.slot), tuple(held))


def _slot(model: LoadedModel, choice: Optional[SlotChoice]) -> Optional[int]:
    """The slot the request runs on, if it names one; 400 if the model has no such slot."""
    scheduler = model.scheduler
    slots = len(scheduler.slots)
    if choice is not None and not 0 <= choice.number < slots:
        raise invalid(f"{choice.param} {choice.number} is not a slot of this model (it has {slots})",
                      param=choice.param)
    if choice is not None and scheduler.states.get(scheduler.slots[choice.number]) == "retired":
        raise invalid(f"{choice.param} {choice.number} was a slot of a gRPC worker that was removed",
                      param=choice.param)
    return None if choice is None else choice.number


def _speculation(model: LoadedModel, request: GenerationRequest) -> Optional[Speculation]:
    """How the replies are drafted: as the model's setting says, unless the request sets a draft length (0: off) or
    a draft model's least probability."""
    asked = request.drafting
    if asked.n_max == 0:
        return None
    n_max, n_min, p_min = asked.params
    given = {n_max: asked.n_max, n_min: asked.n_min, p_min: asked.p_min}
    if all(value is None for value in given.values()):
        return model.speculation
    if not model.engine.speculates:
        raise invalid(f"speculative decoding: the {model.engine.kind.name} engine cannot check drafts",
                      param=next(name for name, value in given.items() if value is not None))
    default = model.speculation or Speculation()
    longest = asked.n_max or default.n_max
    if asked.n_min is not None and asked.n_min > longest:
        raise invalid(f"{n_min} {asked.n_min} is more than the longest draft, {longest} ({n_max})", param=n_min)
    return Speculation(longest, min(longest, default.n_min if asked.n_min is None else asked.n_min),
                       default.p_min if asked.p_min is None else asked.p_min)


def _save_points(model: LoadedModel, request: GenerationRequest, prompt: Union[Prompt, RenderedPrompt],
                 tokens: list[int]) -> tuple[int, ...]:
    """The prompt lengths at which the request's hints say its prefix is worth saving (``cache_breaks``,
    ``cache_key``). A break whose messages the template cannot render alone is no hint."""
    cache = model.prompt_cache
    # In the model's preparation thread: it hashes the prompt, under the cache's lock.
    points = ([offload.call(model.prep, cache.key_branch, request.cache_key, tokens, request.cache_scope)]
              if request.cache_key is not None else [])
    if not request.cache_breaks or not isinstance(prompt, RenderedPrompt):
        return tuple(points)
    tools = list(request.tools.tools) if request.tools else None
    for count in sorted(set(request.cache_breaks)):
        if count >= len(request.messages):
            points.append(len(tokens))  # the whole prompt: saved with its answer
            continue
        # In the model's preparation thread: a render, a tokenize and a comparison of tens of thousands of tokens.
        point = offload.call(model.prep, _break_point, model, request.messages[:count], tools, request,
                             prompt, tokens)
        if point is not None:
            points.append(point)
    return tuple(points)


def _break_point(model: LoadedModel, head: list[dict], tools: Optional[list[dict]], request: GenerationRequest,
                 prompt: RenderedPrompt, tokens: list[int]) -> Optional[int]:
    """How many of the prompt's ``tokens`` the conversation's first messages, ``head``, run through; None if the
    template cannot render them alone."""
    try:
        rendered = model.template.render(head, tools, request.thinking, tool_text=tool_text(model.template, tools),
                                         variables=request.template_vars)
    except ChatTemplateError:
        return None
    text = os.path.commonprefix([rendered.text, prompt.text])
    return shared_prefix(media_prompt(model, text, prompt.inert, request.media)[0], tokens)


def _check_budget(tokens: int, budget: int, param: str, floor: bool = False) -> None:
    """400 if a request's inputs come to more than ``budget`` tokens in all (``floor``: at least ``tokens``)."""
    if tokens > budget:
        count = f"at least {tokens}" if floor else str(tokens)
        raise invalid(f"the inputs come to {count} tokens; one request may give this server {budget} "
                      "(max_request_tokens)", param=param, code="request_too_large")


def _check_embeds(model: LoadedModel) -> None:
    """400 for a model whose engine only generates (gRPC workers, a runner): it gives no embeddings or scores."""
    if not model.engine.embeds:
        raise invalid(f"model {model.id!r} is served by the {model.engine.kind.name} engine, which only generates: "
                      "it gives no embeddings or rerank scores", param="model")


def plan_embedding(model: LoadedModel, inputs: Sequence[Prompt], param: str, budget: int, truncate: bool = False,
                   scope: str = "") -> EmbeddingJob:
    """The job that embeds each input on ``model``; 400 if one does not fit its context, unless ``truncate``
    keeps the tokens that fit, or if they come to more than ``budget`` tokens."""
    if model.engine.reranker:
        raise invalid(f"model {model.id!r} is a reranker: it scores documents against a query (POST /v1/rerank) and "
                      "gives no embeddings", param="model")
    _check_embeds(model)
    context, tokenizer = model.engine.context_length, model.engine.tokenizer
    fewest = [tokenizer.fewest_tokens(given) if isinstance(given, str) else len(given) for given in inputs]
    for index, (given, floor) in enumerate(zip(inputs, fewest)):
        if isinstance(given, str) and not truncate and floor > context:
            raise invalid(f"input {index} cannot fit this model's context of {context} tokens",
                          param=param, code="context_length_exceeded")
    # Before seconds of tokenizing: a truncated input gives at most the context.
    _check_budget(sum(min(floor, context) if truncate else floor for floor in fewest), budget, param, floor=True)
    token_lists = []
    for index, given in enumerate(inputs):
        tokens = (model.tokenize(given) if isinstance(given, str)
                  else known_ids(tokenizer.vocab_size, given, param, indexed=False))
        if truncate:
            tokens = tokens[:context]
        if len(tokens) > context:
            raise invalid(f"input {index} has {len(tokens)} tokens; this model's context is {context}",
                          param=param, code="context_length_exceeded")
        token_lists.append(tokens)
    _check_budget(sum(map(len, token_lists)), budget, param)
    return EmbeddingJob(token_lists, scope)


def plan_rerank(model: LoadedModel, query: str, documents: Sequence[str], param: str, budget: int,
                max_document_tokens: Optional[int] = None) -> RerankJob:
    """The job that scores each of ``documents`` against ``query`` on a reranker, each pair in the file's rerank
    prompt, else in its tokenizer's pair layout; with ``max_document_tokens``, a longer document is cut to that
    many tokens first. 400 if the model is no reranker, a pair is empty or does not fit its context, or the pairs
    come to more than ``budget`` tokens."""
    engine = model.engine
    _check_embeds(model)
    if not engine.reranker:
        raise invalid(f"model {model.id!r} is not a reranker: its file does not score by rank", param="model")
    context, tokenizer, template = engine.context_length, engine.tokenizer, engine.rerank_template

    def pair(document: str) -> list[int]:
        if max_document_tokens is not None:
            tokens = tokenizer.encode(document, specials=False)
            if len(tokens) > max_document_tokens:
                document = tokenizer.decode(tokens[:max_document_tokens]).decode("utf-8", "ignore")
        if template is not None:
            return tokenizer.encode(template.replace("{query}", query).replace("{document}", document))
        return tokenizer.pair(query, document)

    fewest = 0
    for index, document in enumerate(documents):
        pair_fewest = tokenizer.fewest_tokens(query + document)
        if max_document_tokens is None and pair_fewest > context:
            raise invalid(f"document {index} with the query cannot fit this model's context of {context} tokens",
                          param=param, code="context_length_exceeded")
        fewest += pair_fewest if max_document_tokens is None else min(pair_fewest, max_document_tokens)
    _check_budget(fewest, budget, param, floor=True)  # before seconds of tokenizing
    token_lists = offload.call(model.prep, lambda: [pair(document) for document in documents])
    _check_budget(sum(map(len, token_lists)), budget, param)
    for index, tokens in enumerate(token_lists):
        if not tokens:
            raise invalid(f"document {index} with the query makes no tokens", param=param)
        if len(tokens) > context:
            raise invalid(f"document {index} with the query makes {len(tokens)} tokens; this model's context is "
                          f"{context}", param=param, code="context_length_exceeded")
    return RerankJob(token_lists)


def render_chat(
    model: LoadedModel, messages: list[dict], tools: Optional[Sequence[dict]], thinking: Optional[bool] = None,
    continue_final: bool = False, variables: Optional[Mapping[str, Any]] = None, generation_prompt: bool = True,
) -> RenderedPrompt:
    """The prompt from the model's chat template (tools written into the messages where it renders none, the
    request's ``variables`` given to it); 400 if the template cannot take these messages."""
    try:
        # In the model's preparation thread: a long conversation or template loop must not stall the event loop.
        tools = list(tools) if tools else None
        messages = [{k: v for k, v in m.items() if k != "media"} if "media" in m else m for m in messages]
        return offload.call(model.prep, model.template.render, messages, tools, thinking, continue_final,
                            tool_text(model.template, tools), variables, generation_prompt)
    except ChatTemplateError as exc:
        raise invalid(str(exc), param="chat_template_kwargs" if exc.variables else "messages") from None


def reply_reading(template: ChatTemplate, prompt: str, reasoning_apart: bool = True) -> ReplyReading:
    """How a reply to the rendered ``prompt`` is read before tools count: its thinking told apart from its answer
    (unless not ``reasoning_apart``: thinking tags stay in the text, the one the prompt opened too, as llama-server
    writes it, but for a reply of sections, Kimi K3's), and the markers its format puts around answers left out (by
    the format's reader, which no call gets past without tools)."""
    form = call_format(template)
    reads = form.reader.reads_reasoning or form.reader.frames_replies or form.drops
    rules = ToolCallRules(form, lambda name, arguments: False) if reads else None
    syntax = None if form.reader.reads_reasoning else reasoning_of(template.source)
    opened = syntax is not None and opens_thinking(prompt, syntax)
    if not reasoning_apart:
        tail = prompt[prompt.rstrip().rfind(syntax.open.rstrip()):] if opened and not syntax.answers else ""
        return ReplyReading(tool_rules=rules, prompt_tail=tail)
    return ReplyReading(tool_rules=rules, reasoning=syntax, inside_thinking=opened)


def call_format(template: ChatTemplate) -> CallFormat:
    """How a template's model writes tool calls: as the template teaches, else as the built-in Hermes text does."""
    return format_of(template.source)


def tool_text(template: ChatTemplate, tools: Optional[list[dict]]) -> Optional[str]:
    """How tools are taught to a model whose template writes calls in a format of its own but renders no
    definitions (DeepSeek's, firefunction's); None where the template renders them, or the Hermes text does."""
    form = call_format(template)
    if not tools or template.renders_tools or form is HERMES:
        return None
    return form.teaching(tools)


def _tool_reading(model: LoadedModel, tools: ToolUse, reading: ReplyReading) -> tuple[ReplyReading, Optional[str], str]:
    """How a reply with tools is read, and the grammar of its calls (with where it starts), if they are constrained."""
    form = call_format(model.template)
    if tools.raw_inputs and not form.raw_inputs:
        raise invalid(f"tools: {', '.join(tools.raw_inputs)} take input in a Lark grammar, which this model's "
                      f"tool-call format ({form.name}) cannot delimit; use a regex or text format", param="tools")
    control = model.engine.tokenizer.control
    raw = dict(tools.raw_inputs)
    callable_ = tools.callable()
    rules = ToolCallRules(form, _accept_calls(tools), {t["function"]["name"]: t["function"]["parameters"]
                                                        for t in callable_}, frozenset(raw), tools.max_calls)
    if tools.forced:
        # A required call with one tool on offer is a call of that tool: its name is written, not sampled.
        name = tools.name or (callable_[0]["function"]["name"] if len(callable_) == 1 else None)
        opening = form.opening(name, raw_input=name in raw)
        grammar = form.grammar(callable_, tools.strict, control, name, raw_inputs=raw)
        return dataclasses.replace(reading, tool_rules=rules, reply_start=opening), grammar, ""
    reading = dataclasses.replace(reading, tool_rules=rules)
    if tools.strict or tools.allowed is not None:  # the model may answer or call: a call it opens is held to them
        grammar = form.grammar(callable_, tools.strict, control, forced=False, raw_inputs=raw)
        return reading, grammar, form.opens[0]
    return reading, None, ""


def _format_grammar(reply_format: ReplyFormat) -> str:
    """The grammar of a reply format; 400 if its GBNF does not convert."""
    if reply_format.gbnf is None:
        return json_schema_grammar(reply_format.schema, lenient=not reply_format.strict)
    try:
        return ebnf_grammar(reply_format.gbnf)
    except GrammarError as exc:
        raise invalid(f"the grammar cannot be used: {exc}", param=reply_format.param) from None


def _origin(model: LoadedModel, request: GenerationRequest, text: str, after: str) -> Optional[tuple[str, str]]:
    """The reply's constraint as an engine elsewhere takes it (``Grammar.origin``): a JSON Schema (integers
    bounded as here) or GBNF as given, or the Lark grammar made here, wrapped to hold from ``after`` on if given;
    None for a GBNF grammar held after a thinking, or tools taking raw input (several grammars)."""
    reply_format = request.reply_format
    if reply_format is None:
        if request.tools.raw_inputs:
            return None
        lark = text  # the calls' grammar
    elif reply_format.gbnf is not None:
        return None if after else ("ebnf_grammar", reply_format.gbnf)
    elif not after:
        return "json_schema", json.dumps(bounded_integers(reply_format.schema), ensure_ascii=False)
    else:
        lark = "start: " + lark_json(reply_format.schema, lenient=not reply_format.strict)
    return "lark", lark_after(after, lark, model.engine.tokenizer.control) if after else lark


def _grammar(model: LoadedModel, text: Optional[str], after: str, request: GenerationRequest) -> Optional[Grammar]:
    """The grammar built for the model's vocabulary (in its preparation thread); 400 if it cannot be."""
    if text is None:
        return None
    try:
        return offload.call(model.prep, Grammar, model.engine.tokenizer, model.end_ids, text,
                            _origin(model, request, text, after))
    except GrammarError as exc:
        param = request.reply_format.param if request.reply_format is not None else "tools"
        raise invalid(f"the schema cannot be enforced: {exc}", param=param) from None


# A model's sampling settings (ModelSampling; Ollama's and llama-server's names) by the sampling parameter each sets
MODEL_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "repeat_penalty": "repetition_penalty", "repeat_last_n": "repetition_window",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed"}


def model_defaults(sampling: ModelSampling) -> dict[str, Any]:
    """A model's sampling settings as the sampling parameters they set."""
    found = {MODEL_SAMPLING[name]: value for name, value in sampling.model_dump(exclude_none=True).items()}
    if found.get("repetition_window") == -1:
        found["repetition_window"] = WHOLE_CONTEXT
    return found


def _sampling(model: LoadedModel, request: GenerationRequest) -> SamplingParams:
    """The sampling parameters, the model's defaults where the request is silent; 400 for a value the sampler
    cannot take, or a logit bias naming a token outside the model's vocabulary."""
    defaults = {name: value for name, value in model_defaults(model.sampling).items()
                if name in request.sampling_defaulted}
    sampling = dataclasses.replace(request.sampling, **defaults)
    problem = sampling_problem(sampling)
    if problem is not None:
        name, why = problem
        raise invalid(f"{name} {why}", param=name)
    known_ids(model.engine.tokenizer.vocab_size, [token for token, _ in sampling.logit_bias], "logit_bias",
              indexed=False)
    return sampling


def _context(model: LoadedModel, request: GenerationRequest) -> int:
    """The context window the request is served in: the model's, or the smaller one it asked for; 400 if larger."""
    loaded, window = model.engine.context_length, request.window
    if window is None:
        return loaded
    if window.tokens > loaded:
        raise invalid(f"{window.param} {window.tokens} is larger than this model's loaded context of {loaded} "
                      "tokens; raise its context_length in the configuration", param=window.param)
    return window.tokens


def media_prompt(model: LoadedModel, text: str, inert: Optional[str],
                 media: Mapping[str, MediaInput]) -> tuple[list[int], list[Media]]:
    """A whole prompt's tokens (as ``Tokenizer.prompt`` makes them) with each medium's tokens where its marker
    stands, and the media held; runs in the model's preparation thread. An image decodes here."""
    tokenizer = model.engine.tokenizer
    pieces = MARKER.split(text) if media else [text]
    tokens, held = [], []
    for index, piece in enumerate(pieces):
        if index % 2 == 0:
            tokens += tokenizer.encode(piece, True, inert) if piece else []
            continue
        given = media.get(piece)
        if given is None:  # a marker of no image of this request: text
            tokens += tokenizer.encode(f"<__media_{piece}__>", True, inert)
            continue
        try:
            found = model.engine.media(given.data)
        except MediaError as exc:
            raise invalid(f"{given.param}: {exc}", param=given.param) from None
        held.append(found)
        tokens += found.tokens
    if tokenizer.add_bos and tokens[:1] != [tokenizer.bos_id]:
        tokens.insert(0, tokenizer.bos_id)
    if tokenizer.add_eos and tokens[-1:] != [tokenizer.eos_id]:
        tokens.append(tokenizer.eos_id)
    return tokens, held


def _check_media(model: LoadedModel, media: Mapping[str, MediaInput]) -> None:
    """400 for media given to a model that reads text only."""
    if media and not model.engine.modalities:
        raise invalid(f"model {model.id!r} reads text only: it has no multimodal projector (mmproj)",
                      param=first_param(media))


def tokenize_prompt(model: LoadedModel, prompt: RenderedPrompt, media: Mapping[str, MediaInput]) -> list[int]:
    """A rendered prompt's tokens, its media's in their places (400 for one the model does not take)."""
    _check_media(model, media)
    return offload.call(model.prep, media_prompt, model, prompt.text, prompt.inert, media)[0]


def _prompt_tokens(model: LoadedModel, context: int, prompt: Union[Prompt, RenderedPrompt], after_prompt: str,
                   request: GenerationRequest, held: list[Media]) -> list[int]:
    """One prompt's tokens, ``after_prompt`` text included (its media's added to ``held``); 400 if it leaves no
    room for a token of the reply."""
    param = request.prompt_param
    if isinstance(prompt, list):
        tokens = known_ids(model.engine.tokenizer.vocab_size, prompt, param, indexed=False)
    else:
        rendered = prompt if isinstance(prompt, RenderedPrompt) else RenderedPrompt(prompt)
        full = rendered.text + after_prompt
        fewest = model.engine.tokenizer.fewest_tokens(full.replace(rendered.inert, "") if rendered.inert else full)
        if fewest > context:  # too long to fit, whatever its tokens: not worth seconds of tokenizing
            raise PromptTooLong(fewest, context - 1, f"the context is {context} tokens; the prompt has at least "
                                f"{fewest} tokens", param)
        if request.media:
            tokens, found = offload.call(model.prep, media_prompt, model, full, rendered.inert, request.media)
            held.extend(found)
        else:
            tokens = model.tokenize(full, inert=rendered.inert)
    if len(tokens) >= context:
        raise PromptTooLong(len(tokens), context - 1, f"the context is {context} tokens; the prompt has "
                            f"{len(tokens)} tokens", param)
    return tokens


def _check_schema(schema: dict, param: str, what: str = "the schema") -> None:
    """400 unless ``schema`` is a JSON Schema within this server's limits, with no $ref that only leads to itself."""
    _check_bounds(schema, param, what)
    _check_ref_cycles(schema, param, what)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise invalid(f"{what} is not a valid JSON Schema: {exc.message}", param=param) from None


def _check_bounds(schema: dict, param: str, what: str) -> None:
    """400 if the schema is too large or too deep, has a long pattern, or an integer no grammar can hold."""
    pending, nodes = [(schema, 1)], 0
    while pending:
        value, depth = pending.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES or depth > MAX_SCHEMA_DEPTH:
            limit = f"{MAX_SCHEMA_NODES} values" if nodes > MAX_SCHEMA_NODES else f"{MAX_SCHEMA_DEPTH} levels"
            raise invalid(f"{what} is larger than this server takes ({limit})", param=param)
        if isinstance(value, dict):
            pattern = value.get("pattern")
            if isinstance(pattern, str) and len(pattern) > MAX_PATTERN_LENGTH:
                raise invalid(f"{what} has a pattern longer than {MAX_PATTERN_LENGTH} characters", param=param)
            pending.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            pending.extend((v, depth + 1) for v in value)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST_INTEGER:
            raise invalid(f"{what} has an integer beyond 2^63, which no grammar here can hold", param=param)


def _check_ref_cycles(schema: dict, param: str, what: str) -> None:
    """400 if a local $ref leads, through $refs alone, back to itself: no value could ever match it."""

    def target(pointer: str) -> object:
        node: object = schema
        for part in filter(None, pointer[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    pending: list[object] = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            seen, ref = set(), node.get("$ref")
            while isinstance(ref, str) and ref.startswith("#"):
                if ref in seen:
                    raise invalid(f"{what} has a $ref cycle through {ref!r}: no value could match it", param=param)
                seen.add(ref)
                following = target(ref)
                ref = following.get("$ref") if isinstance(following, dict) else None
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)


def known_ids(vocab_size: int, ids: Sequence[int], param: str, indexed: bool = True) -> list[int]:
    """Token ids given by the client, taken as they are; 400 naming the first that is not in a vocabulary of
    ``vocab_size``: by its index in ``param`` if ``indexed`` (``ids`` is that field's value), else by ``param``
    alone (one of the field's prompts). Every protocol's ids pass here before anything reads them."""
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            place = f"{param}[{index}]" if indexed else param
            raise invalid(f"{place}: {token} is not a token id of this model (its vocabulary has {vocab_size})",
                          param=place)
    return list(ids)


def _accept_calls(tools: ToolUse) -> Callable[[str, dict], bool]:
    """Which calls the tools take: a known name, and for a strict tool, arguments its schema validates."""
    checks: dict[str, Optional[jsonschema.protocols.Validator]] = {}  # None: any arguments
    for tool in tools.callable():
        name, schema = tool["function"]["name"], tool["function"]["parameters"]
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        checks[name] = validator(schema) if name in tools.strict else None

    def accept(name: str, arguments: dict) -> bool:
        return name in checks and (checks[name] is None or checks[name].is_valid(arguments))

    return accept
