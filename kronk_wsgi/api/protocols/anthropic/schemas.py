"""The Messages API's request bodies: content blocks, tools, tool choice, thinking, output format and context
edits, and the GenerationRequest a message asks for."""

import base64
import re
from typing import Annotated, Any, Literal, Optional, Union

import pydantic
from pydantic import Discriminator, Field, Tag

from ....engine.sampling import SamplingParams
from ...compaction import summary_message
from ...planning import GenerationRequest, ReplyFormat, ToolUse
from ...media import MediaInput, decode_base64, inputs, joined, media_url
from ...schemas import (FunctionName, MediaPart, Strict, left_out, media_parts, part_texts, template_tool,
                        template_tool_call, template_variables)


class CacheControl(Strict):
    """A breakpoint: the prompt cache saves the prefix that ends here (with the llama.cpp engine). Entries are
    kept by the cache's own budgets, whatever the ``ttl``."""

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None
    citations: Optional[list[dict[str, Any]]] = None  # an earlier answer's sources, as clients hand it back


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: FunctionName
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ImageBase64Source(Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class ImageUrlSource(Strict):
    type: Literal["url"]
    url: str  # a base64 data URL, or a URL the media_allow setting allows


class FileSource(Strict):
    type: Literal["file"]
    file_id: str

    @pydantic.model_validator(mode="after")
    def _refuse(self) -> "FileSource":
        raise ValueError("there is no Files API here: send the image itself (source type base64)")


class ImageBlock(MediaPart):
    type: Literal["image"]
    source: Annotated[Union[ImageBase64Source, ImageUrlSource, FileSource], Field(discriminator="type")]
    cache_control: Optional[CacheControl] = None

    @pydantic.model_validator(mode="after")
    def _read(self) -> "ImageBlock":
        source = self.source
        self._data = decode_base64(source.data) if isinstance(source, ImageBase64Source) \
            else media_url(source.url, self)
        return self


class ToolAnswer(Strict):
    """A tool's answer to a call: its text (with its images), or its error."""

    tool_use_id: str
    content: Union[str, list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]]] = ""
    is_error: bool = False
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else joined(part_texts(self.content))
        return f"Error: {text}" if self.is_error else text


class ToolResultBlock(ToolAnswer):
    type: Literal["tool_result"]


class McpToolUseBlock(Strict):
    """An earlier turn's call of a connector's tool, which this server ran: the call, in the assistant's turn."""

    type: Literal["mcp_tool_use"]
    id: str
    name: FunctionName
    server_name: str
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class McpToolResultBlock(ToolAnswer):
    """That call's result, in the same assistant turn: the tool's answer."""

    type: Literal["mcp_tool_result"]


class CompactionBlock(Strict):
    """A summary of the conversation before it (an earlier compaction's): what came before it is left out of the
    prompt, and the summary stands in its place. With no content (a compaction that failed), nothing is left out."""

    type: Literal["compaction"]
    content: Optional[Annotated[str, Field(min_length=1)]] = None
    encrypted_content: Optional[str] = None  # nothing of this server's: accepted, as clients send blocks back
    signature: Optional[str] = None
    tool_changes: Optional[list[dict[str, Any]]] = None
    cache_control: Optional[CacheControl] = None


class ThinkingBlock(Strict):
    """An earlier turn's thinking: accepted, and left out of the prompt, as Anthropic's API does."""

    type: Literal["thinking"]
    thinking: str
    signature: str
    cache_control: Optional[CacheControl] = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


class PlainTextSource(Strict):
    type: Literal["text"]
    media_type: Literal["text/plain"] = "text/plain"
    data: str


class Base64Source(Strict):
    type: Literal["base64"]
    media_type: str
    data: str

    @pydantic.field_validator("media_type")
    @classmethod
    def _text_only(cls, media_type: str) -> str:
        if not media_type.startswith("text/"):
            raise ValueError(f"{media_type} documents cannot be read here: this server's models take text only")
        return media_type


class ContentSource(Strict):
    type: Literal["content"]
    content: Union[str, list[TextBlock]]


