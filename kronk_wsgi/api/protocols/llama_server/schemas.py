"""llama-server's request bodies, field by field as its API defines them: each taken with its meaning here, or
refused by name when this server cannot honour the value given."""

from typing import Annotated, Any, Literal, Optional, Self, Union

import pydantic
from pydantic import Field

from ....config import ModelSampling
from ....engine.sampling import SamplingParams
from ...media import MEDIA_MARKER, MediaInput, decode_base64, inputs, marker
from ...ranking import Documents
from ...schemas import ChatMessage, ChatTool, Strict

# llama-server's samplers, in the one order this server applies the ones it has (penalties come first here).
SAMPLER_ORDER = ("penalties", "top_k", "top_p", "min_p", "temperature")
DEFAULT_SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
# Samplers that, at the values a request may give here, change nothing: naming them is allowed.
INERT_SAMPLERS = {"dry", "top_n_sigma", "typ_p", "typical_p", "xtc"}
SAMPLER_ALIASES = {"top-k": "top_k", "top-p": "top_p", "min-p": "min_p", "temp": "temperature", "typical": "typ_p",
                   "typ-p": "typ_p", "nucleus": "top_p", "top-n-sigma": "top_n_sigma"}
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature"}

# Fields whose other values need what this server's sampler does not have: each a 400 naming the field unless it
# has the value that switches the feature off.
OFF_VALUES = {
    "dynatemp_range": 0.0, "typical_p": 1.0, "xtc_probability": 0.0, "mirostat": 0, "dry_multiplier": 0.0,
    "top_n_sigma": -1.0, "adaptive_target": -1.0, "min_keep": 0, "n_indent": 0, "t_max_predict_ms": 0,
    "post_sampling_probs": False, "backend_sampling": False,
}
WHY_OFF = {
    "dynatemp_range": "dynamic temperature", "typical_p": "locally typical sampling", "xtc_probability": "XTC",
    "mirostat": "Mirostat", "dry_multiplier": "DRY", "top_n_sigma": "top-n-sigma", "adaptive_target": "adaptive-p",
    "min_keep": "a sampler minimum", "n_indent": "indentation control", "t_max_predict_ms": "a prediction time limit",
    "post_sampling_probs": "probabilities after the sampler chain", "backend_sampling": "backend sampling",
}

TokenId = Annotated[int, Field(ge=0)]
# A prompt: text, token ids, or both mixed (each text tokenized alone, in its place).
Mixed = Union[str, Annotated[list[Union[TokenId, str]], Field(min_length=1)]]
LogitBias = Union[list[Annotated[list[Union[TokenId, str, float, bool]], Field(min_length=2, max_length=2)]],
                  dict[str, Union[float, bool]]]


