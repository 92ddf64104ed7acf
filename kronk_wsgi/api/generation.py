"""Everything before the commit that every generating endpoint shares.

Model lookup and load, admission, prompt preparation and the context check
all happen here, so their failures are real HTTP errors.
"""

import contextlib
import dataclasses
import select
import socket
import time
from typing import Callable, Iterator, Optional, Sequence, Union

import jsonschema
import jsonschema.protocols
from flask import request

from ..engine.chat_template import ChatTemplateError, RenderedPrompt
from ..engine.grammar import Grammar, GrammarError, json_schema_grammar
from ..engine.sampling import SamplingParams
from ..serving.drain import ShuttingDown
from ..serving.jobs import EmbeddingJob, GenerationJob, Job
from ..serving.pool import ClientGone, LoadedModel, ModelUnavailable, NeverFits, NoRoom, Overloaded
from ..serving.reasoning import opens_thinking, reasoning_of
from ..serving.session import Session
from ..serving.tool_calls import ToolCallRules, call_grammar, forced_opening, syntax_of
from .errors import ApiError, invalid, model_not_found
from .state import record, state


def client_watch(environ: dict) -> Callable[[], bool]:
    """A check that the client closed its connection, where the server exposes the socket.

    gunicorn puts the socket in the environ; a readable socket whose peek
    returns no bytes has been closed by the peer.
    """
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return lambda: False

    def gone() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    return gone


@contextlib.contextmanager
def use_model(model_id: str) -> Iterator[LoadedModel]:
    """The loaded model, kept loaded until the block ends.

    404 if it is not configured; 503 if it cannot load, or cannot be loaded
    now because the models that would make room for it are in use (with
    Retry-After); 400 if it is larger than the memory budget. Only a configured
    id is recorded: logs and metric labels never carry what a client made up.
    """
    if model_id not in state().settings.models:
        raise model_not_found(model_id)
    record().model = model_id
    try:
        model = state().pool.get(model_id)
    except ModelUnavailable as exc:
        raise ApiError(503, str(exc), code="model_unavailable") from None
    except NoRoom as exc:
        raise ApiError(503, str(exc), code="model_busy", headers={"Retry-After": str(exc.retry_after)}) from None
    except NeverFits as exc:
        raise invalid(str(exc), param="model", code="model_too_large") from None
    try:
        yield model
    finally:
        model.unclaim()


def render_chat(
    model: LoadedModel, messages: list[dict], tools: Optional[list[dict]], thinking: Optional[bool] = None,
) -> RenderedPrompt:
    """The prompt from the model's chat template; 400 if the template cannot take these messages or tools."""
    if tools and not model.template.supports_tools:
        raise invalid(f"the chat template of model {model.id!r} does not support tools", param="tools")
    try:
        # In the model's tokenizer thread: a long conversation or template loop must not stall the event loop.
        return model.tokenizer.apply(model.template.render, (messages, tools or None, thinking))
    except ChatTemplateError as exc:
        raise invalid(str(exc), param="messages") from None


@dataclasses.dataclass(frozen=True)
class ReplyFormat:
    """JSON that the reply must be: valid against ``schema``; with ``strict``, every keyword enforced."""

    schema: dict
    strict: bool
    param: str  # where the request gave it


JSON_OBJECT = {"type": "object"}
MAX_CHOICES = 16  # choices (prompts times n) in one request