class DocumentBlock(Strict):
    """A document the model reads as text: plain text, base64 text, or text blocks (PDF and images are refused)."""

    type: Literal["document"]
    source: Annotated[Union[PlainTextSource, Base64Source, ContentSource], Field(discriminator="type")]
    title: Optional[str] = None
    context: Optional[str] = None
    citations: Optional[dict[str, Any]] = None  # accepted; answers here carry no citations
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        source = self.source
        if isinstance(source, Base64Source):
            try:
                body = base64.b64decode(source.data, validate=True).decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                raise ValueError("source.data is not base64 of UTF-8 text") from None
        elif isinstance(source, ContentSource):
            body = source.content if isinstance(source.content, str) else "".join(b.text for b in source.content)
        else:
            body = source.data
        head = "".join(f"{line}\n" for line in (self.title and f"Document: {self.title}", self.context) if line)
        return f"{head}{body}\n"


Block = Annotated[
    Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock, DocumentBlock,
          McpToolUseBlock, McpToolResultBlock, CompactionBlock],
    Field(discriminator="type"),
]


class Message(Strict):
    # "system" inside messages, as Claude Code sends it: rendered where it stands
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]

    def for_template(self) -> list[dict]:
        """Template messages: text and tool uses in one, each tool result (and each result of a tool this server
        ran, within the assistant's turn) in a message of its own."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        out: list[dict] = []
        text: list[Union[str, bytes]] = []  # texts, and images as their bytes
        calls: list[dict] = []

        def flush() -> None:
            if text or calls:
                message: dict[str, Any] = {"role": self.role, "content": joined(text)}
                if calls:
                    message["tool_calls"] = list(calls)
                out.append(message)
            text.clear()
            calls.clear()

        for block in self.content:
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ImageBlock):
                text.append(block.data)
            elif isinstance(block, DocumentBlock):
                text.append(block.text())
            elif isinstance(block, (ToolUseBlock, McpToolUseBlock)):
                calls.append(template_tool_call(block.id, block.name, block.input))
            elif isinstance(block, ToolAnswer):
                flush()
                out.append({"role": "tool", "content": block.text(), "tool_call_id": block.tool_use_id})
            elif isinstance(block, CompactionBlock) and block.content is not None:
                out.clear()  # what came before it is in the summary
                text.clear()
                calls.clear()
                out.append(summary_message(block.content))
        flush()
        return out

    def media(self, index: int) -> list[MediaInput]:
        """The images of the message (the ``index``-th), those of its tool results included."""
        found = []
        for place, block in enumerate(self.content if isinstance(self.content, list) else ()):
            where = f"messages[{index}].content[{place}]"
            if isinstance(block, ImageBlock):
                found.append(MediaInput(block.data, where))
            elif isinstance(block, ToolAnswer):
                found += [MediaInput(image.data, f"{where}.content[{inner}]")
                          for inner, image in media_parts(block.content)]
        return found

    def compacts(self) -> bool:
        """Whether the message has a summary of the conversation before it."""
        return isinstance(self.content, list) and any(isinstance(b, CompactionBlock) and b.content is not None
                                                      for b in self.content)

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "Message":
        for block in self.content if isinstance(self.content, list) else ():
            if isinstance(block, ToolUseBlock) and self.role != "assistant":
                raise ValueError("tool_use blocks belong in assistant messages")
            if isinstance(block, (McpToolUseBlock, McpToolResultBlock, CompactionBlock)) and self.role != "assistant":
                raise ValueError(f"{block.type} blocks belong in assistant messages")
            if isinstance(block, ToolResultBlock) and self.role != "user":
                raise ValueError("tool_result blocks belong in user messages")
            if isinstance(block, ImageBlock) and self.role != "user":
                raise ValueError("image blocks belong in user messages")
            if isinstance(block, (ThinkingBlock, RedactedThinkingBlock)) and self.role != "assistant":
                raise ValueError("thinking blocks belong in assistant messages")
            if isinstance(block, DocumentBlock):
                block.text()  # a document that cannot be read is a 400 naming it
        return self


class Tool(Strict):
    name: FunctionName
    description: Optional[str] = None
    input_schema: dict[str, Any]
    strict: bool = False
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None
    # Loaded on demand through a tool search: this server has none, so the tool is offered like the others.
    defer_loading: Optional[bool] = None
    input_examples: Optional[list[dict[str, Any]]] = None  # accepted; not shown to the model
    allowed_callers: Optional[list[str]] = None  # accepted: the model is the only caller here


class ServerTool(pydantic.BaseModel):
    """A tool Anthropic runs or defines (web search, code execution, ...): accepted, and not offered to the model,
    which could not use it here; the response names it (``Kronk-Tools-Not-Offered``)."""

    model_config = pydantic.ConfigDict(extra="allow")
    type: Annotated[str, Field(pattern=r"^[a-z_]+_[0-9]{8}$")]
    name: str


class McpToolConfig(Strict):
    enabled: Optional[bool] = None
    defer_loading: Optional[bool] = None  # the tools are offered at once: there is no tool search here


class McpToolset(Strict):
    """The tools of one of the request's mcp_servers, offered to the model and run by this server: all of them,
    or as ``default_config`` and each tool's ``configs`` enable them."""

    type: Literal["mcp_toolset"]
    mcp_server_name: str
    default_config: Optional[McpToolConfig] = None
    configs: Optional[dict[str, McpToolConfig]] = None
    cache_control: Optional[CacheControl] = None

    def enabled(self, name: str) -> bool:
        own = (self.configs or {}).get(name)
        for config in (own, self.default_config):
            if config is not None and config.enabled is not None:
                return config.enabled
        return True


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "custom" if kind in (None, "custom") else "mcp" if kind == "mcp_toolset" else "server"


