"""Deterministic GGUF models with random weights: llama architecture, or qwen2 (which ctransformers cannot run),
and a vision projector for the llama one.

No hub is reachable offline, so kronk_wsgi makes its own models: the text they
write is gibberish, but loading, tokenizing, prefill, sampling and detokenizing
all run for real; with the projector, so do an image's decoding, its encoding by
llama.cpp's multimodal library and its embeddings' prefill. ``ensure_demo_model``
caches the file under the user's cache directory; the same size and seed always
give the same bytes.
"""

import dataclasses
import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

from ..config import cache_dir
from .chat_template import BUILTIN_TEMPLATES

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have "
    "or by one had not but what all were when we there can an your which their said if "
    "do will each about how up out them then she many some so these would other into has "
    "more her two like him see time could no make than first been its who now people my "
    "made over did down only way find use may water long little very after words called "
    "just where most know get through back much before go good new write our used me man "
    "too any day same right look think also around another came come work three word must "
    "because does part even place well such here take why things help put years different "
    "away again off went old number great tell men say small every found still between name "
    "should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large "
    "often together asked house world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head "
    "above kind began almost live page got earth need far hand high year mother light parts "
    "country father let night following picture being study second eyes soon times story "
    "boys since white days ever paper hard near sentence better best across during today "
    "others however sure means knew try told young miles sun ways thing whole hear example "
    "heard several change answer room sea against top turned learn point city play toward "
    "five using himself usually money seen car morning hello model server token stream"
).split()


@dataclasses.dataclass(frozen=True)
class DemoSize:
    """Hyperparameters of one demo model."""

    vocab: int
    width: int
    layers: int
    feed_forward: int
    heads: int
    context_length: int
    dtype: type


SIZES = {
    # ~0.6 MB, ~16k tokens/s on 2 cores: tests and the embedded default.
    "tiny": DemoSize(512, 64, 2, 128, 4, 2048, np.float32),
    # ~55 MB, a few hundred tokens/s: benchmarks.
    "medium": DemoSize(2048, 512, 8, 1536, 8, 2048, np.float16),
}


def _vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: specials, 256 byte tokens, word pieces."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["▁" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [".", ",", "!", "?", "\n", "▁" + "I", "▁" + "A"]
    for word in _WORDS:  # every prefix, so SentencePiece merges can reach the word
        pieces += ["▁" + word[:k] for k in range(1, len(word) + 1)]
    seen: set[str] = set()
    pieces = [p for p in pieces if not (p in seen or seen.add(p))]
    room = size - len(tokens)
    if room > len(pieces):
        pieces += [f"▁w{i}" for i in range(room - len(pieces))]
    pieces = pieces[:room]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # Longer pieces win merges, as in a trained SentencePiece model.
    scores = [0.0] * (3 + 256) + [float(len(p)) - i * 1e-4 for i, p in enumerate(pieces)]
    return tokens, scores, [int(t) for t in types]


ARCHITECTURES = ("llama", "qwen2")  # qwen2: llama's tensors plus biases on the query, key and value projections


