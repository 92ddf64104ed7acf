"""Request bodies, validated strictly: wrong types and unknown fields are 400s, never guesses."""

import json
from typing import Annotated, Any, Literal, Mapping, Optional, Sequence, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import SamplingParams
from ..serving.formats import custom_arguments
from .errors import invalid
from .media import MediaInput, decode_base64, inputs, joined, media_url
from .planning import (
    JSON_OBJECT, MAX_CHOICES, MAX_PATTERN_LENGTH, Ending, GenerationRequest, ReplyFormat, ToolUse,
)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class PromptCacheBreakpoint(Strict):
    """The end of a prefix worth keeping (OpenAI's explicit breakpoint): a hint to the prompt cache, which saves
    the conversation's prefix through the end of this part's message. The budgets decide how long it stays."""

    mode: Literal["explicit"]
    ttl: Optional[Literal["30m", "12h"]] = None


class PromptCacheOptions(Strict):
    """Accepted: the prompt cache saves what its hints and its own rules say, whatever the mode (docs/MODELS.rst)."""

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Optional[Literal["30m", "12h"]] = None


# Fields the APIs define that this server cannot honour: each a 400 naming it, for this reason.
CANNOT = {
    "audio": "audio output cannot be made here: this server's models write text",
    "moderation": "moderation cannot be run here: this server has no moderation model",
    "conversation": "there is no Conversations API here: continue a conversation with previous_response_id",
    "prompt": "there are no stored prompt templates here: send the instructions and input themselves",
}


def refuse_given(value: Any, info: pydantic.ValidationInfo) -> Any:
    """A field validator for the CANNOT fields: any value is a 400 naming the field, with the reason."""
    if value is not None:
        raise ValueError(CANNOT[info.field_name])
    return value


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: Optional[PromptCacheBreakpoint] = None


class ImageUrl(Strict):
    url: str  # a base64 data URL, or base64 alone (as llama-server takes it), or a URL media_allow allows
    detail: Optional[Literal["auto", "low", "high"]] = None  # the projector reads an image at its own resolution


class MediaPart(Strict):
    """A content part that carries an image or a sound: ``data`` is its file's bytes, read from the part."""

    _data: bytes = pydantic.PrivateAttr(b"")

    @property
    def data(self) -> bytes:
        return self._data


class ImagePart(MediaPart):
    type: Literal["image_url"]
    image_url: ImageUrl

    @pydantic.model_validator(mode="after")
    def _read(self) -> "ImagePart":
        url = self.image_url.url
        self._data = media_url(url, self) if url.startswith("data:") or "://" in url else decode_base64(url)
        return self


class InputAudio(Strict):
    data: str  # base64
    format: Literal["wav", "mp3"]  # the file's bytes tell their format: this names it


class AudioPart(MediaPart):
    type: Literal["input_audio"]
    input_audio: InputAudio

    @pydantic.model_validator(mode="after")
    def _read(self) -> "AudioPart":
        self._data = decode_base64(self.input_audio.data)
        return self


class FileData(Strict):
    file_data: Optional[str] = None
    file_id: Optional[str] = None
    filename: Optional[str] = None


class FilePart(Strict):
    """Refused: a file (a PDF) is read by no model here; its text, or its pages as images, can be."""

    type: Literal["file"]
    file: FileData

    @pydantic.model_validator(mode="after")
    def _refuse(self) -> "FilePart":
        raise ValueError("file parts cannot be read here: send the file's text, or its pages as images")


UserPart = Annotated[Union[TextPart, ImagePart, AudioPart, FilePart], Field(discriminator="type")]


def part_texts(parts: Sequence[Any]) -> list[Union[str, bytes]]:
    """Content parts as ``media.joined`` takes them: each medium's bytes, each other part's text."""
    return [part.data if isinstance(part, MediaPart) else part.text for part in parts]


def media_parts(content: Union[str, Sequence[Any], None]) -> list[tuple[int, MediaPart]]:
    """The parts of a message's content (a list of parts; a string has none) that carry an image or a sound,
    with their places."""
    return [(i, part) for i, part in enumerate(content) if isinstance(part, MediaPart)] \
        if isinstance(content, list) else []