AnyTool = Annotated[Union[Annotated[Tool, Tag("custom")], Annotated[McpToolset, Tag("mcp")],
                          Annotated[ServerTool, Tag("server")]], Discriminator(_tool_kind)]


class McpToolConfiguration(Strict):
    """The older connector's choice of a server's tools (with no mcp_toolset naming the server)."""

    enabled: Optional[bool] = None
    allowed_tools: Optional[list[str]] = None


class McpServerDefinition(Strict):
    """An MCP server whose tools this server runs for the request: a streamable HTTP ``url`` the mcp_allow
    setting allows, reached with ``authorization_token`` as a bearer token."""

    type: Literal["url"]
    url: str
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    authorization_token: Optional[str] = None
    tool_configuration: Optional[McpToolConfiguration] = None

    def headers(self) -> dict[str, str]:
        return {} if self.authorization_token is None else {"Authorization": f"Bearer {self.authorization_token}"}


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone], Field(discriminator="type")]


class Metadata(Strict):
    user_id: Optional[str] = None


# How thinking blocks come back: "omitted" leaves their text empty (the signature stays); the others give it whole
# (this server has no summaries).
ThinkingDisplay = Literal["summarized", "omitted", "updates"]


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1024)]
    display: Optional[ThinkingDisplay] = None


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


class ThinkingAdaptive(Strict):
    """Thinking on, as much as the model decides: no budget."""

    type: Literal["adaptive"]
    display: Optional[ThinkingDisplay] = None


Thinking = Annotated[Union[ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive], Field(discriminator="type")]


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    """``format`` constrains the reply to JSON valid against its schema; ``effort`` reaches the chat template as
    its ``reasoning_effort`` (``max`` as ``high``), which templates such as gpt-oss's read."""

    effort: Optional[Literal["low", "medium", "high", "max"]] = None
    format: Optional[JsonOutputFormat] = None


class Count(Strict):
    """A count in a context-management edit: of input tokens, tool uses or thinking turns."""

    type: Literal["input_tokens", "tool_uses", "thinking_turns"]
    value: Annotated[int, Field(ge=0, strict=True)]


