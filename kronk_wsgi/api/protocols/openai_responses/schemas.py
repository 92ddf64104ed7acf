"""The Responses API's request body: input items, tools, tool choice, text format, and the GenerationRequest
it asks for."""

from typing import Annotated, Any, Literal, Optional, Union

import pydantic
from pydantic import Discriminator, Field, Tag

from ....engine.sampling import SamplingParams
from ....serving.formats import custom_arguments
from ...compaction import KEPT_ROLES, summary_message
from ...media import MediaInput, from_store, inputs, joined, media_url, stored
from ...planning import JSON_OBJECT, MODEL_SAMPLING, GenerationRequest, ReplyFormat, ToolUse
from ...schemas import (
    CustomToolSpec, FunctionName, MediaPart, Metadata, PromptCacheBreakpoint, PromptCacheOptions, ReasoningEffort,
    SchemaName, ServiceTier, Strict, User, json_object, left_out, media_parts, part_texts, refuse_given,
    template_role, template_tool, template_tool_call, template_variables,
)


class InputText(Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Optional[PromptCacheBreakpoint] = None


class InputImage(MediaPart):
    type: Literal["input_image"]
    image_url: Optional[str] = None  # a base64 data URL, or a URL the media_allow setting allows
    file_id: Optional[str] = None
    detail: Optional[Literal["low", "high", "auto", "original"]] = None  # the projector reads it at its own size

    @pydantic.model_validator(mode="after")
    def _read(self) -> "InputImage":
        if self.file_id is not None:
            raise ValueError("there is no Files API here: send the image itself, as image_url (a base64 data URL)")
        if self.image_url is None:
            raise ValueError("input_image needs image_url")
        self._data = media_url(self.image_url, self)
        return self


class InputFile(Strict):
    """Refused: a file (a PDF) is read by no model here; its text, or its pages as images, can be."""

    type: Literal["input_file"]
    file_data: Optional[str] = None
    file_id: Optional[str] = None
    file_url: Optional[str] = None
    filename: Optional[str] = None

    @pydantic.model_validator(mode="after")
    def _refuse(self) -> "InputFile":
        raise ValueError("input_file cannot be read here: send the file's text, or its pages as images")


InputPart = Annotated[Union[InputText, InputImage, InputFile], Field(discriminator="type")]


class OutputText(Strict):
    type: Literal["output_text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Annotated[Union[InputText, OutputText, InputImage, InputFile],
                                       Field(discriminator="type")]]]
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None  # an earlier answer's: it is text all the same

    @pydantic.model_validator(mode="after")
    def _images_in_input(self) -> "MessageItem":
        if self.role == "assistant" and media_parts(self.content):
            raise ValueError("an assistant message carries no images")
        return self

    def template_message(self) -> dict:
        """The message for the chat template, its images kept beside it for the conversation store."""
        if isinstance(self.content, str):
            return {"role": template_role(self.role), "content": self.content}
        parts = part_texts(self.content)
        return stored({"role": template_role(self.role), "content": joined(parts)}, parts)


Caller = Optional[dict[str, Any]]  # who made a call (the model, or a program): the model, here
ToolOutput = Union[str, list[InputPart]]  # a tool's result: text, or parts (its text and images)


def _tool_output_message(output: ToolOutput, call_id: str) -> dict:
    if isinstance(output, str):
        return {"role": "tool", "content": output, "tool_call_id": call_id}
    parts = part_texts(output)
    return stored({"role": "tool", "content": joined(parts), "tool_call_id": call_id}, parts)


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


class CompactionItem(Strict):
    """A summary of the conversation before it, sealed by this server (see api/compaction.py): of the items
    before the last one, only the user's, system and developer messages stay in the prompt, then its summary."""

    type: Literal["compaction"]
    encrypted_content: str
    id: Optional[str] = None
    created_by: Optional[str] = None
    _summary: Optional[str] = pydantic.PrivateAttr(default=None)  # the opened summary (see views._open_sealed)

    def opened(self, summary: str) -> None:
        self._summary = summary

    @property
    def summary(self) -> str:
        assert self._summary is not None, "a compaction item is read once opened"
        return self._summary


class McpListToolsItem(Strict):
    """An earlier response's listing of a server's tools: accepted, and left out of the prompt (the tools are
    listed again, and offered, for each request that names the server)."""

    type: Literal["mcp_list_tools"]
    server_label: str
    tools: list[dict[str, Any]] = []
    id: Optional[str] = None
    error: Optional[str] = None


class McpCallItem(Strict):
    """An earlier call of a server-run tool, with its output or error: the model's call and the tool's answer."""

    type: Literal["mcp_call"]
    server_label: str
    name: FunctionName
    arguments: str
    id: Optional[str] = None
    output: Optional[str] = None
    error: Optional[Any] = None  # a string, or one of OpenAI's error objects (its message or content said)
    status: Optional[str] = None
    approval_request_id: Optional[str] = None