def start_generation(
    model_id: str,
    *,
    messages: Optional[list[dict]] = None,
    prompts: Sequence[Union[str, list[int]]] = (),
    thinking: Optional[bool] = None,
    thinking_budget: Optional[int] = None,
    prompt_param: str,
    n: int = 1,
    tools: Optional[list[dict]] = None,
    strict_tools: frozenset[str] = frozenset(),
    tool_choice: str = "auto",
    tool_name: Optional[str] = None,
    one_tool_call: bool = False,
    reply_format: Optional[ReplyFormat] = None,
    top_logprobs: Optional[int] = None,
    max_tokens: Optional[int],
    max_tokens_param: str,
    sampling: Callable[[LoadedModel], SamplingParams],
    stop: tuple[str, ...],
) -> Session:
    """Admit and prepare one generation; return its not yet started session.

    The prompt is chat ``messages`` rendered by the model's template, or else
    each of the raw ``prompts`` (text, or token ids taken as they are); each
    gets ``n`` replies. ``thinking`` switches a reasoning model's thinking on
    or off where its template can; its thinking is told apart from its answer,
    and closed after ``thinking_budget`` tokens where the template opens it.
    With ``tools``, tool calls are parsed out of the reply unless
    ``tool_choice`` is "none"; "required" (or a ``tool_name``) starts the
    reply inside a tool call whose arguments are constrained to the tool's
    schema, and ``one_tool_call`` ends it after the first. With strict tools
    and "auto", a call the model opens is constrained the same way. A call is
    taken only if it names one of the tools and, for the ``strict_tools``, its
    arguments validate against the tool's schema. A ``reply_format`` constrains
    the reply to JSON; ``top_logprobs`` reports log probabilities.
    """
    if tool_name is not None and tool_name not in {t["function"]["name"] for t in tools or ()}:
        raise invalid(f"tool_choice names {tool_name!r}, which is not among the tools", param="tool_choice")
    if reply_format is not None and tools and tool_choice != "none":
        raise invalid("a JSON response format together with tools is not supported yet: "
                      "send tool_choice none, or no response format", param=reply_format.param)
    if len(prompts or [None]) * n > MAX_CHOICES:
        raise invalid(f"at most {MAX_CHOICES} choices (prompts times n) per request", param="n")
    accept = _accept_calls(tools or [], strict_tools)
    if reply_format is not None:
        _check_schema(reply_format.schema, reply_format.param, "the response format's schema")

    def job(model: LoadedModel) -> GenerationJob:
        params = sampling(model)
        tokenizer = model.engine.tokenizer
        rules, reply_start, grammar_text, grammar_after, reasoning, inside_thinking = None, "", None, "", None, False
        if messages is not None:
            rendered = render_chat(model, messages, tools, thinking)
            reasoning = reasoning_of(model.template.source)
            inside_thinking = reasoning is not None and opens_thinking(rendered.text, reasoning)
            if tools and tool_choice != "none":
                syntax = syntax_of(model.template.source)
                rules = ToolCallRules(syntax, accept)
                if tool_choice == "required" or tool_name is not None:
                    reply_start = forced_opening(syntax, tool_name)
                    grammar_text = call_grammar(syntax, tools, strict_tools, tokenizer.control, tool_name)
                elif strict_tools:  # the model may answer or call: a call it opens follows the schemas
                    grammar_text = call_grammar(syntax, tools, strict_tools, tokenizer.control, forced=False)
                    grammar_after = syntax.open
            texts: Sequence[Union[str, list[int], RenderedPrompt]] = [rendered]
        else:
            texts = prompts
        if reply_format is not None:
            grammar_text = json_schema_grammar(reply_format.schema, lenient=not reply_format.strict)
            grammar_after = reasoning.close if inside_thinking else ""  # the answer follows the thinking
        after_prompt = reply_start
        if inside_thinking and reply_start:  # a forced call comes after the thinking: it is left empty
            after_prompt = reasoning.close + "\n\n" + reply_start
            inside_thinking = False
        token_lists = [_prompt_tokens(model, text, after_prompt, prompt_param, max_tokens, max_tokens_param)
                       for text in texts]
        grammar = None
        if grammar_text is not None:
            try:
                grammar = model.tokenizer.apply(Grammar, (tokenizer, model.end_ids, grammar_text))
            except GrammarError as exc:
                param = reply_format.param if reply_format is not None else "tools"
                raise invalid(f"the schema cannot be enforced: {exc}", param=param) from None
        context = model.engine.context_length
        return GenerationJob(
            token_lists, n=n, tokenizer=tokenizer, end_ids=model.end_ids,
            max_tokens=max_tokens or context - max(map(len, token_lists)), sampling=params, stop=stop,
            tool_rules=rules, reply_start=reply_start, one_tool_call=one_tool_call,
            reasoning=reasoning, inside_thinking=inside_thinking, grammar=grammar, grammar_after=grammar_after,
            thinking_budget=thinking_budget,
            top_logprobs=top_logprobs,
        )

    return _start(model_id, job)


def _prompt_tokens(
    model: LoadedModel, prompt: Union[str, list[int], RenderedPrompt], after_prompt: str, param: str,
    max_tokens: Optional[int], max_tokens_param: str,
) -> list[int]:
    """One prompt's tokens, ``after_prompt`` text included; 400 if it does not fit the context with ``max_tokens`` more."""
    context = model.engine.context_length
    if isinstance(prompt, list):
        tokens = _known_ids(model, prompt, param)
    else:
        rendered = prompt if isinstance(prompt, RenderedPrompt) else RenderedPrompt(prompt)
        full = rendered.text + after_prompt
        fewest = model.engine.tokenizer.fewest_tokens(full.replace(rendered.inert, "") if rendered.inert else full)
        if fewest > context:  # too long to fit, whatever its tokens: not worth seconds of tokenizing
            raise invalid(
                f"this model's context is {context} tokens; the prompt has at least {fewest} tokens",
                param=param, code="context_length_exceeded",
            )
        tokens = model.tokenize(full, inert=rendered.inert)
    if len(tokens) + (max_tokens or 1) > context:
        raise invalid(
            f"this model's context is {context} tokens; the prompt has {len(tokens)} tokens"
            + (f" and {max_tokens_param} asks for {max_tokens} more" if max_tokens else ""),
            param=max_tokens_param if max_tokens else param,
            code="context_length_exceeded",
        )
    return tokens


