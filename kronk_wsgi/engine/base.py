"""The engine interface: what the serving core needs from a C-backed model.

An ``Engine`` is one loaded model file. It has the model's tokenizer and
hands out ``Slot``s; a slot is an independent inference instance with its own
KV cache, fed token ids only. Each slot is used by one OS thread at a time:
the serving core guarantees it.

An engine with a multimodal projector also turns an image (or a sound) into
tokens of a prompt (``Engine.media``): the projector's own text tokens around
a run of placeholders, negative ids that no vocabulary has, derived from the
image's hash (``media_ids``). A prompt holding them is compared, cached and
restored as any other; a slot meeting a run evaluates the image whole
(``Slot.decode_media``).
Each backend (ctransformers, llama.cpp) implements these two classes;
nothing above the engine layer changes.
"""

import abc
import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import pydantic

from .prompt_cache import MIN_TOKENS, PromptCache, shared_prefix
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .generate import DecodeOptions, Generation


# Chooses the next token from the logits after a decode call (read-only; they may be gone after it returns).
Pick = Callable[[np.ndarray], int]

# The context served when neither the configuration nor the file gives one.
DEFAULT_CONTEXT_LENGTH = 2048

# A slot holds a prompt's tokens for it when the prompt continues at least this share of the slot's cached tokens.
SIMILARITY = 0.5


def _branch(shared: int, tokens: Sequence[int], held: Sequence[int]) -> int:
    """Where ``tokens`` part from ``held``, given the ``shared`` leading tokens they have in common (both go on
    past it); 0 if one continues the other."""
    return shared if shared < min(len(tokens), len(held)) else 0


class EngineError(Exception):
    """The engine failed: a load or an inference call did not succeed."""


class EngineBusy(EngineError):
    """The engine (a worker elsewhere, a runner) stayed busy past its own admission wait: the request was not run."""


class MediaError(ValueError):
    """An image or sound the model cannot take: it reads text only, or the data does not decode."""


def media_ids(key: bytes, count: int) -> list[int]:
    """The placeholders of a run of ``count`` media tokens of the image hashed ``key``: negative 31-bit ids, each
    from the hash and its place, so that two images share no run of them (a prompt cache never takes one
    image's state for another's)."""
    ids = []
    for index in range(count):
        digest = hashlib.blake2b(index.to_bytes(4, "little"), key=key[:64], digest_size=4).digest()
        ids.append(-1 - (int.from_bytes(digest, "little") & 0x7FFFFFFE))
    return ids


@dataclasses.dataclass(frozen=True, eq=False)
class Media:
    """One image (or sound) as a prompt holds it: its ``tokens`` (the projector's text tokens and its runs of
    placeholders) and what its engine keeps to evaluate them, as long as this is held."""

    tokens: tuple[int, ...]
    kind: str  # "image" or "audio"
    held: Any = None


class Cancelled(Exception):
    """Work stopped between two engine calls because the caller asked."""


@dataclasses.dataclass(frozen=True)
class DraftSlot:
    """A slot's draft model for speculative decoding: a slot of a smaller model of the same vocabulary, and the token
    ids both models have (those below ``vocabulary``)."""

    slot: "Slot"
    vocabulary: int