class ContextEdit(Strict):
    """A context-management edit, applied to the prompt: see context_editing.py (and, for compact_20260112, a
    summary the model writes: see views.py)."""

    type: Literal["clear_tool_uses_20250919", "clear_thinking_20251015", "compact_20260112"]
    trigger: Optional[Count] = None
    instructions: Optional[str] = None  # compact's: more to tell the model when it writes its summary
    pause_after_compaction: Optional[bool] = None  # compact's: the message ends with the summary
    keep: Union[Count, Literal["all"], None] = None
    clear_at_least: Optional[Count] = None
    exclude_tools: Optional[list[str]] = None
    clear_tool_inputs: Union[bool, list[str], None] = None  # every cleared use's input, or those of these tools

    @pydantic.model_validator(mode="after")
    def _counts(self) -> "ContextEdit":
        clears_tools, compacts = self.type.startswith("clear_tool_uses"), self.type.startswith("compact")
        allowed = {"trigger": ("input_tokens", "tool_uses") if clears_tools else ("input_tokens",) if compacts else (),
                   "keep": ("tool_uses",) if clears_tools else () if compacts else ("thinking_turns",),
                   "clear_at_least": ("input_tokens",) if clears_tools else ()}
        for name, types in allowed.items():
            value = getattr(self, name)
            if value is not None and value != "all" and value.type not in types:
                raise ValueError(f"{self.type}: {name} takes {' or '.join(types) or 'nothing'}, not {value.type}")
        if self.keep == "all" and clears_tools:
            raise ValueError(f"{self.type}: keep takes a count of tool_uses")
        if not clears_tools and (self.exclude_tools is not None or self.clear_tool_inputs is not None):
            raise ValueError(f"{self.type}: exclude_tools and clear_tool_inputs are clear_tool_uses'")
        if not compacts and (self.instructions is not None or self.pause_after_compaction is not None):
            raise ValueError(f"{self.type}: instructions and pause_after_compaction are compact_20260112's")
        if compacts and self.keep is not None:
            raise ValueError(f"{self.type} keeps nothing but its summary: keep is the clearing strategies'")
        return self


class DiagnosticsRequest(Strict):
    previous_message_id: Optional[str] = None  # the message to compare this request's prompt with


class ContextManagement(Strict):
    edits: list[ContextEdit] = []


# Claude Code's first system block: billing metadata for Anthropic, with a part that changes on every request.
# Rendered first, it would make every prompt differ from the last after a few tokens, and the prompt cache find
# nothing; it tells the model nothing, so it is left out of the prompt.
BILLING_HEADER = re.compile(r"\Ax-anthropic-billing-header:[^\n]*\n?")