def write_demo_model(path: Path, size: str = "tiny", seed: int = 0, architecture: str = "llama") -> Path:
    """Write a GGUF model of the named size and architecture with seeded random weights."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: choose one of {', '.join(ARCHITECTURES)}")
    spec = SIZES[size]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"kronk-demo-{size}")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.width)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.feed_forward)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.heads)
    writer.add_rope_dimension_count(spec.width // spec.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0 if spec.dtype is np.float32 else 1)
    tokens, scores, types = _vocab(spec.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(BUILTIN_TEMPLATES["chatml"])  # exercises the from-file path

    def weight(*shape: int) -> np.ndarray:
        scale = 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(spec.dtype)

    def norm() -> np.ndarray:
        return np.ones(spec.width, dtype=np.float32)

    w, ff = spec.width, spec.feed_forward
    writer.add_tensor("token_embd.weight", weight(spec.vocab, w))
    for i in range(spec.layers):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", norm())
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(blk + name + ".weight", weight(w, w))
        if architecture == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(blk + name + ".bias", np.zeros(w, dtype=np.float32))
        writer.add_tensor(blk + "ffn_norm.weight", norm())
        writer.add_tensor(blk + "ffn_gate.weight", weight(ff, w))
        writer.add_tensor(blk + "ffn_up.weight", weight(ff, w))
        writer.add_tensor(blk + "ffn_down.weight", weight(w, ff))
    writer.add_tensor("output_norm.weight", norm())
    # Strong word logits, near-zero byte and control logits: the demo writes words.
    output = weight(spec.vocab, w) * 4
    output[: 3 + 256] *= 0.05
    output[2] = output[3 + 256]  # </s> as likely as a word: replies end by themselves
    writer.add_tensor("output.weight", output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclasses.dataclass(frozen=True)
class ProjectorSize:
    """Hyperparameters of a LLaVA-style projector: a CLIP vision encoder of ``layers`` blocks over patches of
    ``patch`` pixels of an ``image`` pixels square, then a two-layer MLP into the language model's width."""

    image: int = 56
    patch: int = 14
    width: int = 32
    layers: int = 2
    heads: int = 2
    feed_forward: int = 64

    @property
    def tokens(self) -> int:
        """The tokens an image becomes: one per patch."""
        return (self.image // self.patch) ** 2


PROJECTOR = ProjectorSize()


def write_demo_projector(path: Path, text_width: int, seed: int = 0, size: ProjectorSize = PROJECTOR) -> Path:
    """Write a LLaVA-style projector (llama.cpp's ``mlp`` type, as in LLaVA 1.5) with seeded random weights,
    whose image embeddings are ``text_width`` wide: an mmproj file for a demo model of that width."""
    rng = np.random.default_rng(seed + 1)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name("kronk-demo-projector")
    writer.add_file_type(0)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", size.image)
    writer.add_uint32("clip.vision.patch_size", size.patch)
    writer.add_uint32("clip.vision.embedding_length", size.width)
    writer.add_uint32("clip.vision.feed_forward_length", size.feed_forward)
    writer.add_uint32("clip.vision.block_count", size.layers)
    writer.add_uint32("clip.vision.projection_dim", text_width)
    writer.add_uint32("clip.vision.attention.head_count", size.heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)

    w, ff = size.width, size.feed_forward
    writer.add_tensor("v.patch_embd.weight", weight(w, 3, size.patch, size.patch))
    writer.add_tensor("v.class_embd", weight(w))
    writer.add_tensor("v.position_embd.weight", weight(size.tokens + 1, w))
    writer.add_tensor("v.pre_ln.weight", np.ones(w, dtype=np.float32))
    writer.add_tensor("v.pre_ln.bias", np.zeros(w, dtype=np.float32))
    for i in range(size.layers):
        blk = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(blk + name + ".weight", weight(w, w))
            writer.add_tensor(blk + name + ".bias", np.zeros(w, dtype=np.float32))
        for name in ("ln1", "ln2"):
            writer.add_tensor(blk + name + ".weight", np.ones(w, dtype=np.float32))
            writer.add_tensor(blk + name + ".bias", np.zeros(w, dtype=np.float32))
        writer.add_tensor(blk + "ffn_up.weight", weight(ff, w))
        writer.add_tensor(blk + "ffn_up.bias", np.zeros(ff, dtype=np.float32))
        writer.add_tensor(blk + "ffn_down.weight", weight(w, ff))
        writer.add_tensor(blk + "ffn_down.bias", np.zeros(w, dtype=np.float32))
    writer.add_tensor("mm.0.weight", weight(text_width, w))
    writer.add_tensor("mm.0.bias", np.zeros(text_width, dtype=np.float32))
    writer.add_tensor("mm.2.weight", weight(text_width, text_width) * 4)  # strong enough to steer the reply
    writer.add_tensor("mm.2.bias", np.zeros(text_width, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_demo_vision(directory: Path, size: str = "tiny", seed: int = 0) -> tuple[Path, Path]:
    """Write a demo model and its projector into ``directory`` (made if missing): a llama model that takes
    images. Their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    model = write_demo_model(directory / f"kronk-demo-vision-{size}.gguf", size, seed)
    return model, write_demo_projector(directory / f"mmproj-kronk-demo-vision-{size}.gguf", SIZES[size].width, seed)


def demo_model_path(size: str = "tiny", seed: int = 0) -> Path:
    """Where the demo model of this size is kept."""
    return cache_dir() / f"kronk-demo-{size}-s{seed}.gguf"


def ensure_demo_model(size: str = "tiny", seed: int = 0) -> Path:
    """Return the cached demo model file, writing it first if it is missing.

    Written to a temporary file and renamed, so concurrent workers never see
    a half-written model.
    """
    path = demo_model_path(size, seed)
    directory = path.parent
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
    os.close(fd)
    try:
        write_demo_model(Path(tmp), size, seed)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