def message_text(parts: Sequence[Union[TextPart, MediaPart]]) -> str:
    """A message's content parts as one text for its template (see media.joined)."""
    return joined(part_texts(parts))


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]

# OpenAI's limits: 16 pairs, keys of at most 64 characters, values of at most 512.
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]
User = Annotated[str, Field(max_length=512)]


def json_object(text: str, what: str) -> dict[str, Any]:
    """A JSON object given as text (tool-call arguments); ValueError otherwise."""
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"{what} must be a JSON object, given as a string") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, given as a string")
    return value


def template_role(role: str) -> str:
    """OpenAI's "developer" role is what chat templates call "system"."""
    return "system" if role == "developer" else role


def template_tool(name: str, description: Optional[str], parameters: Optional[dict]) -> dict:
    """A tool as chat templates take it (the Hugging Face convention), its keys in the order clients send them and
    llama-server renders them, a missing description empty (templates such as gpt-oss's read it)."""
    return {"type": "function", "function": {
        "name": name, "description": description or "",
        "parameters": parameters or {"type": "object", "properties": {}}}}


def template_tool_call(call_id: str, name: str, arguments: dict) -> dict:
    """A past tool call as chat templates take it: arguments as an object, not text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class FunctionDefinition(Strict):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class CustomTextFormat(Strict):
    type: Literal["text"]


class CustomGrammarFormat(Strict):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: Annotated[str, Field(max_length=MAX_PATTERN_LENGTH)]


class CustomToolSpec(Strict):
    """A tool whose input is free-form text, not JSON (OpenAI's custom tools): offered to the model as a function
    of one string, ``input``. A regex grammar constrains that string as a strict function's schema does; a Lark
    grammar constrains the input of a call written in the raw form (see serving/tool_calls.py), which the model
    is told of in the tool's description."""

    name: FunctionName
    description: Optional[str] = None
    format: Optional[Annotated[Union[CustomTextFormat, CustomGrammarFormat], Field(discriminator="type")]] = None

    @property
    def lark(self) -> Optional[str]:
        """Its input's Lark grammar, if it has one."""
        grammar = self.format
        return grammar.definition if isinstance(grammar, CustomGrammarFormat) and grammar.syntax == "lark" else None

    def parameters(self) -> dict:
        """The schema of the function it is offered as."""
        text: dict[str, Any] = {"type": "string", "description": "the tool's input, as free-form text"}
        if self.lark is not None:
            text["description"] = (f'the tool\'s input, in this Lark grammar:\n{self.lark}\nCall it as '
                                   f'{{"name": "{self.name}"}} on a line of its own, then the input as it is.')
        elif isinstance(self.format, CustomGrammarFormat):
            text["pattern"] = f"^(?:{self.format.definition})$"
        return {"type": "object", "properties": {"input": text}, "required": ["input"], "additionalProperties": False}


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCustomTool(Strict):
    type: Literal["custom"]
    custom: CustomToolSpec


class FunctionCall(Strict):
    name: FunctionName
    arguments: str


class ChatToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class CustomCall(Strict):
    name: FunctionName
    input: str


class ChatCustomToolCall(Strict):
    id: str
    type: Literal["custom"]
    custom: CustomCall


class ChatMessage(Strict):
    # "function": a legacy function's result, as "tool" is a tool's
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[UserPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[Annotated[Union[ChatToolCall, ChatCustomToolCall], Field(discriminator="type")]]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None  # an earlier answer's refusal: it goes into the prompt as its text
    function_call: Optional[FunctionCall] = None  # an earlier answer's legacy function call
    # An earlier answer's thinking, as this server (and llama-server, DeepSeek's API) writes it: the chat
    # template has it as the message's reasoning_content (and thinking, gpt-oss's name) to render or leave out.
    reasoning_content: Optional[str] = None

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("tool messages, and only they, need tool_call_id")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError("content is required, except on assistant messages with tool_calls")
        if self.function_call is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry a function_call")
        if self.role == "function" and self.name is None:
            raise ValueError("function messages need the name of the function")
        if self.function_call is not None:
            json_object(self.function_call.arguments, "function_call.arguments")
        for call in self.tool_calls or ():
            if isinstance(call, ChatToolCall):
                json_object(call.function.arguments, "tool_calls[].function.arguments")
        if self.refusal is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry a refusal")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.role != "user" and self.media():
            raise ValueError("only user messages carry images and sounds")
        return self

    def media(self) -> list[tuple[int, MediaPart]]:
        """The content parts that carry an image or a sound, with their places."""
        return media_parts(self.content)

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        return self.content if isinstance(self.content, str) else message_text(self.content)

    def for_template(self) -> dict:
        """The message as chat templates take it; a legacy function call and its result are a tool call and its
        result, paired by the function's name."""
        if self.role == "function":
            return {"role": "tool", "content": self.text(), "tool_call_id": "call_" + self.name, "name": self.name}
        message: dict[str, Any] = {"role": template_role(self.role), "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                template_tool_call(c.id, c.function.name, json.loads(c.function.arguments))
                if isinstance(c, ChatToolCall) else template_tool_call(c.id, c.custom.name,
                                                                       custom_arguments(c.custom.input))
                for c in self.tool_calls
            ]
        if self.function_call is not None:
            call = self.function_call
            message["tool_calls"] = [template_tool_call("call_" + call.name, call.name, json.loads(call.arguments))]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        return message


def chat_media(messages: Sequence[ChatMessage]) -> dict[str, MediaInput]:
    """The images and sounds of chat messages (see GenerationRequest.media)."""
    return inputs(MediaInput(part.data, f"messages[{i}].content[{j}]")
                  for i, message in enumerate(messages) for j, part in message.media())


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class NamedCustomToolChoice(Strict):
    type: Literal["custom"]
    custom: NamedFunction


class AllowedTools(Strict):
    mode: Literal["auto", "required"]
    tools: list[Annotated[Union[NamedToolChoice, NamedCustomToolChoice], Field(discriminator="type")]]


class AllowedToolsChoice(Strict):
    """The tools the model may call, of those offered (which the prompt shows all of)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class StreamOptions(Strict):
    include_usage: bool = False


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")


def left_out(body: BaseModel, fields: Mapping[str, str]) -> frozenset[str]:
    """The sampling parameters whose fields (``fields``: the body's name of each, then the parameter's) the body
    left out or sent as null: the model's defaults take their place."""
    return frozenset(param for name, param in fields.items()
                     if name not in body.model_fields_set or getattr(body, name) is None)


class SamplingFields(Strict):
    """Sampling fields shared by the OpenAI endpoints; top_k, min_p and repetition_penalty are extensions."""

    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    seed: Optional[int] = None
    stop: Union[str, Annotated[list[str], Field(max_length=4)], None] = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    user: Optional[User] = None
    # The SGLang gateway's own fields, which it writes into every body it routes: taken at their defaults,
    # ignore_eos honoured, and any other value that would change the answer refused by name.
    ignore_eos: bool = False
    no_stop_trim: Literal[False] = False
    skip_special_tokens: Literal[True] = True
    separate_reasoning: Literal[True] = True
    stream_reasoning: Literal[True] = True
    return_hidden_states: Literal[False] = False

    def sampling(self) -> SamplingParams:
        """The sampling fields; a logit bias's token ids are checked against the model's vocabulary when planned."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²" and "٣" are digits to str.isdigit, not token ids
                raise invalid(f"logit_bias: {key!r} is not a token id", param="logit_bias")
            bias.append((int(key), value))
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=tuple(bias), seed=self.seed,
        )

    def sampling_defaulted(self) -> frozenset[str]:
        return left_out(self, {name: name for name in SAMPLING_FIELDS})

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


# Every reasoning_effort OpenAI defines: none and minimal switch thinking off, the others on.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

def template_variables(effort: Optional[str], given: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The chat template's variables a request sets: its reasoning effort, then the ones it names itself."""
    variables = {**({"reasoning_effort": effort} if effort is not None else {}), **(given or {})}
    return variables or None


# OpenAI's service tiers: this server has one, and it meets every one of them.
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class Prediction(Strict):
    """Predicted output: it only speeds answers up where it is used, so it changes nothing here."""

    type: Literal["content"]
    content: Union[str, list[TextPart]]


class TextResponseFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


SchemaName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class JsonSchemaSpec(Strict):
    name: SchemaName
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def grammar_fields(grammar: Optional[str], json_schema: Optional[dict]) -> Optional[ReplyFormat]:
    """llama-server's ``grammar`` (GBNF) and ``json_schema`` fields as a reply format."""
    if grammar is not None:
        return ReplyFormat(None, strict=True, param="grammar", gbnf=grammar)
    if json_schema is not None:
        return ReplyFormat(json_schema, strict=False, param="json_schema")
    return None


def reply_format(spec: Union[TextResponseFormat, JsonObjectFormat, JsonSchemaFormat, None], param: str,
                 ) -> Optional[ReplyFormat]:
    """What a response format asks of the reply: JSON, valid against a schema; None for text."""
    if isinstance(spec, JsonObjectFormat):
        return ReplyFormat(JSON_OBJECT, strict=False, param=param)
    if isinstance(spec, JsonSchemaFormat):
        return ReplyFormat(spec.json_schema.schema_ or JSON_OBJECT, bool(spec.json_schema.strict), param)
    return None


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Optional[list[Annotated[Union[ChatTool, ChatCustomTool], Field(discriminator="type")]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], Annotated[
        Union[NamedToolChoice, NamedCustomToolChoice, AllowedToolsChoice], Field(discriminator="type")], None] = None
    parallel_tool_calls: Optional[bool] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    # Accepted as OpenAI's clients send them; none changes the answer.
    store: Optional[bool] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[ServiceTier] = None
    modalities: Optional[list[Literal["text"]]] = None
    prediction: Optional[Prediction] = None
    response_format: Optional[Annotated[
        Union[TextResponseFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]] = None
    # Switches thinking on or off where the model's chat template can (``enable_thinking``), and reaches the
    # template as ``reasoning_effort`` (gpt-oss's); chat_template_kwargs are more variables for the template, as
    # vLLM and llama-server take them.
    reasoning_effort: Optional[ReasoningEffort] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    # Accepted as today's clients send them: see docs/PROTOCOLS.rst for what each does here.
    verbosity: Optional[Literal["low", "medium", "high"]] = None
    prompt_cache_key: Optional[Annotated[str, Field(max_length=1024)]] = None
    safety_identifier: Optional[Annotated[str, Field(max_length=512)]] = None
    web_search_options: Optional[dict[str, Any]] = None  # a hosted tool this server cannot run: not offered
    prompt_cache_options: Optional[PromptCacheOptions] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None  # the prompt cache's budgets decide
    # OpenAI's legacy function calling: the functions are offered as tools, and a call comes back as the
    # message's function_call (finish_reason function_call)
    functions: Optional[Annotated[list[FunctionDefinition], Field(min_length=1)]] = None
    function_call: Union[Literal["none", "auto"], NamedFunction, None] = None
    audio: Optional[dict[str, Any]] = None  # refused: see CANNOT
    moderation: Optional[dict[str, Any]] = None  # refused: see CANNOT
    # llama-server's and vLLM's extensions, which clients written for them send
    grammar: Optional[str] = None  # GBNF
    json_schema: Optional[dict[str, Any]] = None
    # "none": the thinking stays in the answer's text, as the model wrote it; "auto" and "deepseek" (the default):
    # it is read apart, into reasoning_content
    reasoning_format: Optional[Literal["none", "auto", "deepseek"]] = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    _refused = pydantic.field_validator("audio", "moderation")(refuse_given)

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "ChatCompletionRequest":
        if self.store:
            raise ValueError("store must be false: this server keeps no chat completions")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.functions is not None and self.tools is not None:
            raise ValueError("give tools or the legacy functions, not both")
        if self.function_call is not None and not self.functions:
            raise ValueError("function_call needs functions")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if sum(x is not None for x in (self.grammar, self.json_schema, reply_format(self.response_format, ""))) > 1:
            raise ValueError("give one of response_format (json), json_schema and grammar")
        if (self.continue_final_message or not self.add_generation_prompt) and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message to continue")
        return self

    def generation_request(self) -> GenerationRequest:
        """What the body asks for, as the planner takes it."""
        return GenerationRequest(
            self.model, prompt_param="messages", messages=[m.for_template() for m in self.messages], n=self.n,
            tools=self._tool_use(), reply_format=self._reply_format(),
            continue_final=self.continue_final_message or not self.add_generation_prompt,
            thinking=self._thinking(), template_vars=template_variables(self.reasoning_effort, self.chat_template_kwargs),
            reasoning_apart=self.reasoning_format != "none",
            sampling=self.sampling(), sampling_defaulted=self.sampling_defaulted(), stop=self.stop_sequences(),
            max_tokens=self.max_completion_tokens or self.max_tokens,
            max_tokens_param="max_completion_tokens" if self.max_completion_tokens else "max_tokens",
            top_logprobs=(self.top_logprobs or 0) if self.logprobs else None, ending=Ending(ignore_eos=self.ignore_eos),
            not_offered=("web_search",) if self.web_search_options is not None else (),
            cache_key=self.prompt_cache_key,
            cache_breaks=tuple(index + 1 for index, message in enumerate(self.messages)
                               if isinstance(message.content, list)
                               and any(getattr(part, "prompt_cache_breakpoint", None) for part in message.content)),
            media=chat_media(self.messages),
        )

    def _thinking(self) -> Optional[bool]:
        switch = (self.chat_template_kwargs or {}).get("enable_thinking")
        if isinstance(switch, bool):
            return switch
        return None if self.reasoning_effort is None else self.reasoning_effort not in ("none", "minimal")

    def _reply_format(self) -> Optional[ReplyFormat]:
        return grammar_fields(self.grammar, self.json_schema) or reply_format(self.response_format, "response_format")

    def _tool_use(self) -> Optional[ToolUse]:
        if self.functions:
            named = self.function_call if isinstance(self.function_call, NamedFunction) else None
            return ToolUse(tuple(template_tool(f.name, f.description, f.parameters) for f in self.functions),
                           strict=frozenset(f.name for f in self.functions if f.strict),
                           choice="required" if named else self.function_call or "auto",
                           name=named.name if named else None, max_calls=1)
        if not self.tools:
            return None
        choice = self.tool_choice
        functions = [t.function for t in self.tools if isinstance(t, ChatTool)]
        customs = self.custom_tools()
        named = choice.function if isinstance(choice, NamedToolChoice) else \
            choice.custom if isinstance(choice, NamedCustomToolChoice) else None
        allowed = choice.allowed_tools if isinstance(choice, AllowedToolsChoice) else None
        return ToolUse(
            tuple([template_tool(f.name, f.description, f.parameters) for f in functions]
                  + [template_tool(c.name, c.description, c.parameters()) for c in customs]),
            strict=frozenset([f.name for f in functions if f.strict] + [c.name for c in customs]),
            choice=(allowed.mode if allowed else "required" if named else choice or "auto"),
            name=named.name if named else None,
            max_calls=1 if self.parallel_tool_calls is False else None,
            raw_inputs={c.name: c.lark for c in customs if c.lark is not None},
            allowed=frozenset((t.function if isinstance(t, NamedToolChoice) else t.custom).name
                              for t in allowed.tools) if allowed else None,
        )

    def custom_tools(self) -> list[CustomToolSpec]:
        """The custom tools offered: their calls come back as custom tool calls."""
        return [t.custom for t in self.tools or () if isinstance(t, ChatCustomTool)]
