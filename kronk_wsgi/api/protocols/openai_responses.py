"""/v1/responses: OpenAI's Responses API, streamed or whole; responses kept for GET and previous_response_id."""

import json
import re
import time
import uuid
from typing import Annotated, Any, Callable, Iterator, Literal, Optional, Union

import flask
import gevent
import pydantic
import structlog
from flask import Blueprint, jsonify
from pydantic import Discriminator, Field, Tag

from ...engine.sampling import SamplingParams
from ...serving import offload
from ...serving.events import (
    ArgumentsDelta, ChoiceEnd, Event, Failed, Finished, Logprobs, ReasoningDelta, TextDelta, ToolCall, ToolCallStart,
    Usage,
)
from ...serving.formats import custom_arguments, custom_input
from ..background import UNFINISHED, BackgroundRun, resumed
from ..body import parse_body
from ..errors import ApiError, invalid
from ..planning import JSON_OBJECT, GenerationRequest, ReplyFormat, ToolUse
from ..protocol import Protocol
from ..response import Encoder, respond, watched
from ..schemas import (
    CustomToolSpec, FunctionName, Metadata, PromptCacheBreakpoint, PromptCacheOptions, ReasoningEffort, SchemaName,
    ServiceTier, Strict, User, json_object, refuse_given, template_role, template_tool, template_tool_call,
    template_variables,
)
from ..sessions import count_prompt_tokens, start_generation, start_later
from ..sse import sse
from ..state import record, state
from .openai_chat import logprob_content

bp = Blueprint("openai_responses", __name__)
PROTOCOL = Protocol("openai_responses", bp, prefixes=("/v1/responses",))

log = structlog.get_logger("kronk_wsgi.responses")

STORE_WAIT_SECONDS = 2.0  # how long a finished response waits for its write before the client hears it is done