class Slot(abc.ABC):
    """One inference instance: a KV cache and the tokens it holds."""

    # Prompt tokens per engine call: the engine's speed, against how soon a cancel is seen (each engine sets its own).
    prefill_chunk: int
    # Its cache keeps only the last window of tokens in some layers: a saved state serves only a prompt that continues
    # all of it, so the state at each prompt's end (the next turn's prefix) is saved too.
    sliding_window = False

    def __init__(self) -> None:
        self.cached: list[int] = []  # tokens whose keys and values are in the cache
        self.scope = ""  # whose they are: a prompt of another cache scope never continues them (see ``enter``)
        self.state_cache: Optional[PromptCache] = None  # saved states to restore from, where the engine has them
        self.cache_written = 0  # prompt tokens the last prefill saves at its save points, beyond those it reused
        self._saves: list[int] = []  # the save points the last reuse chose, for evaluate
        self.draft: Optional[DraftSlot] = None  # its draft model's slot, where the model drafts with one

    @abc.abstractmethod
    def _eval(self, tokens: Sequence[int], n_past: int, pick: Optional[Pick] = None) -> Optional[int]:
        """Evaluate ``tokens`` at positions ``n_past``...; one C call.

        An engine that can run ``pick`` where its logits are returns ``pick(logits)``; the others
        return None, and ``decode`` calls ``pick`` on ``logits()``.
        """

    @abc.abstractmethod
    def logits(self) -> np.ndarray:
        """Logits after the last evaluated token (float32, n_vocab): the caller's to keep; it may be read-only."""

    @abc.abstractmethod
    def embedding(self) -> np.ndarray:
        """The model's final hidden state for the last evaluated token; or, for a model that pools by the last token,
        its pooled output (a reranker's scores). A copy, float32."""

    def prefill(
        self,
        tokens: Sequence[int],
        cancelled: Callable[[], bool] = lambda: False,
        chunk: Optional[int] = None,
        save_at: Sequence[int] = (),
    ) -> int:
        """Evaluate a prompt, reusing the cached prefix; return tokens reused (``reuse``, then ``evaluate``)."""
        keep = self.reuse(tokens, save_at)
        self.evaluate(tokens, cancelled, chunk)
        return keep

    def reuse(self, tokens: Sequence[int], save_at: Sequence[int] = ()) -> int:
        """The first part of a prefill: how much of the prompt the slot serves, from what it holds or from a state
        it restores; the tokens reused. At least the last token is left to evaluate, so logits always belong to
        this prompt.

        With a state cache, ``evaluate`` then saves the prefix ending at each
        of ``save_at`` (prompt lengths a client marked worth keeping) on the
        way, and a branch point: where the prompt leaves a saved or held
        sequence it shares at least a block with (one system prompt and tools
        block before many conversations). A point at the prompt's end is met
        by the save of what the slot holds (after the answer, or before a
        prompt overwrites it: see serving.pool), except in a ``sliding_window`` cache,
        which cannot be cut back: there the prompt but its last token is saved
        before the answer, so that the same prompt sent again (an agent's next
        session) or continued restores it and evaluates from its last token.
        ``cache_written`` counts the prompt tokens those saves add beyond the
        reused ones.
        """
        self.cache_written = 0
        self._saves = []
        shared = shared_prefix(tokens, self.cached)
        keep = self.reusable(min(shared, len(tokens) - 1))  # what the slot can serve: a saved state must beat that
        cache = self.state_cache
        if cache is not None:
            keep, branch = self._restore(tokens, keep, _branch(shared, tokens, self.cached))
            # A point at or past the last token would save none of this prompt's work.
            self._saves = sorted(p for p in {branch, *save_at} if max(keep, MIN_TOKENS) <= p < len(tokens))
            if self.sliding_window and len(tokens) > MIN_TOKENS:
                self._saves = sorted({*self._saves, len(tokens) - 1})
        keep = self.reusable(keep)
        # A point a saved state serves already is not saved again: one that holds that very prefix, or (in a cache
        # that can be cut back) one that goes on past it by an eighth of it at most, such as the last turn's prompt
        # and answer where the next turn parts from them, saved or still held by this slot (saving nearly the same
        # state again cost that turn 30-40 ms before its first new token, and as much memory again). Where a
        # longer conversation goes on past it (a system prompt others will share), the prefix is saved: restoring
        # it is the smaller copy.
        held, held_shared = len(self.cached), shared_prefix(tokens, self.cached)
        self._saves = [p for p in self._saves if not (
            not self.sliding_window and p <= held_shared and held <= p + p // 8
            or cache.covers(tokens[:p], self.scope, within=0 if self.sliding_window else p // 8))]
        del self.cached[keep:]
        if cache is not None and len(tokens) >= MIN_TOKENS and any(p >= len(tokens) for p in save_at):
            self.cache_written = len(tokens) - keep  # the whole prompt: saved with its answer (Session does)
        if self._saves:
            self.cache_written = max(self.cache_written, self._saves[-1] - keep)
        return keep

    def evaluate(self, tokens: Sequence[int], cancelled: Callable[[], bool] = lambda: False,
                 chunk: Optional[int] = None) -> None:
        """The rest of a prefill (after ``reuse``): the prompt past what the slot holds, in chunks, asking
        ``cancelled`` between two C calls, saving its prefix at the save points ``reuse`` chose."""
        start, saves = len(self.cached), self._saves
        while start < len(tokens):
            if saves and start >= saves[0]:  # a point inside an image is passed by
                if saves.pop(0) == start:
                    self.keep_state(waited_for=True)
                continue
            if cancelled():
                raise Cancelled()
            if tokens[start] < 0:
                start += self.decode_media(tokens, start)
                continue
            end = start + (chunk or self.prefill_chunk)  # asked each time: it may depend on what else runs
            if saves:
                end = min(end, saves[0])
            media = next((i for i in range(start, min(end, len(tokens))) if tokens[i] < 0), None)
            self.decode(tokens[start:end if media is None else media])
            start = end if media is None else media

    def _restore(self, tokens: Sequence[int], keep: int, branch: int) -> tuple[int, int]:
        """Before a prompt overwrites what the slot holds, save that (if it is worth it and not saved yet); then
        restore the saved state that shares most with the prompt, if it shares more than the slot (``branch``:
        where the prompt parts from the slot's tokens). The tokens kept, and where the prompt branches off the
        sequence it shares them with (0: it does not)."""
        cache = self.state_cache
        if len(self.cached) - keep >= MIN_TOKENS:
            self.keep_state(waited_for=True)
        found = cache.find(tokens, self.scope, better_than=keep, whole=self.sliding_window)
        if found is None:
            return keep, branch
        shared, saved, state = found
        try:
            self.load_state(state, saved)
        except EngineError:
            self.cached.clear()  # the cache may hold anything now
            return 0, 0
        return min(shared, len(tokens) - 1), _branch(shared, tokens, saved)

    def reusable(self, keep: int) -> int:
        """How much of ``keep`` cached tokens the next ones can follow: all of them in a full cache; in a
        sliding-window cache, which holds the last window's tokens only, none once it has dropped tokens that
        a shorter prefix's next tokens would attend to."""
        return keep

    def fit(self, prompt: Sequence[int], scope: str) -> int:
        """How many of the prompt's leading tokens this slot holds for it, for the scheduler's choice of a slot: 0
        unless the prompt continues at least SIMILARITY of the slot's cached tokens (a later turn of the slot's
        conversation), in its own scope."""
        if scope != self.scope or not self.cached:
            return 0
        shared = shared_prefix(prompt, self.cached)
        return shared if shared >= SIMILARITY * len(self.cached) else 0

    def enter(self, scope: str) -> None:
        """Work for cache scope ``scope`` (a tenant) from now on: what the slot holds for another scope is saved
        for that scope's next turn, then dropped, so no prompt of this scope reuses it."""
        if scope == self.scope:
            return
        self.keep_state(waited_for=True)
        self.cached.clear()
        self.scope = scope

    def announce_state(self) -> None:
        """Say that what the slot holds is about to be saved (``keep_state``), for prompts in other processes."""
        if self.state_cache is not None:
            self.state_cache.announce(self.cached, self.scope)

    def keep_state(self, waited_for: bool = False) -> None:
        """Save what the slot holds into its state cache, unless it is there already (or too short to be worth it).
        A save a prompt is ``waited_for`` leaves its disk write for the next save that is not, which writes every
        deferred one."""
        cache = self.state_cache
        if cache is None:
            return
        if len(self.cached) >= MIN_TOKENS and not cache.holds(self.cached, self.scope):
            try:
                cache.put(self.cached, self.save_state(), defer_disk=True, scope=self.scope)
            except EngineError:
                cache.withdraw(self.cached, self.scope)  # not saved: its next turn evaluates its prompt again
        if not waited_for:
            cache.write_deferred()

    def _eval_each(self, tokens: Sequence[int], n_past: int) -> np.ndarray:
        """Evaluate ``tokens`` at positions ``n_past``... in one C call; the logits after each (engines that
        ``speculate``)."""
        raise EngineError(f"{type(self).__name__} cannot decode tokens in one call")

    def decode_each(self, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` to the cache in one call; the logits after each of them (one row each, read-only):
        speculative decoding's check of drafted tokens. ``truncate`` then cuts off those the model did not take."""
        try:
            rows = self._eval_each(tokens, len(self.cached))
        except Exception:
            self.cached.clear()  # the cache may hold anything now
            raise
        self.cached.extend(tokens)
        return rows

    def truncate(self, length: int) -> None:
        """Hold only the first ``length`` tokens: the next evaluation writes over the rest, as it does past a
        reused prefix."""
        del self.cached[length:]

    def decode_media(self, tokens: Sequence[int], start: int) -> int:
        """Evaluate the image (or sound) whose placeholders begin at ``start`` of ``tokens``, whole; how many
        tokens it is. EngineError if the engine does not hold it (see ``Engine.media``)."""
        raise EngineError(f"{type(self).__name__} cannot read images")

    def rank(self, tokens: Sequence[int], cancelled: Callable[[], bool] = lambda: False) -> np.ndarray:
        """A reranker's scores of a whole prompt (a query and a document); see Engine.reranker."""
        raise EngineError(f"{type(self).__name__} cannot rank")

    def save_state(self) -> bytes:
        """The KV state of the tokens the slot holds (engines with a state API: see PromptCache)."""
        raise EngineError(f"{type(self).__name__} cannot save its state")

    def load_state(self, state: bytes, tokens: Sequence[int]) -> None:
        """Replace what the slot holds with a saved state of ``tokens``."""
        raise EngineError(f"{type(self).__name__} cannot load a state")

    def generation(self, prompt: list[int], tokenizer: Tokenizer, options: "DecodeOptions", context_length: int,
                   cancelled: Callable[[], bool] = lambda: False, choice: int = 0,
                   save_at: Sequence[int] = ()) -> "Generation":
        """One reply to ``prompt`` on this slot, decoded as ``options`` say: the seam every engine generates
        behind (prompt tokens, sampling and constraint in; text, tokens, logprobs and the finish out). A local
        slot runs the decode loop over its own calls (``Generation``); a remote one hands the whole reply to an
        engine elsewhere."""
        from .generate import Generation  # the decode loop is built on this module's Slot

        return Generation(self, prompt, tokenizer, options, context_length, cancelled, choice, save_at)

    def decode(self, tokens: Sequence[int], pick: Optional[Pick] = None) -> Optional[int]:
        """Append ``tokens`` to the cache and compute the next logits; with ``pick``, return ``pick(logits)``.

        The engine may run ``pick`` in another thread, on logits it does not keep (llama.cpp: in its
        decode thread, before its next call), so that they are read once, where they were written;
        ``logits()`` then has none until the next decode without ``pick``.
        """
        n_past = len(self.cached)
        try:
            picked = self._eval(tokens, n_past, pick)
        except Exception:
            self.cached.clear()  # the cache may hold anything now
            raise
        self.cached.extend(tokens)
        return pick(self.logits()) if pick is not None and picked is None else picked


class Engine(abc.ABC):
    """One loaded model: its tokenizer, its limits, and its slots."""

    name: str
    context_length: int
    tokenizer: Tokenizer
    chat_template: Optional[str]  # the file's own, if it has one
    speculates = False  # its slots decode_each and truncate: speculative decoding can check drafts
    embeds = True  # its slots give embeddings (an engine elsewhere that only generates does not)
    reranker = False  # it scores a query and a document: its slots' embedding() is its classification head's output
    rerank_template: Optional[str] = None  # the file's prompt for a query and a document, if it has one
    modalities: frozenset[str] = frozenset()  # what its prompts may hold besides text: "image", "audio"
    kind: "EngineKind"  # set when its kind loads it

    @abc.abstractmethod
    def new_slots(self, count: int, threads: int) -> list[Slot]:
        """``count`` inference instances; each decode call runs on ``threads`` compute threads."""

    def media(self, data: bytes) -> Media:
        """An image or sound (a file's bytes: PNG, JPEG, ... or WAV, MP3, FLAC) as a prompt holds it; MediaError if
        this model does not take it or it does not decode. Runs in the model's preparation thread."""
        raise MediaError("this model reads text only: it has no multimodal projector (mmproj)")

    def watch_slots(self, added: Callable[[list[Slot]], None]) -> None:
        """Be told (on the event loop) of the slots the engine makes after ``new_slots``: a remote model's worker that
        was away at the load and runs more requests at once than the one slot it was counted as. Local engines
        make none."""

    def close(self) -> None:
        """Free what the engine holds outside Python (its model, contexts and threads); its slots are unusable after."""

    def decode_counts(self) -> tuple[int, int]:
        """Decode calls made since the load, and the sequences (slots) they carried, summed: (0, 0) from an engine
        whose slots decode alone, which does not count them."""
        return 0, 0

    def refusal(self, options: "DecodeOptions") -> Optional[tuple[str, str]]:
        """What of a reply's decoding this engine cannot honour, and why, as (what, why): "seed",
        "repetition_window", "grammar" or "thinking_budget"; None if it honours it all (a local engine does)."""
        return None

    def state_identity(self) -> Optional[str]:
        """What a saved slot state depends on (the model file, the engine's version, the context's parameters),
        once the slots are made; None if the engine cannot save and restore states."""
        return None


class EngineOptions(pydantic.BaseModel):
    """The options an engine kind takes per model (``engine_options`` in a model's settings); none by default."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


@dataclasses.dataclass(frozen=True)
class Fit:
    """What an engine kind makes of a file: why it cannot run it (None: it can), and how it runs it."""

    problem: Optional[str] = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """One engine, as the registry lists it.

    ``engine`` makes a loaded model from (model id, file, context length or
    None for the file's, options); ``options`` validates the per-model options
    it takes. ``fit(path)`` says whether and how it runs a file.
    ``batched``: its slots share one decode call at a time. ``missing`` says how
    to install it where ``available()`` is false.
    """

    name: str
    engine: Callable[[str, Path, Optional[int], Any], Engine]
    fit: Callable[[Path], Fit]
    options: type[EngineOptions] = EngineOptions
    batched: bool = False
    available: Callable[[], bool] = lambda: True
    missing: str = ""
    auto: bool = True  # "auto" may choose it for a file (an engine that only names workers elsewhere may not)

    def check_options(self, options: dict[str, Any]) -> EngineOptions:
        """The options validated; ValueError naming the option that is wrong."""
        try:
            return self.options(**options)
        except pydantic.ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
            raise ValueError(f"engine_options for {self.name}: {problems}") from None

    def load(self, model_id: str, path: Path, context_length: Optional[int], options: dict[str, Any]) -> Engine:
        if not self.available():
            raise EngineError(f"the {self.name} engine is not installed: {self.missing}")
        engine = self.engine(model_id, path, context_length, self.check_options(options))
        engine.kind = self
        return engine