class McpApprovalRequestItem(Strict):
    """An earlier response's request to approve a call: the call, answered by its approval response."""

    type: Literal["mcp_approval_request"]
    id: str
    server_label: str
    name: FunctionName
    arguments: str


class McpApprovalResponseItem(Strict):
    """The client's answer to a request for approval: an approved call runs before the model goes on; a declined
    one is answered to the model as declined."""

    type: Literal["mcp_approval_response"]
    approval_request_id: str
    approve: bool
    id: Optional[str] = None
    reason: Optional[str] = None
    _answer: Optional[str] = pydantic.PrivateAttr(default=None)  # what the model reads (see views._run_approved)

    def answered(self, text: str) -> None:
        self._answer = text

    @property
    def answer(self) -> str:
        if self._answer is not None:
            return self._answer
        return "The user declined this call" + (f": {self.reason}" if self.reason else ".")


def mcp_call_answer(output: Optional[str], error: Any) -> str:
    """What the model read as an mcp_call's answer: its output, or its error (a string, or one of OpenAI's error
    objects: its message, or its content's text) said as one."""
    if error is None:
        return output or ""
    if isinstance(error, dict):
        content = error.get("content")
        text = "".join(part.get("text", "") for part in content if isinstance(part, dict)) \
            if isinstance(content, list) else str(error.get("message", ""))
    else:
        text = str(error)
    return f"Error: {text}"


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
        Annotated[CompactionItem, Tag("compaction")],
        Annotated[McpListToolsItem, Tag("mcp_list_tools")],
        Annotated[McpCallItem, Tag("mcp_call")],
        Annotated[McpApprovalRequestItem, Tag("mcp_approval_request")],
        Annotated[McpApprovalResponseItem, Tag("mcp_approval_response")],
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
                "code_interpreter", "image_generation", "computer_use_preview", "local_shell", "shell",
                "apply_patch")


class HostedTool(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]
    name: Optional[str] = None

    @property
    def label(self) -> str:
        return self.name or self.type


class McpToolFilter(Strict):
    tool_names: Optional[list[str]] = None
    read_only: Optional[bool] = None  # tools annotated readOnlyHint

    def matches(self, name: str, read_only: bool) -> bool:
        named = self.tool_names is None or name in self.tool_names
        return named and (self.read_only is None or self.read_only == read_only)


class McpApprovalFilter(Strict):
    always: Optional[McpToolFilter] = None
    never: Optional[McpToolFilter] = None


class McpServerTool(Strict):
    """A remote MCP server's tools, offered to the model and called by this server: one of the operator's
    ``mcp_servers`` by its name (``server_label``, no ``server_url``), or a ``server_url`` the ``mcp_allow``
    setting allows."""

    type: Literal["mcp"]
    server_label: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    server_url: Optional[str] = None
    server_description: Optional[str] = None  # the tools' own descriptions are what the model reads
    allowed_tools: Union[list[str], McpToolFilter, None] = None
    require_approval: Union[Literal["always", "never"], McpApprovalFilter, None] = None  # None: always, as OpenAI's
    headers: Optional[dict[str, str]] = None
    authorization: Optional[str] = None  # sent as the Authorization header
    allowed_callers: Optional[list[Literal["direct", "programmatic"]]] = None  # the model calls them, here
    defer_loading: Optional[bool] = None  # the tools are listed at once: there are no deferred tools here
    connector_id: Optional[str] = None
    tunnel_id: Optional[str] = None

    @pydantic.field_validator("connector_id", "tunnel_id")
    @classmethod
    def _not_here(cls, value: Optional[str], info: pydantic.ValidationInfo) -> Optional[str]:
        if value is not None:
            raise ValueError(f"there are no OpenAI {info.field_name.removesuffix('_id')}s here: name a server_url, "
                             "or one of the server's mcp_servers by its server_label")
        return value

    def allowed(self, name: str, read_only: bool) -> bool:
        if isinstance(self.allowed_tools, list):
            return name in self.allowed_tools
        return self.allowed_tools is None or self.allowed_tools.matches(name, read_only)

    def waits_for_approval(self, name: str, read_only: bool) -> bool:
        rule = self.require_approval
        if rule is None or isinstance(rule, str):
            return rule != "never"
        if rule.never is not None and rule.never.matches(name, read_only):
            return False
        return rule.always is None or rule.always.matches(name, read_only)

    def request_headers(self) -> dict[str, str]:
        headers = dict(self.headers or {})
        if self.authorization is not None:
            headers["Authorization"] = self.authorization if " " in self.authorization \
                else f"Bearer {self.authorization}"
        return headers


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
    return kind if kind in ("function", "namespace", "custom", "mcp") else "hosted"