class Sampling(Strict):
    """The sampling fields of /completion and /infill, with llama-server's defaults."""

    temperature: Annotated[float, Field(ge=0)] = 0.8  # 0 or below: greedy, as llama-server takes it
    top_k: Annotated[int, Field(ge=0)] = 40
    top_p: Annotated[float, Field(ge=0, le=1)] = 0.95
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.05
    repeat_penalty: Annotated[float, Field(gt=0)] = 1.0
    repeat_last_n: Annotated[int, Field(ge=-1)] = 64  # -1: the whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1: random
    logit_bias: Optional[LogitBias] = None
    samplers: Optional[Union[list[str], str]] = None
    # Each switches off at its default; other values are refused (OFF_VALUES).
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: list[str] = Field(default_factory=lambda: ["\n", ":", "\"", "*"])
    top_n_sigma: float = -1.0
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    min_keep: int = 0
    backend_sampling: bool = False

    @pydantic.model_validator(mode="after")
    def _off(self) -> "Sampling":
        for name, off in OFF_VALUES.items():
            value = getattr(self, name, off)
            if value != off and not (name == "adaptive_target" and value < 0) \
                    and not (name == "top_n_sigma" and value <= 0):
                raise ValueError(f"{name}: {WHY_OFF[name]} is not done by this server's sampler; leave it at {off}")
        self.sampler_chain()  # one this server can apply: refused here, by name, if not
        return self

    def sampler_chain(self) -> tuple[str, ...]:
        """The samplers the request names, in this server's order; 400 for one it lacks or an order it cannot keep."""
        if self.samplers is None:
            return SAMPLER_ORDER
        named = ([SAMPLER_LETTERS.get(c, c) for c in self.samplers] if isinstance(self.samplers, str)
                 else [SAMPLER_ALIASES.get(s, s) for s in self.samplers])
        unknown = [s for s in named if s not in SAMPLER_ORDER and s not in INERT_SAMPLERS]
        if unknown:
            raise ValueError(f"samplers: {unknown[0]!r} is not a sampler of this server "
                             f"(it has {', '.join(SAMPLER_ORDER)})")
        chain = [s for s in named if s in SAMPLER_ORDER]
        if chain != sorted(set(chain), key=SAMPLER_ORDER.index):
            raise ValueError(f"samplers: this server applies its samplers once each, in the order "
                             f"{', '.join(SAMPLER_ORDER)}")
        return tuple(chain)

    def with_model_defaults(self, sampling: ModelSampling) -> Self:
        """These fields with a model's sampling defaults in place of those left out, as llama-server takes its
        defaults from the model (and echoes them)."""
        given = self.model_fields_set
        return self.model_copy(update={name: value for name, value in sampling.model_dump(exclude_none=True).items()
                                       if name not in given})

    def sampling(self, bias: tuple[tuple[int, float], ...], window: int) -> SamplingParams:
        """The sampling parameters (``bias`` the logit bias as token ids, ``window`` the tokens the penalties look
        back over), with the samplers the chain leaves out switched off."""
        chain = self.sampler_chain()
        return SamplingParams(
            temperature=max(self.temperature, 0.0) if "temperature" in chain else 1.0,
            top_p=self.top_p if "top_p" in chain and self.top_p > 0 else 1.0,
            top_k=self.top_k if "top_k" in chain else 0,
            min_p=self.min_p if "min_p" in chain else 0.0,
            repetition_penalty=self.repeat_penalty if "penalties" in chain else 1.0,
            presence_penalty=self.presence_penalty if "penalties" in chain else 0.0,
            frequency_penalty=self.frequency_penalty if "penalties" in chain else 0.0,
            logit_bias=bias, seed=None if self.seed == -1 else self.seed,
            repetition_window=window,
        )


