"""A ``Generate`` call of SGLang's or vLLM's engine protocol, read into the generation request every protocol
builds.

Every field of each protocol's ``GenerateRequest`` and its ``SamplingParams``
has a meaning here or is refused by name (``Refused``): nothing a gateway asks
for is dropped. Text-side fields (``skip_special_tokens``, ``no_stop_trim``,
``spaces_between_special_tokens``) are the gateway's own: it detokenizes
the ids this worker sends.
"""

import json
import math
from typing import Optional

from ..api.planning import JSON_OBJECT, Ending, GenerationRequest, ReplyFormat
from ..engine.sampling import SamplingParams

# A float32 field of the protocol that is unset reads as 0; these are never meant as 0 (SGLang reads them so too).
NEUTRAL_WHEN_ZERO = {"top_p": 1.0, "repetition_penalty": 1.0}


class Refused(ValueError):
    """A field this worker cannot honour, or a value it cannot take: INVALID_ARGUMENT naming ``field``."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


def generation_request(call, model_id: str) -> GenerationRequest:
    """The generation ``call`` (a ``GenerateRequest``) asks of model ``model_id``."""
    _refuse_unsupported(call)
    params = call.sampling_params
    ids = _prompt(call)
    top_logprobs: Optional[int] = None
    if call.return_logprob:
        if call.top_logprobs_num < 0:
            raise Refused("top_logprobs_num", "must be 0 or more")
        top_logprobs = call.top_logprobs_num
    return GenerationRequest(
        model=model_id, prompt_param="tokenized.input_ids", prompts=[ids], n=max(params.n, 1),
        reply_format=_constraint(params), sampling=_sampling(params, params.temperature, _token_bias(params)),
        stop=tuple(params.stop),
        ending=Ending(params.ignore_eos, tuple(params.stop_token_ids), params.min_new_tokens),
        max_tokens=params.max_new_tokens if params.HasField("max_new_tokens") else None,
        max_tokens_param="max_new_tokens", top_logprobs=top_logprobs, token_ids=True,
    )


def stream_interval(call) -> int:
    """How many tokens each streamed chunk waits for (``sampling_params.stream_interval``; 1 unset)."""
    params = call.sampling_params
    if not params.HasField("stream_interval"):
        return 1
    if params.stream_interval < 1:
        raise Refused("sampling_params.stream_interval", "must be 1 or more")
    return params.stream_interval


def _refuse_unsupported(call) -> None:
    """Refuse what this worker has no engine for: images, hidden states, prompt logprobs, adapters."""
    inputs = call.mm_inputs
    if call.HasField("mm_inputs") and (inputs.image_urls or inputs.video_urls or inputs.audio_urls or inputs.image_data
                                       or inputs.video_data or inputs.audio_data or inputs.HasField("pixel_values")):
        raise Refused("mm_inputs", "this worker serves text models only")
    refused = {
        "return_hidden_states": (call.return_hidden_states, "hidden states are not returned"),
        "input_embeds": (bool(call.input_embeds), "the prompt must be token ids"),
        "lora_id": (bool(call.lora_id), "no LoRA adapter is loaded"),
        "custom_logit_processor": (bool(call.custom_logit_processor), "custom logit processors are not run"),
        "token_ids_logprob": (bool(call.token_ids_logprob), "only the sampled and the likeliest tokens' logprobs "
                                                             "are reported (top_logprobs_num)"),
        "logprob_start_len": (call.return_logprob and call.logprob_start_len >= 0,
                              "the prompt's logprobs are not computed (send -1)"),
        "disaggregated_params": (call.HasField("disaggregated_params")
                                 and bool(call.disaggregated_params.bootstrap_host),
                                 "prefill-decode disaggregation is not served"),
        "data_parallel_rank": (call.HasField("data_parallel_rank") and call.data_parallel_rank != 0,
                               "this worker has one rank, 0"),
        "sampling_params.custom_params": (call.sampling_params.HasField("custom_params")
                                          and bool(call.sampling_params.custom_params.fields),
                                          "no custom sampling parameter is known"),
    }
    for field, (asked, why) in refused.items():
        if asked:
            raise Refused(field, why)


def _prompt(call) -> list[int]:
    """The call's prompt: its token ids, at least one."""
    ids = list(call.tokenized.input_ids)
    if not ids:
        raise Refused("tokenized.input_ids", "the prompt has no tokens")
    return ids


def _token_bias(params) -> list[tuple[int, float]]:
    """SGLang's ``logit_bias``, keyed by token ids written as strings."""
    bias = []
    for key, value in params.logit_bias.items():
        try:
            bias.append((int(key), value))
        except ValueError:
            raise Refused("sampling_params.logit_bias", f"{key!r} is not a token id") from None
    return bias