class InputText(Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Optional[PromptCacheBreakpoint] = None


class OutputText(Strict):
    type: Literal["output_text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Annotated[Union[InputText, OutputText], Field(discriminator="type")]]]
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None  # an earlier answer's: it is text all the same

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


Caller = Optional[dict[str, Any]]  # who made a call (the model, or a program): the model, here
ToolOutput = Union[str, list[InputText]]  # a tool's result: text, or text parts (no images or files here)


def _tool_output_text(output: ToolOutput) -> str:
    return output if isinstance(output, str) else "".join(part.text for part in output)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: FunctionName
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None
    namespace: Optional[str] = None  # the namespace tool the function belongs to
    caller: Caller = None

    @pydantic.field_validator("arguments")
    @classmethod
    def _arguments(cls, value: str) -> str:
        json_object(value, "arguments")
        return value


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: ToolOutput
    id: Optional[str] = None
    status: Optional[str] = None
    name: Optional[str] = None
    namespace: Optional[str] = None
    caller: Caller = None


class CustomToolCallItem(Strict):
    type: Literal["custom_tool_call"]
    call_id: str
    name: FunctionName
    input: str
    id: Optional[str] = None
    status: Optional[str] = None
    namespace: Optional[str] = None
    caller: Caller = None


class CustomToolCallOutputItem(Strict):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: ToolOutput
    id: Optional[str] = None
    status: Optional[str] = None
    caller: Caller = None


class ReasoningItem(Strict):
    """An earlier turn's thinking, handed back: accepted, and left out of the prompt."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[Any] = []
    content: Optional[list[Any]] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None


def _item_type(value: Any) -> Optional[str]:
    return value.get("type", "message") if isinstance(value, dict) else None


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[CustomToolCallItem, Tag("custom_tool_call")],
        Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    Discriminator(_item_type),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


# Tools OpenAI runs itself: accepted, not offered to the model (which could not use them here), and named in
# the response's Kronk-Tools-Not-Offered header.
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                "code_interpreter", "image_generation", "mcp", "computer_use_preview", "local_shell", "shell",
                "apply_patch")


class HostedTool(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]
    name: Optional[str] = None

    @property
    def label(self) -> str:
        return self.name or self.type


class BackgroundOptions(Strict):
    """Accepted: a background response runs as soon as a place is free, whatever its window."""

    completion_window: Literal["soonest", "2h", "8h"] = "soonest"
    continuation_id: Optional[str] = None


class ImageOptions(Strict):
    context_compression: Literal["auto", "enabled", "disabled"] = "auto"


class CustomTool(CustomToolSpec):
    type: Literal["custom"]

    def as_function(self) -> "FunctionTool":
        return FunctionTool(type="function", name=self.name, description=self.description, strict=True,
                            parameters=self.parameters())


class NamespaceTool(Strict):
    """A group of functions under one name (Codex's multi-agent tools): each is offered to the model, and its
    calls come back in the namespace."""

    type: Literal["namespace"]
    name: FunctionName
    description: Optional[str] = None
    tools: list[FunctionTool]


def _tool_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace", "custom") else "hosted"


ResponsesTool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                                Annotated[CustomTool, Tag("custom")], Annotated[HostedTool, Tag("hosted")]],
                          Discriminator(_tool_type)]


class ReasoningConfig(Strict):
    """Switches thinking off (effort none or minimal) or on where the template can, as chat's reasoning_effort."""

    effort: Optional[ReasoningEffort] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None  # the reasoning is given whole, not summarized
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class StreamOptions(Strict):
    include_obfuscation: Optional[bool] = None  # no padding: a local stream has no one to hide its size from


class NamedFunction(Strict):
    type: Literal["function", "custom"]
    name: FunctionName


class AllowedTool(pydantic.BaseModel):
    """One tool an allowed_tools choice names: a function or custom tool by name; a hosted tool (which is not
    offered here) by its type."""

    model_config = pydantic.ConfigDict(extra="allow")
    type: str
    name: Optional[str] = None


class AllowedToolsChoice(Strict):
    """The tools the model may call, of those offered (which the prompt shows all of)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectTextFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaTextFormat(Strict):
    type: Literal["json_schema"]
    name: SchemaName
    schema_: dict[str, Any] = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(Strict):
    format: Optional[Annotated[
        Union[TextFormat, JsonObjectTextFormat, JsonSchemaTextFormat], Field(discriminator="type")]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # accepted: a reply's length is max_output_tokens
    def reply_format(self) -> Optional[ReplyFormat]:
        if isinstance(self.format, JsonObjectTextFormat):
            return ReplyFormat(JSON_OBJECT, strict=False, param="text.format")
        if isinstance(self.format, JsonSchemaTextFormat):
            return ReplyFormat(self.format.schema_, bool(self.format.strict), "text.format")
        return None


class ResponsesRequest(Strict):
    model: str
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stream: bool = False
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], Annotated[
        Union[NamedFunction, AllowedToolsChoice], Field(discriminator="type")], None] = None
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[ServiceTier] = None
    text: Optional[TextConfig] = None
    truncation: Optional[Literal["disabled", "auto"]] = None  # auto: the oldest input goes until the prompt fits
    user: Optional[User] = None
    include: Optional[list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]]] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    reasoning: Optional[ReasoningConfig] = None
    max_tool_calls: Optional[Annotated[int, Field(ge=1)]] = None
    stream_options: Optional[StreamOptions] = None
    # Accepted as today's clients send them: see docs/PROTOCOLS.rst for what each does here.
    prompt_cache_key: Optional[Annotated[str, Field(max_length=1024)]] = None
    safety_identifier: Optional[Annotated[str, Field(max_length=512)]] = None
    client_metadata: Optional[dict[str, Any]] = None
    background: bool = False  # answered after the POST returns: see api/background.py
    background_options: Optional[BackgroundOptions] = None
    prompt_cache_options: Optional[PromptCacheOptions] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None  # the prompt cache's budgets decide
    image: Optional[ImageOptions] = None  # no images here: nothing to compress
    access_programs: Optional[dict[str, Any]] = None  # one program here, the standard one
    # Refused: see CANNOT
    moderation: Optional[dict[str, Any]] = None
    conversation: Union[str, dict[str, Any], None] = None
    prompt: Optional[dict[str, Any]] = None
    context_management: Optional[list[dict[str, Any]]] = None
    # What the SGLang gateway writes into a Responses body: taken at these values (top_k -1 is off)
    priority: Optional[int] = None  # one queue here: every request is served in turn
    top_k: Literal[-1, 0] = -1
    min_p: Annotated[float, Field(ge=0, le=0)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=1, le=1)] = 1.0

    _refused = pydantic.field_validator("moderation", "conversation", "prompt", "context_management")(refuse_given)

    @pydantic.field_validator("background")
    @classmethod
    def _stored(cls, background: bool, info: pydantic.ValidationInfo) -> bool:
        if background and info.data.get("store") is False:
            raise ValueError("a background response is stored, to be polled: background needs store true")
        return background

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "ResponsesRequest":
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools")
        return self

    def instruction_messages(self) -> list[dict]:
        """The instructions, as the conversation's system message (a previous response's are not carried over)."""
        return [] if self.instructions is None else [{"role": "system", "content": self.instructions}]

    def input_messages(self) -> list[dict]:
        """The input as chat messages, for the chat template."""
        return self._input()[0]

    def _input(self) -> tuple[list[dict], list[int]]:
        """The input as chat messages, and how many of them each prompt_cache_breakpoint's prefix runs through."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}], []
        messages: list[dict] = []
        breaks: list[int] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": template_role(item.role), "content": item.text()})
                if isinstance(item.content, list) and any(getattr(p, "prompt_cache_breakpoint", None)
                                                          for p in item.content):
                    breaks.append(len(messages))
            elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
                arguments = json_object(item.arguments, "arguments") if isinstance(item, FunctionCallItem) \
                    else custom_arguments(item.input)
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                messages[-1].setdefault("tool_calls", []).append(template_tool_call(item.call_id, item.name,
                                                                                    arguments))
            elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
                text = _tool_output_text(item.output)
                messages.append({"role": "tool", "content": text, "tool_call_id": item.call_id})
        return messages, breaks

    def generation_request(self, conversation: list[dict]) -> GenerationRequest:
        """What the body asks for, ``conversation`` (the previous response's and this input) as the prompt."""
        effort = self.reasoning.effort if self.reasoning else None
        messages = self.instruction_messages() + conversation
        given, breaks = self._input()
        before = len(messages) - len(given)  # the instructions and the previous responses' messages
        return GenerationRequest(
            self.model, prompt_param="input", messages=messages, cache_breaks=tuple(before + b for b in breaks),
            tools=self._tool_use(), reply_format=self.text.reply_format() if self.text else None,
            thinking=None if effort is None else effort not in ("none", "minimal"),
            template_vars=template_variables(effort), truncate=self.truncation == "auto",
            not_offered=tuple(t.label for t in self.tools or () if isinstance(t, HostedTool)),
            sampling=SamplingParams(temperature=self.temperature, top_p=self.top_p),
            max_tokens=self.max_output_tokens, max_tokens_param="max_output_tokens", top_logprobs=self._logprobs(),
            cache_key=self.prompt_cache_key,
        )

    def functions(self) -> list[FunctionTool]:
        """The functions offered to the model: the request's own, those of its namespaces, and its custom tools."""
        offered = []
        for tool in self.tools or ():
            if isinstance(tool, NamespaceTool):
                offered += tool.tools
            elif isinstance(tool, FunctionTool):
                offered.append(tool)
            elif isinstance(tool, CustomTool):
                offered.append(tool.as_function())
        return offered

    def custom_tools(self) -> frozenset[str]:
        """The names of the custom tools: their calls are custom_tool_call items."""
        return frozenset(t.name for t in self.tools or () if isinstance(t, CustomTool))

    def namespaces(self) -> dict[str, str]:
        """Each namespaced function's namespace, by its name."""
        return {f.name: t.name for t in self.tools or () if isinstance(t, NamespaceTool) for f in t.tools}

    def _tool_use(self) -> Optional[ToolUse]:
        functions = self.functions()
        if not functions:
            return None
        choice = self.tool_choice
        allowed = choice if isinstance(choice, AllowedToolsChoice) else None
        return ToolUse(
            tuple(template_tool(t.name, t.description, t.parameters) for t in functions),
            # strict is on unless the tool turns it off, as in OpenAI's Responses API
            strict=frozenset(t.name for t in functions if t.strict is not False),
            choice=choice if isinstance(choice, str) else "auto" if choice is None else
            allowed.mode if allowed else "required",
            name=choice.name if isinstance(choice, NamedFunction) else None,
            max_calls=1 if self.parallel_tool_calls is False else self.max_tool_calls,
            raw_inputs={t.name: t.lark for t in self.tools or () if isinstance(t, CustomTool) and t.lark is not None},
            allowed=frozenset(t.name for t in allowed.tools if t.type in ("function", "custom"))
            if allowed else None,
        )

    def _logprobs(self) -> Optional[int]:
        """How many likeliest tokens to list with each output text token; None: no log probabilities."""
        if self.top_logprobs is None and "message.output_text.logprobs" not in (self.include or ()):
            return None
        return self.top_logprobs or 0


def _usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _message_item(item_id: str, text: str, status: str, logprobs: Optional[list[dict]] = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    content = [] if status == "in_progress" else [part]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _call_item(call: ToolCall, arguments: str, status: str, namespace: Optional[str] = None) -> dict:
    item = {"id": "fc_" + call.id, "type": "function_call", "status": status, "call_id": "call_" + call.id,
            "name": call.name, "arguments": arguments}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _custom_call_item(call: ToolCall, status: str) -> dict:
    return {"id": "ctc_" + call.id, "type": "custom_tool_call", "status": status, "call_id": "call_" + call.id,
            "name": call.name, "input": custom_input(call.arguments, call.complete)}


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _not_kept(response_id: str, param: Optional[str] = None) -> ApiError:
    return ApiError(404, f"no stored response has the id {response_id[:100]!r}", code="response_not_found", param=param)


def _stored(read: Callable[[str, str], Any], response_id: str, param: Optional[str] = None) -> Any:
    """What ``read`` (the store's get or conversation) finds of a response of this request's key, in the store
    thread; 404 if it is not (or no longer) kept."""
    found = offload.call(state().store_thread, read, response_id, record().owner)
    if found is None:
        raise _not_kept(response_id, param)
    return found


def _storer(response_id: str, previous: Optional[str], messages: list[dict]) -> Callable[[dict], None]:
    """What stores a finished response (``messages`` its input): it waits up to STORE_WAIT_SECONDS for the write.

    A failed write is an ApiError (500 ``store_failed``), in time for the client to hear of it; a write
    that takes longer goes on in the store thread, before any later read of this worker.
    """
    kronk, owner = state(), record().owner

    def write(final: dict) -> None:
        try:
            kronk.responses.put(final, owner, previous, messages + [_assistant_message(final["output"])])
        except Exception as exc:  # sqlite3's and the file system's errors
            log.error("response not stored", response_id=response_id, error=f"{type(exc).__name__}: {exc}")
            raise

    def store_response(final: dict) -> None:
        try:
            with gevent.Timeout(STORE_WAIT_SECONDS):
                offload.call(kronk.store_thread, write, final)
        except gevent.Timeout:
            log.warning("response store slow: the write goes on", response_id=response_id)
        except Exception as exc:
            raise ApiError(500, f"the response could not be stored: {exc}", code="store_failed") from None

    return store_response


def _open_sealed(body: "ResponsesRequest") -> None:
    """400 naming the item if reasoning handed back sealed was not sealed here, or was changed."""
    sealer = state().sealer
    for index, item in enumerate(body.input if isinstance(body.input, list) else ()):
        if isinstance(item, ReasoningItem) and item.encrypted_content is not None:
            try:
                sealer.open(item.encrypted_content)
            except ValueError as exc:
                raise invalid(f"input[{index}].encrypted_content: {exc}",
                              param=f"input[{index}].encrypted_content") from None


def _assistant_message(output: list[dict]) -> dict:
    """A response's output items as the assistant's chat message, for the conversation it continues."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [template_tool_call(item["call_id"], item["name"], _call_arguments(item))
             for item in output if item["type"] in ("function_call", "custom_tool_call")]
    if calls:
        message["tool_calls"] = calls
    return message


def _call_arguments(item: dict) -> Any:
    """A call item's arguments as chat templates take them: an object, or the text of one cut off by the token
    limit, as it was written."""
    if item["type"] == "custom_tool_call":
        return custom_arguments(item["input"])
    try:
        return json.loads(item["arguments"])
    except ValueError:
        return item["arguments"]


@bp.post("/v1/responses")
def responses():
    """Generate a model response; with store (the default), keep it for previous_response_id and GET."""
    body = parse_body(ResponsesRequest)
    _open_sealed(body)
    previous = [] if body.previous_response_id is None else _conversation(body.previous_response_id)
    request = body.generation_request(previous + body.input_messages())
    response_id = _new_id("resp_")
    if body.background:
        run = BackgroundRun(state(), response_id, record().owner)
        try:
            admit = start_later(request)
        except BaseException:
            run.forget()
            raise
    else:
        session = start_generation(request)
    record().response_id = response_id
    choice = body.tool_choice
    store = body.store is not False  # OpenAI's default
    base = {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "queued" if body.background else "in_progress", "background": body.background,
        "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": body.model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": store, "temperature": body.temperature,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text and body.text.format else {"type": "text"}},
        "tool_choice": choice.model_dump(exclude_none=True) if choice is not None and not isinstance(choice, str)
        else choice or "auto",
        "tools": [t.model_dump() for t in body.tools or ()], "top_p": body.top_p,
        "truncation": body.truncation or "disabled", "max_tool_calls": body.max_tool_calls,
        "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
        "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier,
        "top_logprobs": body.top_logprobs,
        "usage": None, "user": body.user, "metadata": body.metadata or {},
    }

    store_response = _storer(response_id, body.previous_response_id, body.input_messages()) if store else None
    seal = state().sealer.seal if "reasoning.encrypted_content" in (body.include or ()) else None
    encoder = ResponsesEncoder(base, store_response, seal, body.namespaces(), body.custom_tools())
    if body.background:
        return run.start(admit, encoder, store_response, body.stream)
    return respond(session, encoder, body.stream)


@bp.post("/v1/responses/input_tokens")
def input_tokens():
    """The input tokens the same response request would take (previous_response_id's conversation included)."""
    body = parse_body(ResponsesRequest)
    _open_sealed(body)
    previous = [] if body.previous_response_id is None else _conversation(body.previous_response_id)
    count = count_prompt_tokens(body.generation_request(previous + body.input_messages()))
    return jsonify({"object": "response.input_tokens", "input_tokens": count})


def _conversation(response_id: str) -> list[dict]:
    """The conversation a request continues; 400 if that response is not done yet (a background one)."""
    earlier = _stored(state().responses.get, response_id, "previous_response_id")
    if earlier["status"] in UNFINISHED:
        raise invalid(f"response {response_id[:100]!r} is {earlier['status']}: continue it once it is done",
                      param="previous_response_id")
    return _stored(state().responses.conversation, response_id, "previous_response_id")


@bp.get("/v1/responses/<response_id>")
def get_response(response_id: str):
    """A stored response; with ``stream=true``, a background response's stream again, from the event after
    ``starting_after`` (its sequence number) on."""
    kronk = state()
    found = _stored(kronk.responses.get, response_id)
    if flask.request.args.get("stream", "false").lower() not in ("true", "1"):
        return jsonify(found)
    if not found.get("background"):
        raise invalid("only a background response's stream can be read again", param="stream")
    after = flask.request.args.get("starting_after", "-1")
    if not re.fullmatch(r"-?[0-9]{1,15}", after):
        raise invalid(f"starting_after must be an event's sequence number, not {after[:50]!r}",
                      param="starting_after")
    frames = resumed(kronk, record().owner, response_id, int(after), kronk.settings.keepalive_interval,
                     PROTOCOL.framing.keepalive)
    return PROTOCOL.stream(watched(frames))


@bp.post("/v1/responses/<response_id>/cancel")
def cancel_response(response_id: str):
    """Cancel a background response: it stops before its next token. The response as it is then (one that
    ended first is returned as it ended)."""
    kronk = state()
    if not _stored(kronk.responses.get, response_id).get("background"):
        raise invalid("only background responses can be cancelled")
    cancelled = _stored(kronk.responses.cancel, response_id)
    run = kronk.background.get(response_id)
    if run is not None:
        run.cancelled_here = True
    return jsonify(cancelled)


@bp.delete("/v1/responses/<response_id>")
def delete_response(response_id: str):
    """Forget a stored response."""
    kronk = state()
    if not offload.call(kronk.store_thread, kronk.responses.delete, response_id, record().owner):
        raise _not_kept(response_id)
    return jsonify({"id": response_id, "object": "response", "deleted": True})


def _final(base: dict, output: list[dict], end: ChoiceEnd, event: Finished) -> dict:
    """The finished response object: completed, or incomplete at max_output_tokens."""
    incomplete = end.reason == "length"
    return {
        **base, "status": "incomplete" if incomplete else "completed", "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "usage": _usage(event.usage),
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def _output_text(output: list[dict]) -> str:
    return "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])


class ResponsesEncoder(Encoder):
    """Numbered events from 0: created and in_progress (the commit), output items, completed or incomplete.

    The model's thinking is a reasoning item (its text as reasoning_text) before the answer; with ``seal``,
    the item also carries its text sealed as ``encrypted_content``, for a client that keeps no state.
    """

    protocol = PROTOCOL

    def __init__(self, base: dict, store_response: Optional[Callable[[dict], None]] = None,
                 seal: Optional[Callable[[str], str]] = None, namespaces: Optional[dict[str, str]] = None,
                 custom_tools: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.base = base
        self.namespaces = namespaces or {}  # a namespaced function's namespace, by its name
        self.custom_tools = custom_tools  # the names whose calls are custom_tool_call items
        self.store_response = store_response  # stores the finished response object, if the request asked for it
        self.seal = seal
        self.sequence = 0
        self.output: list[dict] = []
        self.message_id: Optional[str] = None  # the message item being written, if any
        self.texts: list[str] = []
        self.reasoning_id: Optional[str] = None  # the reasoning item being written, if any
        self.thoughts: list[str] = []
        self.listed: list[dict] = []  # log probabilities of the message so far (output text only)
        self.started: dict[str, int] = {}  # a started call's id: how much of its arguments was sent
        self.end = ChoiceEnd("stop")

    def _event(self, kind: str, **fields: Any) -> str:
        frame = sse({"type": kind, "sequence_number": self.sequence, **fields}, kind)
        self.sequence += 1
        return frame

    def _sealed(self, item: dict) -> dict:
        if self.seal is not None:
            item["encrypted_content"] = self.seal(item["content"][0]["text"])
        return item

    def start(self) -> Iterator[str]:
        yield self._event("response.created", response=self.base)
        yield self._event("response.in_progress", response=self.base)

    def reasoning(self, event: ReasoningDelta) -> Iterator[str]:
        if self.reasoning_id is None:
            self.reasoning_id = _new_id("rs_")
            yield self._event("response.output_item.added", output_index=len(self.output),
                              item=_reasoning_item(self.reasoning_id, "", "in_progress"))
        self.thoughts.append(event.text)
        yield self._event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=len(self.output),
                          content_index=0, delta=event.text)

    def _close_reasoning(self) -> Iterator[str]:
        if self.reasoning_id is None:
            return
        text, item_id = "".join(self.thoughts), self.reasoning_id
        yield self._event("response.reasoning_text.done", item_id=item_id, output_index=len(self.output),
                          content_index=0, text=text)
        item = self._sealed(_reasoning_item(item_id, text, "completed"))
        yield self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.reasoning_id, self.thoughts = None, []

    def text(self, event: TextDelta) -> Iterator[str]:
        yield from self._close_reasoning()
        where = {"output_index": len(self.output), "content_index": 0}
        if self.message_id is None:
            self.message_id = _new_id("msg_")
            yield self._event("response.output_item.added", output_index=len(self.output),
                              item=_message_item(self.message_id, "", "in_progress"))
            yield self._event("response.content_part.added", item_id=self.message_id, **where,
                              part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.texts.append(event.text)
        listed = logprob_content(self.take_logprobs())
        self.listed += listed
        yield self._event("response.output_text.delta", item_id=self.message_id, **where, delta=event.text,
                          logprobs=listed)

    def _close_message(self, status: str) -> Iterator[str]:
        if self.message_id is None:
            return
        text, item_id = "".join(self.texts), self.message_id
        where = {"item_id": item_id, "output_index": len(self.output), "content_index": 0}
        item = _message_item(item_id, text, status, self.listed)
        yield self._event("response.output_text.done", **where, text=text, logprobs=self.listed)
        yield self._event("response.content_part.done", **where, part=item["content"][0])
        yield self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.message_id, self.texts, self.listed = None, [], []
        self.take_logprobs()  # tokens whose text never came out: only output text lists its tokens

    def call_start(self, event: ToolCallStart) -> Iterator[str]:
        # A function's call goes out as it is written (its item is the next output); a custom tool's input comes
        # whole, at its end.
        if event.name in self.custom_tools:
            return
        yield from self._close_reasoning()
        yield from self._close_message("completed")
        self.started[event.id] = 0
        added = _call_item(ToolCall(event.id, event.name, ""), "", "in_progress", self.namespaces.get(event.name))
        yield self._event("response.output_item.added", output_index=len(self.output), item=added)

    def call_arguments(self, event: ArgumentsDelta) -> Iterator[str]:
        if event.id in self.started:
            self.started[event.id] += len(event.text)
            yield self._event("response.function_call_arguments.delta", item_id="fc_" + event.id,
                              output_index=len(self.output), delta=event.text)

    def tool_call(self, event: ToolCall) -> Iterator[str]:
        yield from self._close_reasoning()
        yield from self._close_message("completed")
        self.take_logprobs()  # the call's own tokens: only output text lists its tokens
        if event.name in self.custom_tools:
            yield from self._custom_call(event)
            return
        index, item_id = len(self.output), "fc_" + event.id
        sent = self.started.pop(event.id, None)
        if sent is None:
            added = _call_item(event, "", "in_progress", self.namespaces.get(event.name))
            yield self._event("response.output_item.added", output_index=index, item=added)
        if event.arguments[sent or 0:]:
            yield self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                              delta=event.arguments[sent or 0:])
        yield self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                          arguments=event.arguments)
        item = _call_item(event, event.arguments, "completed" if event.complete else "incomplete",
                          self.namespaces.get(event.name))
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    def _custom_call(self, event: ToolCall) -> Iterator[str]:
        index, item = len(self.output), _custom_call_item(event, "completed" if event.complete else "incomplete")
        yield self._event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                                  "input": ""})
        yield self._event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                          delta=item["input"])
        yield self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                          input=item["input"])
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        self.end = event
        yield from self._close_reasoning()
        yield from self._close_message("incomplete" if event.reason == "length" else "completed")

    def finished(self, event: Finished) -> Iterator[str]:
        final = _final(self.base, self.output, self.end, event)
        if self.store_response:
            try:
                self.store_response(final)  # before the client hears it is done: it may continue the conversation at once
            except ApiError as exc:
                error = {"code": exc.code, "message": exc.message}
                yield self._event("response.failed", response={**final, "status": "failed", "error": error})
                return
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=final)

    def failed(self, event: Failed) -> Iterator[str]:
        error = {"code": "server_error", "message": event.message}
        yield self._event("response.failed", response={**self.base, "status": "failed", "error": error,
                                                         "output": self.output})

    def whole(self, output: list[Event], finished: Finished) -> dict:
        end = next(e for e in output if isinstance(e, ChoiceEnd))
        answer = [e for e in output if isinstance(e, (TextDelta, ToolCall))]
        thinking = "".join(e.text for e in output if isinstance(e, ReasoningDelta))
        items = [self._sealed(_reasoning_item(_new_id("rs_"), thinking, "completed"))] if thinking else []
        listed = {id(text): logprob_content(tokens.tokens) for tokens, text in zip(output, output[1:])
                  if isinstance(tokens, Logprobs) and isinstance(text, TextDelta)}
        for position, event in enumerate(answer):
            if isinstance(event, ToolCall):
                status = "completed" if event.complete else "incomplete"
                items.append(_custom_call_item(event, status) if event.name in self.custom_tools
                             else _call_item(event, event.arguments, status, self.namespaces.get(event.name)))
            else:
                cut_short = position == len(answer) - 1 and end.reason == "length"
                status = "incomplete" if cut_short else "completed"
                items.append(_message_item(_new_id("msg_"), event.text, status, listed.get(id(event))))
        return {**_final(self.base, items, end, finished), "output_text": _output_text(items)}

    def store_whole(self, answer: dict) -> None:
        if self.store_response:
            self.store_response({key: value for key, value in answer.items() if key != "output_text"})