class CompletionBody(Sampling):
    """POST /completion: llama-server's native completion."""

    model: Optional[str] = None  # the default model unless named
    # Text, token ids, ids mixed with texts, an object with the text as prompt_string, or a list of several of
    # those (see ``prompts``).
    prompt: Union[str, dict[str, Any], Annotated[list[Any], Field(min_length=1)]]
    n_predict: Annotated[int, Field(ge=-1)] = -1  # -1: to the context's end
    max_tokens: Optional[Annotated[int, Field(ge=-1)]] = None  # the same, by its other name
    n_cmpl: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    n_probs: Annotated[int, Field(ge=0, le=20)] = 0
    grammar: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = None
    cache_prompt: bool = True
    id_slot: Annotated[int, Field(ge=-1)] = -1  # -1: the free slot that holds most of the prompt
    return_tokens: bool = False
    timings_per_token: bool = False
    return_progress: bool = False
    response_fields: Optional[list[str]] = None
    # Accepted: no prompt is shifted out of the context here (a prompt that does not fit is a 400), so what to keep
    # or discard then, and reuse by shifting, never come up.
    n_keep: int = 0
    n_discard: int = 0
    n_cache_reuse: int = 0
    n_indent: int = 0
    t_max_predict_ms: int = 0
    post_sampling_probs: bool = False
    lora: Literal[None] = None
    sse_ping_interval: Optional[float] = None
    # Speculative decoding: the longest draft (0: none), the shortest worth checking, and the least probability a
    # draft model's drafted token has; unless given, the model's setting.
    speculative_n_max: Optional[Annotated[int, Field(ge=0, le=64)]] = Field(None, alias="speculative.n_max")
    speculative_n_min: Optional[Annotated[int, Field(ge=0, le=64)]] = Field(None, alias="speculative.n_min")
    speculative_p_min: Optional[Annotated[float, Field(ge=0, le=1)]] = Field(None, alias="speculative.p_min")

    # Read as the body is validated (in its thread: a multimodal prompt's files are base64 to decode)
    _prompts: list[tuple[str, Mixed]] = pydantic.PrivateAttr(default_factory=list)
    _media: list[MediaInput] = pydantic.PrivateAttr(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "CompletionBody":
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give json_schema or grammar, not both")
        self._prompts = self._read_prompts()  # each a prompt: refused here, by name, if not
        return self

    def prompts(self) -> list[tuple[str, Mixed]]:
        """Each prompt, with where it is in the body: one, unless ``prompt`` is a list of prompts (of texts alone,
        or holding lists or objects). A multimodal prompt's text holds its media's markers (see api/media.py)."""
        return self._prompts

    def _read_prompts(self) -> list[tuple[str, Mixed]]:
        self._media = []
        if isinstance(self.prompt, str):
            return [("prompt", self.prompt)]
        if isinstance(self.prompt, dict) or _one_prompt(self.prompt):
            return [("prompt", self._prompt(self.prompt, "prompt"))]
        return [(f"prompt[{i}]", self._prompt(item, f"prompt[{i}]")) for i, item in enumerate(self.prompt)]

    def media(self) -> dict[str, MediaInput]:
        """The media of the multimodal prompts (objects with multimodal_data)."""
        return inputs(self._media)

    def _prompt(self, item: Any, where: str) -> Mixed:
        """One prompt of a list of prompts; a ValueError naming it if it is none. A multimodal prompt is the text
        of its prompt_string with each MEDIA_MARKER the marker of its multimodal_data's file in turn."""
        if isinstance(item, dict) and item.get("multimodal_data"):
            text, files = item.get("prompt_string"), item["multimodal_data"]
            if not isinstance(text, str) or not isinstance(files, list) or not all(isinstance(f, str) for f in files):
                raise ValueError(f"{where}: a multimodal prompt is a prompt_string and multimodal_data, a list of "
                                 "base64 files")
            pieces = text.split(MEDIA_MARKER)
            if len(pieces) != len(files) + 1:
                raise ValueError(f"{where}: prompt_string has {len(pieces) - 1} media markers ({MEDIA_MARKER}, "
                                 f"see /props) for {len(files)} files of multimodal_data")
            data = [decode_base64(f) for f in files]
            self._media += [MediaInput(d, f"{where}.multimodal_data[{k}]") for k, d in enumerate(data)]
            return "".join(piece + (marker(data[k]) if k < len(data) else "") for k, piece in enumerate(pieces))
        return _prompt(item, where)

    @property
    def limit(self) -> Optional[int]:
        """The token limit; None: to the context's end."""
        given = self.max_tokens if self.max_tokens is not None and self.n_predict == -1 else self.n_predict
        return None if given < 0 else given


def _one_prompt(items: list[Any]) -> bool:
    """Whether a list is one prompt, as llama-server reads it: token ids, or ids mixed with texts."""
    ids = [isinstance(item, int) and not isinstance(item, bool) for item in items]
    return all(ids) or (any(ids) and all(i or isinstance(item, str) for i, item in zip(ids, items)))


def _prompt(item: Any, where: str) -> Mixed:
    """One prompt of a list of prompts, not multimodal; a ValueError naming it if it is none."""
    if isinstance(item, dict):
        item = item.get("prompt_string")
    if isinstance(item, str) or (isinstance(item, list) and item and _one_prompt(item)):
        for token in item if isinstance(item, list) else ():
            if isinstance(token, int) and token < 0:
                raise ValueError(f"{where}: {token} is not a token id")
        return item
    raise ValueError(f"{where}: a prompt is a text, token ids, or token ids mixed with texts")


class InfillFile(Strict):
    filename: str = "tmp"
    text: str = ""


class InfillBody(CompletionBody):
    """POST /infill: code between a prefix and a suffix, in the model's fill-in-the-middle tokens."""

    prompt: Union[str, list[Union[TokenId, str]]] = ""
    input_prefix: Union[str, list[Union[TokenId, str]]] = ""
    input_suffix: Union[str, list[Union[TokenId, str]]] = ""
    input_extra: list[InfillFile] = Field(default_factory=list)


class TokenizeBody(Strict):
    model: Optional[str] = None
    content: Union[str, list[Union[TokenId, str]]]
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(Strict):
    model: Optional[str] = None
    tokens: list[TokenId] = Field(default_factory=list)


class ApplyTemplateBody(Strict):
    model: Optional[str] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Optional[list[ChatTool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True


class RerankBody(Strict):
    """Jina's shape (``documents``), or Hugging Face TEI's (``texts``, answered as TEI answers); ``return_text``
    is TEI's, ``return_documents`` Jina's and Cohere's."""

    model: Optional[str] = None
    query: str
    documents: Optional[Documents] = None
    texts: Optional[Annotated[list[str], Field(min_length=1, max_length=10_000)]] = None
    top_n: Optional[Annotated[int, Field(ge=0)]] = None
    return_text: bool = False
    return_documents: bool = False

    @pydantic.model_validator(mode="after")
    def _some_documents(self) -> "RerankBody":
        if self.documents is None and self.texts is None:
            raise ValueError("documents must be a non-empty array of strings")
        return self