def _check_schema(schema: dict, param: str, what: str = "the schema") -> None:
    """400 unless ``schema`` is a JSON Schema."""
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise invalid(f"{what} is not a valid JSON Schema: {exc.message}", param=param) from None


def _known_ids(model: LoadedModel, ids: list[int], param: str) -> list[int]:
    """Token ids given by the client, taken as they are; 400 if one is not in the model's vocabulary."""
    vocab = model.engine.tokenizer.vocab_size
    if any(token >= vocab for token in ids):
        raise invalid(f"{param} has token ids outside this model's vocabulary of {vocab}", param=param)
    return list(ids)


def _accept_calls(tools: list[dict], strict_tools: frozenset[str]) -> Callable[[str, dict], bool]:
    """Which calls the tools take: a known name, and for a strict tool, arguments its schema validates."""
    checks: dict[str, Optional[jsonschema.protocols.Validator]] = {}  # None: any arguments
    for tool in tools:
        name, schema = tool["function"]["name"], tool["function"]["parameters"]
        if name not in strict_tools:
            checks[name] = None
            continue
        _check_schema(schema, "tools", f"the parameters of tool {name!r}")
        checks[name] = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)

    def accept(name: str, arguments: dict) -> bool:
        return name in checks and (checks[name] is None or checks[name].is_valid(arguments))

    return accept


def start_embedding(model_id: str, inputs: list[Union[str, list[int]]], param: str) -> Session:
    """Admit and prepare the embedding of ``inputs`` (texts, or token ids taken as they are); return its session."""

    def job(model: LoadedModel) -> EmbeddingJob:
        context = model.engine.context_length
        token_lists = []
        for index, given in enumerate(inputs):
            if isinstance(given, str) and model.engine.tokenizer.fewest_tokens(given) > context:
                raise invalid(f"input {index} cannot fit this model's context of {context} tokens",
                              param=param, code="context_length_exceeded")
            tokens = model.tokenize(given) if isinstance(given, str) else _known_ids(model, given, param)
            if len(tokens) > context:
                raise invalid(
                    f"input {index} has {len(tokens)} tokens; this model's context is {context}",
                    param=param, code="context_length_exceeded",
                )
            token_lists.append(tokens)
        return EmbeddingJob(token_lists)

    return _start(model_id, job)


def shutting_down() -> ApiError:
    """A 503 for work that arrives while the server shuts down; its outcome is logged as "shutdown"."""
    record().outcome = "shutdown"
    return ApiError(503, "the server is shutting down; retry on another instance", code="shutting_down",
                    headers={"Retry-After": "1"})


def _start(model_id: str, prepare: Callable[[LoadedModel], Job]) -> Session:
    """Look up the model, take an admission place, prepare the job: the shared path before the commit."""
    kronk = state()
    settings = kronk.settings
    rec = record()
    deadline = rec.started + settings.request_timeout
    if kronk.pool.drain.started:
        raise shutting_down()
    gone = client_watch(request.environ)
    with use_model(model_id) as model:  # the lease keeps it loaded from admission on
        try:
            lease = model.admit(min(settings.admission_timeout, deadline - time.monotonic()), gone, kronk.pool.drain)
        except ShuttingDown:
            raise shutting_down() from None
        except Overloaded as exc:
            kronk.metrics.rejected.labels(model_id).inc()
            raise ApiError(429, str(exc), code="model_busy", headers={"Retry-After": str(exc.retry_after)}) from None
        except ClientGone:
            rec.outcome = "client_gone"
            raise ApiError(499, "client closed the connection while waiting for admission") from None
    try:
        job = prepare(model)
    except BaseException:
        lease.release()
        raise
    session = Session(
        model, lease, job, started=rec.started, deadline=deadline, drain=kronk.pool.drain,
        keepalive=settings.keepalive_interval, client_gone=gone, metrics=kronk.metrics,
    )
    rec.stats = session.stats
    return session