def _sampling(params, temperature: float, bias, seed: Optional[int] = None) -> SamplingParams:
    """Either protocol's sampling fields, with its ``temperature``, ``bias`` (token, bias) and ``seed``; an unset
    float reads as 0, which top_p and repetition_penalty never mean (as SGLang and vLLM read them)."""
    if not math.isfinite(temperature):
        raise Refused("sampling_params.temperature", "must be a finite number")
    values = {name: getattr(params, name) or neutral for name, neutral in NEUTRAL_WHEN_ZERO.items()}
    return SamplingParams(
        temperature=temperature, top_k=max(params.top_k, 0), min_p=params.min_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        logit_bias=tuple(bias), seed=seed, **values,
    )


def _constraint(params) -> Optional[ReplyFormat]:
    """The reply's constraint: a JSON Schema or an EBNF grammar (llama.cpp's GBNF, which SGLang's EBNF is, or Lark,
    as llguidance tells them apart)."""
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    param = f"sampling_params.{kind}"
    if kind == "json_schema":
        return _schema(params.json_schema, param)
    if kind == "ebnf_grammar":
        return ReplyFormat(None, strict=True, param=param, gbnf=params.ebnf_grammar)
    raise Refused(param, "regular expressions and structural tags are not enforced here (json_schema and "
                  "ebnf_grammar are)")


# -- vLLM's engine protocol (VllmEngine) ------------------------------------------------------------------------

def vllm_generation_request(call, model_id: str) -> GenerationRequest:
    """The generation ``call`` (vLLM's ``GenerateRequest``) asks of model ``model_id``."""
    _refuse_unsupported_vllm(call)
    params = call.sampling_params
    ids = _prompt(call)
    if params.HasField("truncate_prompt_tokens"):
        if params.truncate_prompt_tokens < 1:
            raise Refused("sampling_params.truncate_prompt_tokens", "must be 1 or more (the prompt's last tokens kept)")
        ids = ids[-params.truncate_prompt_tokens:]
    top_logprobs: Optional[int] = None
    if params.HasField("logprobs"):
        if params.logprobs < 0:
            raise Refused("sampling_params.logprobs", "must be 0 or more (the whole vocabulary's are not reported)")
        top_logprobs = params.logprobs
    return GenerationRequest(
        model=model_id, prompt_param="tokenized.input_ids", prompts=[ids], n=max(params.n, 1),
        reply_format=_vllm_constraint(params), stop=tuple(params.stop),
        # An unset temperature is vLLM's default, 1.
        sampling=_sampling(params, params.temperature if params.HasField("temperature") else 1.0,
                           params.logit_bias.items(), params.seed if params.HasField("seed") else None),
        ending=Ending(params.ignore_eos, tuple(params.stop_token_ids), params.min_tokens),
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        max_tokens_param="max_tokens", top_logprobs=top_logprobs, token_ids=True,
    )


def _refuse_unsupported_vllm(call) -> None:
    """Refuse what this worker has no engine for: text prompts, images, prompt logprobs, KV transfer."""
    params = call.sampling_params
    refused = {
        "text": (call.HasField("text"), "the prompt must be token ids (tokenized.input_ids)"),
        "mm_inputs": (call.HasField("mm_inputs") or bool(call.extra_mm_inputs) or call.HasField("media_refs"),
                      "this worker serves text models only"),
        "kv_transfer_params": (call.HasField("kv_transfer_params") or call.HasField("kv_transfer_params_json"),
                               "prefill-decode disaggregation is not served"),
        "data_parallel_rank": (call.HasField("data_parallel_rank") and call.data_parallel_rank != 0,
                               "this worker has one rank, 0"),
        "sampling_params.prompt_logprobs": (params.HasField("prompt_logprobs"),
                                            "the prompt's logprobs are not computed"),
        "sampling_params.include_stop_str_in_output": (params.include_stop_str_in_output,
                                                       "a stop text's tokens are not sent"),
    }
    for field, (asked, why) in refused.items():
        if asked:
            raise Refused(field, why)


def _vllm_constraint(params) -> Optional[ReplyFormat]:
    """The reply's constraint: a JSON Schema, any JSON object, a GBNF grammar, or one of given texts."""
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    param = f"sampling_params.{kind}"
    if kind == "json_schema":
        return _schema(params.json_schema, param)
    if kind == "json_object":
        return ReplyFormat(JSON_OBJECT, strict=False, param=param)
    if kind == "grammar":
        return ReplyFormat(None, strict=True, param=param, gbnf=params.grammar)
    if kind == "choice":
        if not params.choice.choices:
            raise Refused(param, "no choice is given")
        literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice.choices)
        return ReplyFormat(None, strict=True, param=param, gbnf=f"root ::= {literals}")
    raise Refused(param, "regular expressions and structural tags are not enforced here (json_schema, json_object, "
                  "grammar and choice are)")


def _schema(text: str, param: str) -> ReplyFormat:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise Refused(param, f"not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise Refused(param, "a JSON Schema is an object")
    return ReplyFormat(schema, strict=True, param=param)
