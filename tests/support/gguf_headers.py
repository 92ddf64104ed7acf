"""Tiny GGUF files of any architecture, for the checks made before an engine sees a file."""

from pathlib import Path

import gguf
import numpy as np

TOKENS = ["<|endoftext|>", "Ġ", "Ċ", "a", "b", "Ġa", "ab", "<|im_start|>", "<|im_end|>"]
TYPES = [3, 1, 1, 1, 1, 1, 1, 3, 3]


def write_header(path: Path, architecture: str = "llama", *, tensor_type: gguf.GGMLQuantizationType = None,
                 extra_tensors: tuple[str, ...] = (), tied: bool = False, eos: int = 8,
                 markers: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")) -> Path:
    """A one-layer model with a byte-level BPE vocabulary and the turn ``markers`` as control tokens;
    its weights are zeros."""
    tokens, types = TOKENS[:7] + list(markers), TYPES[:7] + [3] * len(markers)
    width, ff, vocab = 32, 64, len(tokens)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(64)
    writer.add_embedding_length(width)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_eos_token_id(eos)

    def tensor(name: str, *shape: int) -> None:
        if tensor_type is None or len(shape) == 1:
            writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
            return
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        raw = np.zeros((shape[0], shape[1] // block * size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_dtype=tensor_type)

    tensor("token_embd.weight", vocab, width)
    for name, shape in (("attn_q", (width, width)), ("attn_k", (width, width)), ("attn_v", (width, width)),
                        ("attn_output", (width, width)), ("ffn_gate", (ff, width)), ("ffn_up", (ff, width)),
                        ("ffn_down", (width, ff))):
        tensor(f"blk.0.{name}.weight", *shape)
    tensor("blk.0.attn_norm.weight", width)
    tensor("blk.0.ffn_norm.weight", width)
    tensor("output_norm.weight", width)
    if not tied:
        tensor("output.weight", vocab, width)
    for name in extra_tensors:
        tensor(name, width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