class CountTokensRequest(Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[AnyTool]] = None
    tool_choice: Optional[ToolChoice] = None
    mcp_servers: Optional[list[McpServerDefinition]] = None  # see api/protocols/anthropic/connector.py
    _served: tuple[dict, ...] = pydantic.PrivateAttr(default=())
    # Switches thinking on or off where the model's chat template can (``enable_thinking``);
    # budget_tokens closes the thinking where the template opens it in the prompt.
    thinking: Optional[Thinking] = None
    context_management: Optional[ContextManagement] = None
    cache_control: Optional[CacheControl] = None  # the whole prompt is a breakpoint: see MessagesRequest.cache_breaks
    output_config: Optional[OutputConfig] = None
    speed: Optional[Literal["standard", "fast"]] = None  # one speed here: the model's
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "CountTokensRequest":
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools")
        names = [server.name for server in self.mcp_servers or ()]
        if len(set(names)) < len(names):
            raise ValueError("mcp_servers: two servers have one name")
        for toolset in self.toolsets():
            if toolset.mcp_server_name not in names:
                raise ValueError(f"an mcp_toolset names {toolset.mcp_server_name!r}, which is not among mcp_servers")
        return self

    def toolsets(self) -> list[McpToolset]:
        return [t for t in self.tools or () if isinstance(t, McpToolset)]

    def template_messages(self) -> list[dict]:
        """The conversation as chat templates take it (before any context-management edit)."""
        return self._template()[0]

    def _template(self) -> tuple[list[dict], list[int]]:
        """The conversation as chat templates take it, and how many of its messages run through the end of each
        of the request's messages. Earlier turns' thinking never enters the prompt."""
        messages, ends = [], []
        if self.system is not None:
            blocks = [self.system] if isinstance(self.system, str) else [b.text for b in self.system]
            system = "".join(BILLING_HEADER.sub("", text) for text in blocks)
            if system or not any(BILLING_HEADER.match(text) for text in blocks):  # a system prompt of its own
                messages.append({"role": "system", "content": system})
        start = max((i for i, m in enumerate(self.messages) if m.compacts()), default=0)
        for index, message in enumerate(self.messages):
            if index >= start:  # the last summary stands for the messages before it
                messages.extend(message.for_template())
            ends.append(len(messages))
        return messages, ends

    def media(self) -> dict[str, MediaInput]:
        """The images the messages hold (see GenerationRequest.media)."""
        return inputs(given for index, message in enumerate(self.messages) for given in message.media(index))

    def thinking_turns(self) -> int:
        """The assistant messages with thinking blocks."""
        return sum(1 for m in self.messages if m.role == "assistant" and isinstance(m.content, list)
                   and any(isinstance(b, (ThinkingBlock, RedactedThinkingBlock)) for b in m.content))

    def offered_tools(self) -> list[Tool]:
        return [t for t in self.tools or () if isinstance(t, Tool)]

    def not_offered(self) -> tuple[str, ...]:
        """The tools this server cannot run, by name."""
        return tuple(t.name for t in self.tools or () if isinstance(t, ServerTool))

    def serve(self, functions: tuple[dict, ...]) -> None:
        """Offer the functions of the request's mcp servers (listed: see connector.py) with its own tools."""
        self._served = functions

    def template_tools(self) -> Optional[list[dict]]:
        offered = [template_tool(t.name, t.description, t.input_schema) for t in self.offered_tools()]
        offered += self._served
        return offered or None

    def effort(self) -> Optional[str]:
        effort = self.output_config.effort if self.output_config else None
        return "high" if effort == "max" else effort

    def thinking_switch(self) -> Optional[bool]:
        return None if self.thinking is None else not isinstance(self.thinking, ThinkingDisabled)

    def tool_use(self) -> Optional[ToolUse]:
        functions = self.template_tools()
        if not functions:
            return None
        choice = self.tool_choice
        return ToolUse(
            tuple(functions), strict=frozenset(t.name for t in self.offered_tools() if t.strict),
            choice={None: "auto", "auto": "auto", "none": "none"}.get(choice and choice.type, "required"),
            name=choice.name if isinstance(choice, ToolChoiceTool) else None,
            max_calls=1 if getattr(choice, "disable_parallel_tool_use", False) else None,
        )


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Optional[list[str]] = None
    temperature: Annotated[float, Field(ge=0, le=1)] = 1.0
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None  # one tier here: both are met
    inference_geo: Optional[str] = None  # inference happens on this machine
    diagnostics: Optional[DiagnosticsRequest] = None  # see api/cache_diagnostics.py
    # For Anthropic's code execution tool, which is not offered here (see ServerTool): no container is made.
    container: Union[str, dict[str, Any], None] = None
    stream: bool = False

    @pydantic.model_validator(mode="after")
    def _budget(self) -> "MessagesRequest":
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    def generation_request(self, edited: Optional[list[dict]] = None) -> GenerationRequest:
        """What the body asks for, as the planner takes it (its template messages ``edited`` by context
        management, if they were). A final assistant message is continued (a prefill)."""
        messages, ends = self._template()
        messages = edited if edited is not None else messages
        output_format = self.output_config.format if self.output_config else None
        return GenerationRequest(
            self.model, prompt_param="messages", messages=messages, tools=self.tool_use(),
            continue_final=messages[-1]["role"] == "assistant",
            reply_format=ReplyFormat(output_format.schema_, strict=True, param="output_config.format")
            if output_format else None,
            thinking=self.thinking_switch(), template_vars=template_variables(self.effort()),
            thinking_budget=self.thinking.budget_tokens if isinstance(self.thinking, ThinkingEnabled) else None,
            sampling=SamplingParams(temperature=self.temperature, top_p=self.top_p or 1.0, top_k=self.top_k or 0),
            sampling_defaulted=left_out(self, {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}),
            stop=tuple(self.stop_sequences or ()), max_tokens=self.max_tokens, not_offered=self.not_offered(),
            cache_breaks=self.cache_breaks(ends, int(messages[0]["role"] == "system")),
            media=self.media(),
        )

    def cache_breaks(self, ends: list[int], head: int) -> tuple[int, ...]:
        """The cache_control breakpoints, as how many template messages the cached prefix runs through (``ends``:
        how many run through each message's end; ``head``: the system messages before the first): the tools and
        system (a tool's or a system block's), a
        message's end (one of its blocks'), and the whole prompt (the request's own, Anthropic's automatic
        caching)."""
        system = self.system if isinstance(self.system, list) else []
        breaks = [head] if any(getattr(b, "cache_control", None) for b in [*(self.tools or ()), *system]) else []
        for message, end in zip(self.messages, ends):
            if isinstance(message.content, list) and any(getattr(b, "cache_control", None) for b in message.content):
                breaks.append(end)
        if self.cache_control is not None:
            breaks.append(ends[-1])
        return tuple(breaks)