ResponsesTool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                                Annotated[CustomTool, Tag("custom")], Annotated[McpServerTool, Tag("mcp")],
                                Annotated[HostedTool, Tag("hosted")]],
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

    @pydantic.field_validator("tools")
    @classmethod
    def _no_mcp(cls, tools: list[AllowedTool]) -> list[AllowedTool]:
        if any(tool.type == "mcp" for tool in tools):
            raise ValueError("an mcp tool cannot be named in allowed_tools here yet: choose its tools with the mcp "
                             "tool's own allowed_tools")
        return tools


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


class Compaction(Strict):
    """Server-side compaction: a prompt past ``compact_threshold`` tokens (80% of the context when not given) is
    compacted before the reply (see api/compaction.py)."""

    type: Literal["compaction"]
    compact_threshold: Optional[Annotated[int, Field(ge=1)]] = None


DEFAULT_COMPACT_SHARE = 0.8  # of the context: the prompt past which a request that compacts is compacted


class ConversationBody(Strict):
    """What a response and a compaction share: the model, the conversation and its prompt cache's hints."""

    model: str
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    prompt_cache_key: Optional[Annotated[str, Field(max_length=1024)]] = None
    prompt_cache_options: Optional[PromptCacheOptions] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None  # the prompt cache's budgets decide
    safety_identifier: Optional[Annotated[str, Field(max_length=512)]] = None
    service_tier: Optional[ServiceTier] = None
    image: Optional[ImageOptions] = None  # no images here: nothing to compress

    def input_items(self) -> list:
        return self.input if isinstance(self.input, list) else []

    def instruction_messages(self) -> list[dict]:
        """The instructions, as the conversation's system message (a previous response's are not carried over)."""
        return [] if self.instructions is None else [{"role": "system", "content": self.instructions}]

    def input_messages(self) -> list[dict]:
        """The input as chat messages, for the chat template."""
        return self._input()[0]

    def _input(self) -> tuple[list[dict], list[int]]:
        """The input as chat messages, and how many of them each prompt_cache_breakpoint's prefix runs through.
        Before the last compaction item, only the messages a compaction keeps."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}], []
        messages: list[dict] = []
        breaks: list[int] = []
        last = max((i for i, item in enumerate(self.input) if isinstance(item, CompactionItem)), default=-1)
        for index, item in enumerate(self.input):
            if index < last and not (isinstance(item, MessageItem) and template_role(item.role) in KEPT_ROLES):
                continue
            if isinstance(item, MessageItem):
                messages.append(item.template_message())
                if isinstance(item.content, list) and any(getattr(p, "prompt_cache_breakpoint", None)
                                                          for p in item.content):
                    breaks.append(len(messages))
            elif isinstance(item, CompactionItem):
                messages.append(summary_message(item.summary))
            elif isinstance(item, (McpCallItem, McpApprovalRequestItem)):
                call_id = item.id or f"mcp_{index}"
                arguments = json_object(item.arguments, "arguments")
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                messages[-1].setdefault("tool_calls", []).append(template_tool_call(call_id, item.name, arguments))
                if isinstance(item, McpCallItem):
                    messages.append({"role": "tool", "content": mcp_call_answer(item.output, item.error),
                                     "tool_call_id": call_id})
            elif isinstance(item, McpApprovalResponseItem):
                messages.append({"role": "tool", "content": item.answer, "tool_call_id": item.approval_request_id})
            elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
                arguments = json_object(item.arguments, "arguments") if isinstance(item, FunctionCallItem) \
                    else custom_arguments(item.input)
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                messages[-1].setdefault("tool_calls", []).append(template_tool_call(item.call_id, item.name,
                                                                                    arguments))
            elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
                messages.append(_tool_output_message(item.output, item.call_id))
        return messages, breaks

    def media(self, conversation: list[dict]) -> dict[str, MediaInput]:
        """The images of the input, and those the stored conversation before it keeps (see GenerationRequest)."""
        given = []
        for index, item in enumerate(self.input_items()):
            if isinstance(item, MessageItem):
                given += [MediaInput(part.data, f"input[{index}].content[{j}]")
                          for j, part in media_parts(item.content)]
            elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
                given += [MediaInput(part.data, f"input[{index}].output[{j}]")
                          for j, part in media_parts(item.output)]
        return inputs([*given, *from_store(conversation, "previous_response_id")])


class CompactRequest(ConversationBody):
    """POST /v1/responses/compact: the conversation (``input`` after ``previous_response_id``'s) to compact."""

    input: Union[str, Annotated[list[InputItem], Field(min_length=1)], None] = None

    def input_messages(self) -> list[dict]:
        return [] if self.input is None else super().input_messages()

    @pydantic.model_validator(mode="after")
    def _something(self) -> "CompactRequest":
        if self.input is None and self.previous_response_id is None:
            raise ValueError("nothing to compact: give input, or previous_response_id, or both")
        return self

    def generation_request(self, conversation: list[dict]) -> GenerationRequest:
        """The conversation, instructions first, as the request a summary is written for (see api/compaction.py)."""
        return GenerationRequest(self.model, prompt_param="input", messages=self.instruction_messages() + conversation,
                                 sampling_defaulted=frozenset(MODEL_SAMPLING.values()), cache_key=self.prompt_cache_key,
                                 media=self.media(conversation))


class ResponsesRequest(ConversationBody):
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stream: bool = False
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], Annotated[
        Union[NamedFunction, AllowedToolsChoice], Field(discriminator="type")], None] = None
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[Metadata] = None
    text: Optional[TextConfig] = None
    truncation: Optional[Literal["disabled", "auto"]] = None  # auto: the oldest input goes until the prompt fits
    user: Optional[User] = None
    include: Optional[list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]]] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    reasoning: Optional[ReasoningConfig] = None
    max_tool_calls: Optional[Annotated[int, Field(ge=1)]] = None
    stream_options: Optional[StreamOptions] = None
    # Accepted as today's clients send them: see docs/PROTOCOLS.rst for what each does here.
    client_metadata: Optional[dict[str, Any]] = None
    background: bool = False  # answered after the POST returns: see api/background.py
    background_options: Optional[BackgroundOptions] = None
    access_programs: Optional[dict[str, Any]] = None  # one program here, the standard one
    # Refused: see CANNOT
    moderation: Optional[dict[str, Any]] = None
    conversation: Union[str, dict[str, Any], None] = None
    prompt: Optional[dict[str, Any]] = None
    context_management: Optional[Annotated[list[Compaction], Field(max_length=1)]] = None
    # What the SGLang gateway writes into a Responses body: taken at these values (top_k -1 is off)
    priority: Optional[int] = None  # one queue here: every request is served in turn
    top_k: Literal[-1, 0] = -1
    min_p: Annotated[float, Field(ge=0, le=0)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=1, le=1)] = 1.0

    _refused = pydantic.field_validator("moderation", "conversation", "prompt")(refuse_given)

    @pydantic.field_validator("background")
    @classmethod
    def _stored(cls, background: bool, info: pydantic.ValidationInfo) -> bool:
        if background and info.data.get("store") is False:
            raise ValueError("a background response is stored, to be polled: background needs store true")
        return background

    @pydantic.field_validator("context_management")
    @classmethod
    def _in_the_foreground(cls, entries: Optional[list[Compaction]],
                           info: pydantic.ValidationInfo) -> Optional[list[Compaction]]:
        if entries and info.data.get("background"):
            raise ValueError("a background response is not compacted here: compact with POST /v1/responses/compact "
                             "first, or send it in the foreground")
        return entries

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "ResponsesRequest":
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools")
        return self

    def compact_threshold(self, context: int) -> Optional[int]:
        """The prompt tokens past which this request is compacted; None if it asks for no compaction."""
        if not self.context_management:
            return None
        given = self.context_management[0].compact_threshold
        return given if given is not None else int(context * DEFAULT_COMPACT_SHARE)

    def generation_request(self, conversation: list[dict], served: tuple[dict, ...] = ()) -> GenerationRequest:
        """What the body asks for, ``conversation`` (the previous response's and this input) as the prompt, and
        ``served`` (the functions of its mcp tools, as chat templates take them) offered with its own."""
        effort = self.reasoning.effort if self.reasoning else None
        messages = self.instruction_messages() + conversation
        given, breaks = self._input()
        before = len(messages) - len(given)  # the instructions and the previous responses' messages
        return GenerationRequest(
            self.model, prompt_param="input", messages=messages, cache_breaks=tuple(before + b for b in breaks),
            tools=self._tool_use(served), reply_format=self.text.reply_format() if self.text else None,
            thinking=None if effort is None else effort not in ("none", "minimal"),
            template_vars=template_variables(effort), truncate=self.truncation == "auto",
            not_offered=tuple(t.label for t in self.tools or () if isinstance(t, HostedTool)),
            sampling=SamplingParams(temperature=self.temperature, top_p=self.top_p),
            sampling_defaulted=left_out(self, {"temperature": "temperature", "top_p": "top_p"}),
            max_tokens=self.max_output_tokens, max_tokens_param="max_output_tokens", top_logprobs=self._logprobs(),
            cache_key=self.prompt_cache_key, media=self.media(conversation),
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

    def _tool_use(self, served: tuple[dict, ...]) -> Optional[ToolUse]:
        functions = self.functions()
        if not functions and not served:
            return None
        choice = self.tool_choice
        allowed = choice if isinstance(choice, AllowedToolsChoice) else None
        return ToolUse(
            tuple(template_tool(t.name, t.description, t.parameters) for t in functions) + served,
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

