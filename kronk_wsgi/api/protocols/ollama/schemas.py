"""The Ollama API's request bodies, with Ollama's option names and defaults."""

from typing import Annotated, Any, Literal, Optional, Union

import pydantic

from ....engine.sampling import SamplingParams
from ...errors import invalid
from ...ranking import Documents
from ...media import decode_base64, joined
from ...schemas import FunctionDefinition, Strict, template_tool_call

Duration = Union[int, float, str]
Think = Union[bool, Literal["low", "medium", "high"]]
Format = Union[Literal["", "json"], dict[str, Any]]


class Options(Strict):
    """Ollama's model options. Those that say how to run on the machine are the configuration's to decide."""

    # Sampling and the reply, honoured.
    seed: Optional[int] = None
    num_predict: Optional[int] = None
    top_k: Optional[Annotated[int, pydantic.Field(ge=0)]] = None
    top_p: Optional[Annotated[float, pydantic.Field(gt=0, le=1)]] = None
    min_p: Optional[Annotated[float, pydantic.Field(ge=0, le=1)]] = None
    temperature: Optional[Annotated[float, pydantic.Field(ge=0, le=100)]] = None  # past 100: as flat as it gets
    repeat_penalty: Optional[Annotated[float, pydantic.Field(ge=0.01, le=10)]] = None
    repeat_last_n: Optional[Annotated[int, pydantic.Field(ge=-1)]] = None
    presence_penalty: Optional[Annotated[float, pydantic.Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[float, pydantic.Field(ge=-2, le=2)]] = None
    stop: Optional[list[str]] = None
    num_ctx: Optional[Annotated[int, pydantic.Field(ge=1)]] = None
    # Samplers this server does not have: only their "off" values.
    typical_p: Optional[float] = None
    tfs_z: Optional[float] = None
    mirostat: Optional[int] = None
    mirostat_tau: Optional[float] = None  # used by mirostat only
    mirostat_eta: Optional[float] = None
    # No effect in Ollama either, or none here: no context shift (a prompt that does not fit is a 400).
    num_keep: Optional[int] = None
    penalize_newline: Optional[bool] = None
    # The machine: threads, batches, GPUs and memory maps are the server's configuration.
    numa: Optional[bool] = None
    num_batch: Optional[int] = None
    num_gpu: Optional[int] = None
    main_gpu: Optional[int] = None
    low_vram: Optional[bool] = None
    f16_kv: Optional[bool] = None
    logits_all: Optional[bool] = None
    vocab_only: Optional[bool] = None
    use_mmap: Optional[bool] = None
    use_mlock: Optional[bool] = None
    embedding_only: Optional[bool] = None
    num_thread: Optional[int] = None

    @pydantic.field_validator("typical_p", "tfs_z", "mirostat")
    @classmethod
    def _off(cls, value: Optional[float], info: pydantic.ValidationInfo) -> Optional[float]:
        off = 0 if info.field_name == "mirostat" else 1
        if value is not None and value != off:
            raise ValueError(f"this server has no {info.field_name} sampling: only {off} (off) is taken")
        return value

    @pydantic.field_validator("num_predict")
    @classmethod
    def _predict(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and (value == 0 or value < -2):
            raise ValueError("num_predict is a number of tokens, or -1 (no limit) or -2 (fill the context)")
        return value


# Ollama's defaults, where they differ from OpenAI's.
DEFAULTS = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1)


class ToolFunction(Strict):
    name: str
    arguments: dict[str, Any]
    index: Optional[int] = None


class ToolCallBody(Strict):
    function: ToolFunction
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None


class WithImages(Strict):
    """A body or message with Ollama's ``images``: base64, decoded as the body is validated."""

    images: Optional[list[str]] = None
    _images: list[bytes] = pydantic.PrivateAttr(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _read_images(self) -> "WithImages":
        self._images = []
        for index, image in enumerate(self.images or ()):
            try:
                self._images.append(decode_base64(image))
            except ValueError as exc:
                raise ValueError(f"images[{index}]: {exc}") from None
        return self

    def image_data(self) -> list[bytes]:
        """The images, decoded."""
        return self._images


class Message(WithImages):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: Optional[str] = None
    tool_calls: Optional[list[ToolCallBody]] = None
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None

    def for_template(self, index: int) -> dict:
        """The message for the chat template; its images before its text, as Ollama puts them."""
        message: dict[str, Any] = {"role": self.role, "content": joined([*self.image_data(), self.content])}
        if self.tool_calls:
            message["tool_calls"] = [template_tool_call(c.id or f"call_{index}_{n}", c.function.name,
                                                        c.function.arguments) for n, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id or ""
            if self.tool_name:
                message["name"] = self.tool_name
        if self.thinking and self.role == "assistant":  # an earlier answer's, for the template to render or not
            message["reasoning_content"] = message["thinking"] = self.thinking
        return message


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class Generating(Strict):
    """What /api/chat and /api/generate share."""

    model: Annotated[str, pydantic.Field(min_length=1)]
    stream: bool = True
    format: Optional[Format] = None
    options: Optional[Options] = None
    keep_alive: Optional[Duration] = None
    think: Optional[Think] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, pydantic.Field(ge=0, le=20)]] = None

    def options_or_defaults(self) -> Options:
        return self.options or Options()


class ChatBody(Generating):
    messages: list[Message] = []
    tools: Optional[list[Tool]] = None


class GenerateBody(Generating, WithImages):
    prompt: str = ""
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[int]] = None
    raw: bool = False
    # Image generation, which this server does not do.
    width: Optional[int] = None
    height: Optional[int] = None
    steps: Optional[int] = None


class EmbedBody(Strict):
    model: Annotated[str, pydantic.Field(min_length=1)]
    input: Union[str, Annotated[list[str], pydantic.Field(max_length=2048)]]
    truncate: bool = True
    options: Optional[Options] = None
    keep_alive: Optional[Duration] = None
    dimensions: Optional[int] = None


class RerankBody(Strict):
    """The shape Ollama's reranking pull requests give /api/rerank (Ollama has not released one)."""

    model: Annotated[str, pydantic.Field(min_length=1)]
    query: str
    documents: Documents
    top_n: Optional[Annotated[int, pydantic.Field(ge=0)]] = None
    return_documents: bool = False
    keep_alive: Optional[Duration] = None


class EmbeddingsBody(Strict):
    model: Annotated[str, pydantic.Field(min_length=1)]
    prompt: str
    options: Optional[Options] = None
    keep_alive: Optional[Duration] = None


class Named(Strict):
    """A body that names one model, as ``model`` or (deprecated) ``name``."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: bool = False  # /api/show: arrays of the file's metadata too
    stream: bool = True  # /api/pull
    # /api/pull: the hub is reached as the server's environment says (HF_ENDPOINT, HF_TOKEN)
    insecure: bool = False
    username: Optional[str] = None
    password: Optional[str] = None

    @property
    def named(self) -> str:
        name = self.model or self.name
        if not name:
            raise invalid("model is required", param="model")
        return name


class CopyBody(Strict):
    source: Annotated[str, pydantic.Field(min_length=1)]
    destination: Annotated[str, pydantic.Field(min_length=1, max_length=200)]
