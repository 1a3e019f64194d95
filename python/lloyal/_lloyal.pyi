"""Type stubs for the native module ``lloyal._lloyal`` (checked by ``mypy.stubtest``)."""

import asyncio
import os
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt

from lloyal.chat import FormattedChat
from lloyal.sampling import SamplingParams
from lloyal.scored import ScoredToken

__version__: str
PORTABLE: bool
BUILD_CPU: str
PREFIX_MIN_SHARED: int
PREFIX_GHOSTS: int
"""What this build's code was compiled for: ``<arch>;<native|portable|target-cpu>;<used>;<checked>``
(comma-separated ``/proc/cpuinfo`` feature names; ``lloyal._cpu`` reads it from the file)."""
__all__ = [
    "BUILD_CPU",
    "PORTABLE",
    "PREFIX_GHOSTS",
    "PREFIX_MIN_SHARED",
    "Admission",
    "AdmissionPlan",
    "Branch",
    "BranchStore",
    "Context",
    "EngineStats",
    "Grammar",
    "KvPressure",
    "LoopWaker",
    "LoraAdapter",
    "Model",
    "PerplexityTracker",
    "PrefixCache",
    "Produced",
    "TextStream",
    "Token",
    "TokenIterator",
    "__version__",
    "_chat_markers",
    "_check_model_file",
    "_parse_chat_output",
    "json_schema_to_grammar",
    "quiesce_callbacks",
    "system_info",
    "validate_sampling_params",
]

def json_schema_to_grammar(schema: str) -> str:
    """GBNF (start rule ``root``) for a JSON schema given as JSON text."""

def system_info() -> str:
    """The backends llama.cpp runs on and their CPU features, as llama.cpp reports them."""

def quiesce_callbacks() -> None:
    """Stop lloyal's threads from calling into Python and wait (GIL released, at most 5 s) for
    the calls under way, and shut every context's engine down, waiting (at most 10 s) for the
    decodes under way; registered with ``atexit`` by ``import lloyal``."""

def validate_sampling_params(params: object) -> None:
    """Raise ``ValueError``/``TypeError`` if ``params`` is not a valid set of sampling parameters."""

def _parse_chat_output(text: str) -> tuple[str, str | None, list[tuple[str, str]]]:
    """Native part of `lloyal.parse_chat_output`: `(content, reasoning_content, [(name, arguments_json)])`."""

def _check_model_file(path: str | os.PathLike[str]) -> None:
    """Raise ``ModelLoadError`` unless ``path`` is a readable GGUF file with a plausible header (the
    check ``Model`` makes before llama.cpp reads a file), without loading it."""

def _chat_markers() -> tuple[list[str], list[str]]:
    """The markers `parse_chat_output` acts on: `(end-of-turn markers it removes, markers from which
    text may be reasoning or a tool call)`."""

@final
class Model:
    """Model weights (thread-safe; shared by every context created from it).

    ``Model(path, *, n_gpu_layers=None, use_mmap=True, repack=True)`` loads (or shares) the
    weights of a GGUF file: a path opened twice loads once. ``n_gpu_layers`` layers run on a GPU
    in a build with a GPU backend; left out, it is ``$LLOYAL_N_GPU_LAYERS`` (0 when unset).
    ``repack=True`` (the default, as in llama.cpp) lets llama.cpp rearrange Q4 weights for its
    fastest CPU matmul, which multiplies rows in groups of 4: a token's logits then depend on
    how many rows share its decode, so contexts of such a model are not batch-invariant; load
    with ``repack=False`` for those.

    Raises:
        ModelLoadError: the file is missing, not a GGUF, or of an unsupported architecture.
        ValueError: ``LLOYAL_N_GPU_LAYERS`` is set to something other than a whole number.

    Example:
        >>> m = Model(default_model_path())
        >>> m.architecture
        'gemma3'
    """

    def __new__(
        cls,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int | None = None,
        use_mmap: bool = True,
        repack: bool = True,
    ) -> Model: ...
    @property
    def repack(self) -> bool:
        """Whether llama.cpp repacked the weights for its fastest (batch-dependent) CPU kernels."""
    @property
    def path(self) -> os.PathLike[str]:
        """Path of the GGUF file."""
    @property
    def n_vocab(self) -> int:
        """Vocabulary size."""
    @property
    def n_ctx_train(self) -> int:
        """Training context length."""
    @property
    def n_embd(self) -> int:
        """Embedding width."""
    @property
    def n_layer(self) -> int:
        """Number of layers."""
    @property
    def n_params(self) -> int:
        """Number of parameters."""
    @property
    def size(self) -> int:
        """Size of the weights in bytes."""
    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the weights' memory the load asked the kernel to back with 2 MiB pages (Linux):
        all the weights with ``use_mmap=False``, the repacked ones with ``use_mmap=True``
        (mapped file pages stay 4 KiB). A decode reads every weight each step, and huge pages
        spare it TLB misses; 0 elsewhere.
        """
    @property
    def architecture(self) -> str:
        """Architecture name from the GGUF metadata (e.g. ``"gemma3"``)."""
    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template, or None."""
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None."""
    def load_lora(self, path: str | os.PathLike[str]) -> LoraAdapter:
        """Load the LoRA adapter at ``path`` for this model (or return the one already loaded
        from that file); apply it with ``Context(model, lora=[adapter])``.

        Raises:
            ModelLoadError: the file is missing, not a GGUF, not a LoRA adapter, made for
                another architecture or with tensors of the wrong shape for this model, or an
                activated LoRA (aLoRA), which lloyal does not apply.
        """

@final
class LoraAdapter:
    """A LoRA adapter loaded for one :class:`Model` (``model.load_lora(path)``); a context applies
    it to every token it decodes when created with ``Context(model, lora=[adapter])``.

    A path loaded twice for the same model gives the same adapter (a new one when the file changed
    in between). It holds its model's weights alive, and the file's metadata (``meta``) can be
    read back. ``Context(model, lora=[(adapter, 0.5)])`` applies it at half its strength.
    """

    @property
    def path(self) -> os.PathLike[str]:
        """The adapter file (absolute)."""
    @property
    def alpha(self) -> float:
        """``adapter.lora.alpha`` from the file (0.0 when absent). llama.cpp multiplies the
        adapter's delta by ``scale * alpha / rank``, or by ``scale`` alone when alpha is 0."""
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value of the adapter file as a string, or None."""
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Context:
    """A llama.cpp context: KV cache, sequences and the flat decode path.

    Always created with a unified KV cache and a full-size SWA cache, so forks share
    prefix cells. A context manager; ``close()`` is idempotent.

    Batch invariance (``batch_invariant=True``): a token's logits do not depend on which other
    rows share its decode (``n_batch``, batched vs single commits, packed prefill) nor on where
    its cells sit in the cache, so greedy output is identical whatever the batching. It takes
    llama.cpp's per-row kernels, about a quarter slower on prompts: weights not repacked (a
    ``Context`` built from a path loads them so), flash attention on its one-row path (the K
    cache defaults to ``q8_0`` for that), and ggml's tiled K-quant matmul off. By default
    (``None``) a context runs llama.cpp's fastest kernels (repacked weights, f16 K cache), unless
    its ``Model`` was loaded with ``repack=False``: then ``None`` turns invariance on when the
    cache types allow it. Float (F32/F16/BF16) weights never allow it: llama.cpp multiplies them
    with one kernel for a single row and another for several.

    ``sampling_perplexity=False``: branches do not keep ``Branch.sampling_perplexity`` (reading
    it raises). That sum over the vocabulary at ``1 / temperature`` is a second exponential a
    value in every decoded row's summary, so a context that never reads it, like the OpenAI
    server's, turns it off. Tokens and ``perplexity`` are the same either way.

    ``pooling`` (for ``embeddings=True``): ``None`` pools the way the model's GGUF declares
    (``<arch>.pooling_type``, e.g. the last token for Qwen3-Embedding), else by mean.

    ``lora``: LoRA adapters applied to every token the context decodes, fixed for its life
    (every KV cell is computed under the same weights): a list of :class:`LoraAdapter`
    (``model.load_lora(path)``), paths (loaded for the model), or ``(adapter or path, scale)``
    pairs; the scale is 1.0 when not given. Other contexts of the same model are unaffected.
    Adapters are float matrices, so a context with them is not batch-invariant.

    Example:
        >>> with Context(default_model_path(), n_ctx=512) as ctx:
        ...     ctx.decode(ctx.tokenize("Hello"), 0)
        ...     token = ctx.sample(temperature=0)
    """

    def __new__(
        cls,
        model: Model | str | os.PathLike[str],
        *,
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        embeddings: bool = False,
        pooling: str | None = None,
        type_k: str | None = None,
        type_v: str = "f16",
        flash_attn: bool = True,
        batch_invariant: bool | None = None,
        sampling_perplexity: bool = True,
        lora: Sequence[
            LoraAdapter | str | os.PathLike[str] | tuple[LoraAdapter | str | os.PathLike[str], float]
        ]
        | None = None,
    ) -> Context: ...
    @classmethod
    def from_path(cls, path: str | os.PathLike[str], **options: Any) -> Context:
        """Create a context from a model path (``Context(path, **options)``)."""
    @property
    def model(self) -> Model:
        """The :class:`Model` this context runs."""
    @property
    def lora(self) -> list[tuple[LoraAdapter, float]]:
        """The LoRA adapters applied to every decode, as ``(adapter, scale)`` pairs (fixed at
        creation; empty without ``lora=``)."""
    @property
    def n_ctx(self) -> int:
        """Total KV cells (tokens) across all sequences."""
    @property
    def n_batch(self) -> int:
        """Most tokens per ``llama_decode`` call."""
    @property
    def n_seq_max(self) -> int:
        """Number of sequence ids (branch leases)."""
    @property
    def n_vocab(self) -> int:
        """Vocabulary size."""
    @property
    def vocab_size(self) -> int:
        """Vocabulary size (alias of ``n_vocab``)."""
    @property
    def n_threads(self) -> int:
        """Threads used for decoding."""
    @property
    def flash_attn(self) -> bool:
        """Whether flash attention is on (default, as in llama.cpp; needed for a quantized
        ``type_v`` and for batch invariance)."""
    @property
    def batch_invariant(self) -> bool:
        """Whether this context runs batch-invariant kernels (see ``Context``)."""
    @property
    def sampling_perplexity(self) -> bool:
        """Whether branches keep their sampling perplexity (see ``Context``)."""
    @property
    def huge_page_bytes(self) -> int:
        """Bytes of llama.cpp's logits buffer (its rows for every sequence, read in place by each
        decode's summary) on 2 MiB pages (Linux, a model on the CPU): put there as the context is
        made, and again after a decode that moves the buffer (more output rows than sequences: its
        first ``n_seq_max`` rows). 0 where THP is ``never``, on kernels before 6.1, or with the
        model's output layer on a GPU."""
    @property
    def device_rows(self) -> bool:
        """Whether decodes summarise each logits row (maximum, log-sum-exps, span maxima) on the
        device that holds the model's output layer instead of on the host: only with
        ``LLOYAL_DEVICE_ROWS=1`` (not yet shown faster on a GPU, docs/performance.md), never for a
        batch-invariant or embeddings context. Same tokens for a seed either way; perplexities agree
        to about 1e-6 relative."""
    @property
    def type_k(self) -> str:
        """K cache element type (``"q8_0"`` by default in a batch-invariant context, else ``"f16"``)."""
    @property
    def type_v(self) -> str:
        """V cache element type."""
    @property
    def embeddings(self) -> bool:
        """Whether this is an embeddings context."""
    @property
    def memory_size(self) -> int:
        """Bytes of KV cache memory."""
    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
    @property
    def eog_token(self) -> int:
        """The end-of-generation token id."""
    @property
    def eog_tokens(self) -> list[int]:
        """Every token :meth:`is_stop_token` holds (the model's end-of-generation tokens), in id
        order: what ``generate(min_tokens=...)`` bans until then.
        """
    @property
    def turn_separator(self) -> list[int]:
        """Tokens that close a turn and lead to the next (``<end_of_turn>\\n`` on Gemma)."""
    @property
    def bos_token(self) -> int:
        """The beginning-of-sequence token id."""
    def format_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> FormattedChat:
        """Render a conversation as a prompt with a Jinja chat template.

        Template: ``template`` (a Jinja string) > the model's own GGUF template > the built-in
        one of the model's family (Gemma, ChatML, Llama 3, Phi-3, Mistral). Templates see ``messages``,
        ``add_generation_prompt``, ``tools``, ``bos_token``, ``eos_token``, and may use
        ``raise_exception(msg)``, ``strftime_now(fmt)``, ``tojson`` and Python string/dict
        methods (``.strip()``, ``.items()``...). The built-in Gemma template folds a leading
        system message into the first user turn and renders content verbatim.

        Tokenize the prompt with ``add_special=False, parse_special=True`` (it holds the BOS
        text and the turn markers).

        Args:
            messages: Dicts with ``role`` and ``content`` (str, None or a list of
                ``{"type": "text", "text": ...}`` parts); optional ``tool_calls``.
            add_generation_prompt: Append the opening of an assistant turn.
            template: A Jinja chat template that overrides the model's.
            tools: JSON-serialisable tool (function) definitions, passed as ``tools``.
            **template_kwargs: More JSON-serialisable template variables (``enable_thinking``,
                ``documents``, ``date_string``, any custom one), as in Hugging Face's
                ``apply_chat_template``.

        Returns:
            The prompt, the stop tokens and where the template came from.

        Raises:
            TypeError: ``messages``/``tools`` are not lists of JSON-serialisable dicts, or a
                template variable is not JSON-serialisable.
            ValueError: A message lacks a string ``role`` or has a bad ``content``, or a
                template variable reuses a name format_chat sets (``bos_token``...).
            ChatTemplateError: The template failed (syntax, ``raise_exception``), or the
                model has no template and no built-in fits (pass ``template=``).
        """
    def format_chat_turn(
        self,
        message: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
    ) -> FormattedChat:
        """Render one new turn exactly as it follows a finished assistant turn.

        For warm multi-turn chat on a live branch: after generating the assistant reply
        (stopped at a stop token, which is not in the KV), prefill ``turn_separator`` and then
        ``tokenize(turn.prompt, add_special=False, parse_special=True)``. The result equals,
        token for token, a cold prefill of ``format_chat`` over the whole conversation with
        the same template: ``template`` > the model's own > its family's built-in. A Jinja
        template that does not render a new turn as a plain continuation (it rewrites earlier
        turns, or refuses the role order) falls back to the built-in one.

        Args:
            message: The new message (usually ``{"role": "user", "content": ...}``).
            add_generation_prompt: Append the opening of the next assistant turn.
            template: The Jinja chat template the conversation was started with, if not the
                model's.

        Returns:
            The turn's text (no BOS, no system/tools preamble) and the stop tokens.

        Raises:
            TypeError: ``message`` is not a dict.
            ValueError: It lacks a string ``role`` or has a bad ``content``.
            ChatTemplateError: The model belongs to no built-in chat family, or ``template``
                does not render a turn as a plain continuation.
        """
    def engine_stats(self) -> EngineStats:
        """The engine's counters: ticks, ``llama_decode`` calls, rows, operations coalesced,
        queue depth. Every ``commit``/``prefill`` (Branch, BranchStore, their ``a*`` forms,
        token iteration) runs on the engine, one scheduler thread per context.

        Example:
            >>> ctx.engine_stats().decode_calls >= 0
            True
        """
    def pause_engine(self) -> None:
        """Hold the engine: submitted operations wait in its queue until ``resume_engine()``.
        Useful to make coalescing deterministic (pause, submit from N callers, resume: one tick).
        """
    def resume_engine(self) -> None:
        """Let the engine tick again after ``pause_engine()``."""
    @property
    def engine_gather(self) -> float:
        """Seconds (0 to 1, default 0.002) a tick waits for as many commits as the previous tick
        decoded, so callers that come back at slightly different times share one decode.
        """
    @engine_gather.setter
    def engine_gather(self, seconds: float) -> None:
        """Seconds (0 to 1, default 0.002) a tick waits for as many commits as the previous tick
        decoded, so callers that come back at slightly different times share one decode.
        """
    @property
    def engine_prefill_chunk(self) -> int | None:
        """Most prompt tokens one engine tick prefills. None (the default) paces them: with
        streams running, each tick carries as many prompt tokens as keep it at about 1.5x a
        decode-only tick, measured as the engine runs; with none running, the tick's
        ``n_batch``. 0 always fills the batch (the most throughput, the longest waits for
        running streams); a number caps every tick at that many.
        """
    @engine_prefill_chunk.setter
    def engine_prefill_chunk(self, tokens: int | None) -> None:
        """Most prompt tokens one engine tick prefills. None (the default) paces them: with
        streams running, each tick carries as many prompt tokens as keep it at about 1.5x a
        decode-only tick, measured as the engine runs; with none running, the tick's
        ``n_batch``. 0 always fills the batch (the most throughput, the longest waits for
        running streams); a number caps every tick at that many.
        """
    def close(self) -> None:
        """Free the context (waits for a running call; idempotent)."""
    def __enter__(self) -> Context: ...
    def __exit__(
        self,
        *_exc: object,
    ) -> bool: ...
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids; ``parse_special`` turns control-token text into control tokens."""
    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """Token ids to text; ``special`` renders control tokens."""
    def token_to_text(self, token: int, special: bool = False) -> str:
        """One token's text (a partial UTF-8 character becomes U+FFFD; use ``text_stream()``)."""
    def token_to_bytes(self, token: int, special: bool = False) -> bytes:
        """One token's bytes as the model's vocabulary holds them (a byte-fallback token's one byte
        of a UTF-8 character, which :meth:`token_to_text` shows as U+FFFD)."""
    def text_stream(self) -> TextStream:
        """A UTF-8-safe streaming detokenizer."""
    def is_stop_token(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS/EOT)."""
    def decode(self, tokens: list[int], pos: int, seq_id: int = 0) -> None:
        """Decode ``tokens`` on ``seq_id`` starting at ``pos`` (chunked by n_batch; all-or-nothing)."""
    def sample(
        self,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        grammar: Grammar | None = None,
        logits: npt.NDArray[np.float32] | None = None,
        **overrides: Any,
    ) -> int:
        """Sample from the last decode's logits; the token joins the penalty history.

        ``logits=`` samples from that float32 array (length n_vocab, e.g. a modified copy of
        ``get_logits()``) instead. ``grammar=`` masks every token the grammar forbids first;
        the grammar is not advanced: call ``grammar.accept(token)`` yourself.
        """
    def clear_and_reseed(self, sinks: list[int], tail: list[int]) -> int:
        """BlinkKV: clear the cache, decode ``sinks`` at 0 and ``tail`` after them on seq 0
        (sampler history kept); returns the next position, ``len(sinks) + len(tail)``.
        """
    def reset_sampler(self) -> None:
        """Forget the flat sampler's penalty history and RNG state."""
    def get_logits(self) -> npt.NDArray[np.float32]:
        """The last decode's logits: a read-only float32 array of shape ``(n_vocab,)``."""
    def model_entropy(self, base: str = "nats") -> float:
        """Entropy of the next-token distribution, in ``"nats"`` or ``"bits"``."""
    def model_surprisal(self, token: int, base: str = "nats") -> float:
        """Surprisal ``-log p(token)`` under the last logits, in ``"nats"`` or ``"bits"``."""
    def create_grammar(self, gbnf: str, root: str = "root") -> Grammar:
        """Parse GBNF rules into a :class:`Grammar` handle (``GrammarError`` if invalid)."""
    def create_perplexity_tracker(self) -> PerplexityTracker:
        """A new, empty perplexity tracker."""
    def kv_cache_size(self, seq_id: int = 0) -> int:
        """Largest position stored for ``seq_id`` (-1 when empty)."""
    def kv_seq_pos_max(self, seq_id: int) -> int:
        """Largest position stored for ``seq_id`` (-1 when empty)."""
    def kv_cache_clear(self) -> None:
        """Empty every sequence (refused while a branch holds one)."""
    def kv_cache_remove(self, seq_id: int, start: int, end: int = -1) -> None:
        """Remove positions ``[start, end)`` of ``seq_id``; ``end=-1`` means to the end."""
    def kv_seq_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Share ``src``'s cells ``[p0, p1)`` with ``dst`` (metadata only, no tensor copy)."""
    def kv_seq_keep(self, seq_id: int) -> None:
        """Keep only ``seq_id``; drop every other sequence's cells."""
    def kv_cache_save(self, seq_id: int = 0) -> bytes:
        """``seq_id``'s KV cells (via ``llama_state_seq_get_data``) in a verified envelope.

        Format (little-endian): magic ``LLOYALKV``, u32 version (1), the model's fingerprint
        (i32 n_vocab, i32 n_embd, u32 n_layer, u64 n_params, 32-byte NUL-padded
        architecture), i32 smallest and largest position, u32 token count, u64 payload
        length, the tokens (i32 each), llama.cpp's payload, and a trailing u64 FNV-1a 64 of
        every preceding byte. No logits are saved.

        Raises:
            ValueError: ``seq_id`` outside ``[0, n_seq_max)``.
        """
    def kv_cache_load(self, seq_id: int, data: bytes) -> None:
        """Replace ``seq_id``'s cells with bytes from :meth:`kv_cache_save`.

        The envelope is verified (magic, version, lengths, checksum, model fingerprint)
        before llama.cpp sees the payload. On any failure ``seq_id`` is left empty and no
        other sequence changes. No logits are restored: decode the next token to get some.

        Raises:
            StateError: truncated, corrupt or foreign bytes, or llama.cpp refused the payload
                (another cache type, too few free cells).
            SeqLeasedError: a live branch holds ``seq_id`` (nothing is changed).
        """
    def kv_cache_write_file(self, seq_id: int, path: str | os.PathLike[str], tokens: list[int]) -> None:
        """Save ``seq_id``'s cells with ``tokens`` (the text they came from) to ``path``.

        Same format as :meth:`kv_cache_save`; written to a temporary file and renamed, so
        ``path`` never holds a half-written state.
        """
    def kv_cache_read_file(self, seq_id: int, path: str | os.PathLike[str]) -> list[int]:
        """Load a file from :meth:`kv_cache_write_file` into ``seq_id``; returns its tokens.

        Raises:
            OSError: the file cannot be read (nothing is changed).
            StateError: as :meth:`kv_cache_load` (``seq_id`` is left empty).
            SeqLeasedError: a live branch holds ``seq_id``.
        """
    @property
    def embedding_dimension(self) -> int:
        """Width of one embedding vector (``n_embd``; 640 for Gemma 3 270M)."""
    def encode(self, tokens: list[int], seq_id: int = 0) -> None:
        """Compute embeddings of ``tokens`` on ``seq_id`` (needs ``embeddings=True``).

        Clears ``seq_id``, decodes ``tokens`` from position 0, keeps the vectors for
        :meth:`get_embeddings`, then clears the sequence again (no cells are left behind).
        With pooling ``"mean"``/``"cls"``/``"last"`` the tokens must fit in one decode
        (``n_batch``); with ``"none"`` longer runs are chunked.

        Raises:
            ValueError: not an embeddings context, empty ``tokens``, too many tokens, or a
                ``seq_id`` outside ``[0, n_seq_max)``.
            InvalidTokenError: a token id outside the vocabulary.
            SeqLeasedError: a live branch holds ``seq_id``.
            ContextClosedError: the context is closed.
        """
    def get_embeddings(self, normalize: bool = True, seq_id: int = 0) -> npt.NDArray[np.float32]:
        """The vectors of the last :meth:`encode` on ``seq_id``, as a new float32 array.

        Shape ``(embedding_dimension,)`` when pooled, ``(n_tokens, embedding_dimension)``
        with ``pooling="none"``. ``normalize`` scales each row to unit L2 norm.

        Raises:
            ValueError: not an embeddings context, or no ``encode`` ran on ``seq_id``.
        """
    def embed(self, texts: str | list[str], normalize: bool = True) -> npt.NDArray[np.float32]:
        """Pooled embeddings of ``texts`` (tokenized with BOS); needs ``embeddings=True``.

        One ``str`` gives shape ``(embedding_dimension,)``; a list gives
        ``(len(texts), embedding_dimension)`` in input order. Texts are packed across the
        free sequences (not leased by a branch and empty) into as few ``llama_decode`` calls
        as ``n_batch`` and those sequences allow (one when all fit), and the sequences are
        cleared after reading; other sequences are not touched.

        Raises:
            ValueError: not an embeddings context, pooling ``"none"``, a text longer than
                ``n_batch`` tokens, or no empty sequence to borrow.
            SeqLeasedError: no sequence is free and a live branch holds one.
            KvCacheFullError: the cache has no room for a group of texts.
        """

@final
class PrefixCache:
    """Finished requests' branches kept for their KV, found by the longest shared token prefix.

    The engine evicts least recently used entries that nothing forks (leaves, unpinned) when a
    branch, a prompt or a token needs a lease or cells that are not free, and prunes released
    branches once nothing depends on them.

    Example:
        >>> from lloyal._lloyal import PrefixCache
        >>> with Context(default_model_path(), n_seq_max=4) as ctx:
        ...     cache = PrefixCache(ctx)
        ...     b = Branch.create(ctx, 0, SamplingParams(temperature=0))
        ...     b.prefill(list(range(100, 120)))
        ...     kept = cache.add(b, list(range(100, 120)))
        ...     hit = cache.lookup(list(range(100, 130)))
        ...     (hit[1], hit[2])
        (20, 20)
    """

    def __new__(cls, ctx: Context) -> PrefixCache: ...
    def lookup(self, tokens: list[int]) -> tuple[Branch, int, int] | None:
        """``(branch, used, length)`` of the entry a request for ``tokens`` forks, pinned (call
        :meth:`unpin` once forked): fork it whole when ``used == length``, else
        ``fork(at=used)``. ``None`` when no entry shares enough of ``tokens``.
        """
    def record(self, hit: int, prompt: list[int]) -> None:
        """Count a request's prompt, ``hit`` of whose tokens came from the cache."""
    def add(self, branch: Branch, tokens: list[int]) -> bool:
        """Keep ``branch`` (holding exactly ``tokens``) as an entry; ``False`` when an entry
        already holds these tokens (``branch`` is then released instead).
        """
    def release(self, branch: Branch) -> None:
        """Prune ``branch`` once nothing depends on it (no live fork, no pin)."""
    def pin(self, branch: Branch) -> None:
        """A request is about to fork ``branch``: it is not pruned or evicted until :meth:`unpin`."""
    def unpin(self, branch: Branch) -> None:
        """Undo one pin (or a lookup's)."""
    @property
    def budget(self) -> int | None:
        """Most KV cells the entries keep of their own (``None``: no limit); least recently used
        entries are evicted to keep within it.
        """
    @budget.setter
    def budget(self, cells: int | None) -> None:
        """Most KV cells the entries keep of their own (``None``: no limit); least recently used
        entries are evicted to keep within it.
        """
    def follow_reuse(self) -> None:
        """Keep the :attr:`budget` at ``n_ctx`` times ``stats()["reuse"]`` (the share of recent
        prompts the cache served or, trimmed less, would have), recomputed at every trim (the
        end of each tick, each ``add`` or ``release``) until a budget is set; and keep at most
        as many entries nothing forks (a conversation's turns count once) as the last 16
        hits reached back (1 + the entries used since the newest holding what a hit
        reused), since every kept cell slows every decode a little.
        """
    @property
    def host_budget(self) -> int:
        """Most bytes of host memory the copies of evicted entries hold (0, the default: none are
        kept). An entry evicted for room is copied first (its cells, sampler and logits), and a
        request that would reuse more of a copy than of any live entry writes it back instead of
        prefilling those tokens again (as llama-server's ``--cache-ram``); least recently used
        copies go to keep within it.
        """
    @host_budget.setter
    def host_budget(self, bytes: int) -> None:
        """Most bytes of host memory the copies of evicted entries hold (0, the default: none are
        kept). An entry evicted for room is copied first (its cells, sampler and logits), and a
        request that would reuse more of a copy than of any live entry writes it back instead of
        prefilling those tokens again (as llama-server's ``--cache-ram``); least recently used
        copies go to keep within it.
        """
    def amake_room(self, *, leases: int = 0, cells: int = 0) -> Coroutine[Any, Any, None]:
        """Await room for ``leases`` more branches and ``cells`` more KV cells, evicting entries
        if need be; raises ``LeaseExhaustedError`` or ``KvCacheFullError`` when even an empty
        cache would not make it.
        """
    def clear(self) -> None:
        """Prune every entry and released branch (with their forks), and drop the host tier's copies."""
    def entries(self) -> list[tuple[Branch, list[int]]]:
        """Every entry: ``(branch, tokens)``, in no particular order."""
    def __len__(self) -> int: ...
    def stats(self) -> dict[str, int | float]:
        """Counters: ``entries``, ``released`` (released branches not pruned yet: something still
        forks or pins them), ``hit_tokens`` (prompt tokens served from the cache),
        ``lookup_tokens`` (prompt tokens looked up), ``evictions``, and ``reuse`` (moving average
        of the share of recent prompts the cache served, or an entry it evicted would have; about
        the last 10 prompts count); and of the host tier (:attr:`host_budget`): ``host_entries``
        and ``host_bytes`` (copies kept now), ``host_kept`` (entries copied as they were
        evicted), ``host_restored`` (copies written back), ``host_restored_tokens`` (prompt
        tokens they served) and ``host_dropped`` (copies dropped for the budget).
        """

@final
class Admission:
    """When and from what generation requests start: at most ``max_running`` choices run; a
    request forks the longest cached prefix of its prompt or, when a running request is still
    writing a prompt that shares more, that prompt once written; what it needs is reserved
    from :meth:`plan` until its branches exist.

    Example:
        >>> from lloyal._lloyal import Admission
        >>> with Context(default_model_path(), n_seq_max=4) as ctx:
        ...     book = Admission(ctx, 3)
        ...     plan = book.plan(list(range(100, 120)), 2)
        ...     book.reserve(plan)
        ...     (plan.base, plan.leases, plan.cells, book.plan([1, 2], 2))
        (None, 3, 21, None)
    """

    def __new__(cls, ctx: Context, max_running: int) -> Admission: ...
    @property
    def max_running(self) -> int:
        """The most choices running at once."""
    @property
    def running(self) -> int:
        """Choices running now (admitted, not yet released)."""
    @property
    def reserved(self) -> tuple[int, int, int]:
        """``(choices, leases, cells)`` reserved by requests being admitted."""
    def check(self, best_of: int) -> None:
        """Raise ``ValueError`` when a request of ``best_of`` choices can never run here."""
    def must_wait(self, best_of: int, waiting: int) -> bool:
        """Whether a request of ``best_of`` choices would queue: behind ``waiting`` others, or for
        a free slot.
        """
    def plan(self, prompt: list[int], best_of: int, share: bool = True) -> AdmissionPlan | None:
        """The terms on which a request for ``prompt`` with ``best_of`` choices starts now, the
        branch it forks pinned; ``None`` when it must wait (no free slot, or the prompt in
        flight it would fork is not written yet). Await room for the plan's ``leases`` and
        ``cells``, then :meth:`reserve` it; :meth:`release` it in every case. ``share=False``:
        the request forks nothing and writes its whole prompt (one scored token by token).
        """
    def arestore(self, plan: AdmissionPlan) -> Coroutine[Any, Any, Branch]:
        """Await the prefix cache's host-memory copy that a plan with :attr:`AdmissionPlan.restores`
        reuses, written back into the context after its room was found and reserved: the branch
        holding it (a cache entry again, pinned until the plan is admitted or released), to fork
        as another plan forks :attr:`AdmissionPlan.base`. Once per plan.
        """
    def reserve(self, plan: AdmissionPlan) -> None:
        """The room was found: hold the plan's need from later requests, and make its prompt one
        that arriving requests fork once written rather than write again.
        """
    def holds(self, plan: AdmissionPlan, branch: Branch) -> None:
        """``branch`` will hold the plan's prompt (its one choice, or its ``best_of`` root)."""
    def written(self, plan: AdmissionPlan) -> bool:
        """The plan's prompt is written: whether requests wait for it (wake them)."""
    def admitted(self, plan: AdmissionPlan) -> None:
        """The plan's branches exist: its pins and reservation go, its choices count as running."""
    def finish(
        self,
        plan: AdmissionPlan,
        choices: list[tuple[Branch, list[int], float]],
        root: Branch | None,
        *,
        n: int,
        rank: bool,
        keep_best: bool,
    ) -> tuple[list[int], list[float]]:
        """The request ended with ``choices`` (each ``(branch, generated tokens, perplexity)``):
        ``(kept, perplexities)``, the ``n`` choice indices it returns, best first, and the
        perplexities it ranked by (empty when unranked). Ranked by perplexity (lowest first; one
        that generated nothing last) when ``rank`` or more than ``n`` ran. The best choice's
        branch stays in the prefix cache holding the prompt and its tokens (unless not
        ``keep_best``: a cancelled request), the others are released, ``root`` (holding just the
        prompt) is cached, and the plan is released.
        """
    def release(self, plan: AdmissionPlan) -> bool:
        """The request finished or failed: whatever its plan holds goes (pins, reservation,
        running choices, its prompt in flight). Whether it held anything still.
        """

@final
class AdmissionPlan:
    """The terms a request is admitted on (:meth:`Admission.plan`)."""

    @property
    def base(self) -> Branch | None:
        """The branch to fork (``None``: a new branch)."""
    @property
    def at(self) -> int | None:
        """Fork :attr:`base` at this position (``None``: whole, with its logits)."""
    @property
    def restores(self) -> bool:
        """The request starts from a prefix cache entry evicted to host memory, written back by
        :meth:`Admission.arestore` (:attr:`base` is ``None`` until then).
        """
    @property
    def reused(self) -> int:
        """Prompt tokens reused (from the cache, or from a prompt in flight)."""
    @property
    def exact(self) -> bool:
        """The prompt is exactly a cached entry, forked whole: nothing to prefill."""
    @property
    def best_of(self) -> int:
        """Choices the request runs."""
    @property
    def leases(self) -> int:
        """Leases to have free before starting (this request's and those reserved before it)."""
    @property
    def cells(self) -> int:
        """KV cells to have free before starting (this request's and those reserved before it)."""

@final
class Grammar:
    """A grammar's parse state: mask logits with ``apply``, advance with ``accept``.

    Every kind runs on llguidance (the mask is applied before every sample): GBNF is translated
    with its meaning kept, and runs on llama.cpp's grammar engine only when asked
    (``from_gbnf(..., engine="llama.cpp")``) or when it uses a construct llguidance cannot express
    (a ``GrammarEngineWarning`` names it; ``engine`` and ``fallback`` say so afterwards).

    Example:
        >>> g = Grammar.from_json_schema(ctx, {"type": "boolean"})
        >>> logits = ctx.get_logits().copy()
        >>> g.apply(logits)  # forbidden tokens become -inf
        >>> g.allows(ctx.tokenize("true", add_special=False)[0])
        True
        >>> g.kind
        'json_schema'
    """

    @staticmethod
    def from_json_schema(ctx_or_model: Context | Model, schema: str | Mapping[str, Any]) -> Grammar:
        """A grammar for the JSON documents ``schema`` (a dict or JSON text) describes, compiled by
        llguidance for the model of ``ctx_or_model``: ``$ref``/``$defs``, ``anyOf``/``oneOf``,
        ``pattern``, ``format``, numeric bounds, ``minItems``/``maxItems``,
        ``additionalProperties``. Read as llama.cpp's converter reads a schema: an object that
        lists ``properties`` and says nothing of other keys takes no others, ``oneOf`` is
        ``anyOf``, keywords and formats llguidance does not implement are ignored; output is
        compact (no whitespace outside strings). The schema's ``x-guidance`` entry overrides
        these options. An invalid schema, or one beyond llguidance's size limits, raises
        ``GrammarError`` with llguidance's reason.
        """
    @staticmethod
    def from_lark(ctx_or_model: Context | Model, lark: str) -> Grammar:
        """A grammar from a Lark grammar in llguidance's dialect (start rule ``start``; lexer
        regexes in ``/.../``, ``%json {...}`` for embedded schemas), for the model of
        ``ctx_or_model``. Invalid grammars raise ``GrammarError`` with llguidance's reason.
        """
    @staticmethod
    def from_regex(ctx_or_model: Context | Model, pattern: str) -> Grammar:
        """A grammar whose whole output matches the regular expression ``pattern`` (Rust
        ``regex`` syntax, anchored at both ends), compiled by llguidance.
        """
    @staticmethod
    def from_gbnf(
        ctx_or_model: Context | Model,
        gbnf: str,
        root: str = "root",
        *,
        engine: Literal["auto", "llguidance", "llama.cpp"] = "auto",
    ) -> Grammar:
        """A grammar from GBNF rules starting at ``root``; same as ``Context.create_grammar``.

        ``engine``: ``"auto"`` (llguidance, translated with GBNF's meaning kept; llama.cpp's
        engine, with a ``GrammarEngineWarning``, for a construct llguidance cannot express),
        ``"llguidance"`` (``GrammarError`` instead of falling back) or ``"llama.cpp"``.
        """
    def clone(self) -> Grammar:
        """An independent copy with the same parse state."""
    def apply(self, logits: npt.NDArray[np.float32]) -> None:
        """Set every forbidden token to ``-inf`` in ``logits`` (float32, length n_vocab), in place."""
    def accept(self, token: int) -> None:
        """Advance past ``token``; a forbidden token raises ``GrammarError``, one outside the
        vocabulary ``InvalidTokenError`` (state unchanged either way).
        """
    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next."""
    def reset(self) -> None:
        """Back to the start."""
    @property
    def kind(self) -> str:
        """What the grammar was built from: ``"gbnf"``, ``"json_schema"``, ``"lark"`` or ``"regex"``."""
    @property
    def engine(self) -> Literal["llguidance", "llama.cpp"]:
        """The engine that runs the grammar: ``"llguidance"`` or ``"llama.cpp"``."""
    @property
    def fallback(self) -> str | None:
        """Why a GBNF grammar runs on llama.cpp's engine although llguidance was wanted (the
        construct llguidance cannot express); ``None`` otherwise.
        """
    @property
    def source(self) -> str:
        """The text the grammar was built from (GBNF rules, JSON schema, Lark grammar or regex)."""
    @property
    def gbnf(self) -> str | None:
        """The GBNF rules (``None`` for other kinds; see ``source``)."""
    @property
    def root(self) -> str | None:
        """The GBNF start rule's name (``None`` for other kinds)."""

@final
class PerplexityTracker:
    """Running perplexity ``exp(mean surprisal)``; ``inf`` before any observation."""

    def __new__(cls) -> PerplexityTracker: ...
    def add_surprisal(self, surprisal: float) -> None:
        """Record one token's surprisal in nats (see ``model_surprisal``): ``>= 0`` (``inf`` for an
        impossible token); NaN or a negative value raises ``ValueError``.
        """
    @property
    def perplexity(self) -> float:
        """``exp(mean surprisal)``, ``inf`` when empty."""
    @property
    def count(self) -> int:
        """Number of surprisals recorded."""
    def clone(self) -> PerplexityTracker:
        """An independent copy."""
    def reset(self) -> None:
        """Forget every observation."""

@final
class TextStream:
    """Turns tokens into text one at a time; a character split across tokens is released
    whole once its last byte arrives.
    """

    def push(self, token: int) -> str:
        """Add a token; return the text it completes (possibly empty)."""
    def flush(self) -> str:
        """Release any incomplete tail (as U+FFFD)."""

@final
class Produced:
    """A sampled-but-not-written token."""

    @property
    def token(self) -> int:
        """Token id."""
    @property
    def text(self) -> str:
        """The token's text (may be a partial UTF-8 character)."""
    @property
    def is_stop(self) -> bool:
        """Whether the token ends generation."""

@final
class Token:
    """A generated (committed) token with its UTF-8-safe text."""

    @property
    def token(self) -> int:
        """Token id."""
    @property
    def text(self) -> str:
        """The text it completes (UTF-8 safe: may be empty mid-character or while it may begin
        a stop string; a matched stop string is included only with
        ``generate(include_stop_str=True)``).
        """
    @property
    def logprob(self) -> float | None:
        """``log_softmax(logits)[token]`` of the logits it was sampled from (``Branch.logits``),
        when ``generate(logprobs=True)``; else None.
        """
    @property
    def top_logprobs(self) -> list[tuple[int, float]] | None:
        """The ``top_logprobs`` most likely ``(token, logprob)`` pairs, best first, when asked;
        else None.
        """

@final
class TokenIterator:
    """Iterator behind ``for tok in branch``, ``branch.generate()`` and ``async for``: a
    generation request the engine runs in Rust (sampling, stops, logprobs), one token each
    time the iterator is asked for one.
    """

    def __iter__(self) -> TokenIterator: ...
    def __next__(self) -> Token: ...
    def __aiter__(self) -> TokenIterator: ...
    def __anext__(self) -> Awaitable[Token]: ...
    def close(self) -> None:
        """Stop generating: the request is freed at the engine's next tick and the branch stays
        at the last token yielded. Idempotent; ``break`` and dropping the iterator do the same.
        (A task cancelled while it awaits a token can leave the branch one token past: the
        engine may have committed the token it asked for; ``lookahead=k`` up to ``k``.)
        """
    @property
    def finish_reason(self) -> str | None:
        """Why generation ended: ``"stop"`` (a stop token or stop string), ``"length"``
        (``max_tokens``) or ``"eog"`` (the model's end-of-generation token); None while
        running or after ``close()``.
        """
    @property
    def perplexity(self) -> float | None:
        """The branch's perplexity (as :attr:`Branch.perplexity`) when its generation request ended
        (with a :attr:`finish_reason`, or with an error such as ``KvCacheFullError``), read without
        waiting for the engine; None while running or when closed before its end.
        """
    @property
    def committed(self) -> int | None:
        """How many of the yielded tokens the branch holds when its generation request ended: all
        of them, unless ``commit_last=False`` (then a token may be yielded before its decode,
        and the one that reaches ``max_tokens`` is never decoded); None while running or when
        closed before its end.
        """

@final
class LoopWaker:
    """Wakes one asyncio event loop from lloyal's engine thread without the GIL: the engine
    queues the futures to settle and writes a byte to a socket the loop watches; the loop
    calls ``drain()`` when ``fileno()`` is readable. Made by ``lloyal.aio``; Unix only.
    """

    def __init__(self) -> None: ...
    def fileno(self) -> int:
        """The file descriptor the event loop watches for reading."""
    def drain(self) -> None:
        """Settle every queued future (called by the event loop when ``fileno()`` is readable)."""

@final
class Branch:
    """A leased KV sequence with its own sampler, logits snapshot, metrics and tree links.

    Example:
        >>> with Context(default_model_path(), n_seq_max=4) as ctx:
        ...     root = Branch.create(ctx, 0, SamplingParams(temperature=0))
        ...     root.prefill(ctx.tokenize("Hello"))
        ...     child = root.fork()
        ...     child.commit(child.produce().token)
    """

    @classmethod
    def create(
        cls,
        ctx: Context,
        position: int = 0,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        grammar: str | Grammar | None = None,
        timeout: float | None = 0.0,
    ) -> Branch:
        """Create a root branch on ``ctx`` at ``position`` (takes a lease; its sequence starts empty).

        ``grammar`` (GBNF text with a ``root`` rule, or a :class:`Grammar` whose state is
        copied) constrains every sampled token; forks inherit a copy of its state. Sequence ids
        holding flat-path cells (``Context.decode``) are skipped, never wiped.

        ``timeout`` (seconds) waits for a lease when none is free: 0 (the default) does not
        wait, None waits as long as it takes. Waiting calls are served first come, first
        served by the context's engine, with the GIL released (Ctrl-C gives up).

        Raises:
            LeaseExhaustedError: every sequence id of the context is leased or holds flat-path
                cells (and stayed so for ``timeout`` seconds).
            ValueError: a negative ``timeout``.
        """
    @classmethod
    def acreate(
        cls,
        ctx: Context,
        position: int = 0,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        grammar: str | Grammar | None = None,
        timeout: float | None = 0.0,
    ) -> Coroutine[Any, Any, Branch]:
        """Await ``create(ctx, position, params, grammar=grammar, timeout=timeout)`` without
        blocking the event loop (as :meth:`afork`).
        """
    def fork(
        self, clone_logits: bool = True, *, at: int | None = None, timeout: float | None = 0.0
    ) -> Branch:
        """A child sharing this branch's KV prefix (no tensor copy); sampler, metrics, logit bias
        and (if ``clone_logits``) logits are cloned. Takes a lease.

        ``at`` (``1 <= at <= position``) shares only the first ``at`` positions: the child
        starts at position ``at`` with no logits (prefill before sampling), no grammar and fresh
        metrics; its sampler, penalty history and logit bias are cloned. A prefix cache uses it
        to reuse the common part of a cached sequence.

        ``timeout`` (seconds) waits for a lease when none is free: 0 (the default) does not
        wait, None waits as long as it takes; waiting forks and creates are served first come,
        first served (a fork also waits for this branch's prefill in flight).

        Raises:
            LeaseExhaustedError: no lease is free (within ``timeout``).
        """
    def prune(self) -> None:
        """Dispose this branch (RESTRICT: ``TopologyError`` while children live). Idempotent."""
    def prune_subtree(self) -> None:
        """Dispose this branch and every descendant (CASCADE). Idempotent."""
    def produce(self) -> Produced:
        """Sample the next token without writing anything (idempotent until state changes)."""
    def sample(self) -> int:
        """The token ``produce()`` would return."""
    def accept(self, token: int) -> None:
        """Record ``token`` in the sampler history, grammar and metrics without decoding it."""
    def commit(self, token: int) -> None:
        """Accept ``token``, decode it, and capture the new logits; on failure nothing changes.

        Runs on the context's engine: commits and prefills that other threads or tasks
        submit meanwhile share its ``llama_decode``.
        """
    def prefill(self, tokens: list[int]) -> None:
        """Write ``tokens`` to this branch's KV (not accepted into penalties/perplexity).

        Runs on the context's engine in chunks of at most ``n_batch`` tokens per tick, each
        sharing its ``llama_decode`` with other callers' commits.
        """
    def verify(self, draft_tokens: list[int]) -> int:
        """Speculative check of ``draft_tokens`` in one decode (the bonus token in a second); returns
        how many were accepted.

        Keeps the longest prefix of the drafts that this branch's sampler agrees with, removes
        the rejected drafts' cells, and commits the sampler's own next token (the bonus, see
        ``last_token``); an end-of-generation token ends the walk as the bonus, even when it was
        drafted (no draft after it is kept). Greedy output equals plain greedy decoding (on a
        batch-invariant context; the default kernels may round a batch of rows differently,
        which can flip a near tie).

        Runs on the context's engine: the drafts decode in one tick and the bonus in the next,
        each sharing its ``llama_decode`` with other callers' rows; a failure (or Ctrl-C) leaves
        the branch as it was.
        """
    @property
    def last_token(self) -> int | None:
        """The most recently accepted token (``None`` before any)."""
    def score(self, tokens: list[int], top_logprobs: int = 0) -> list[ScoredToken]:
        """Write ``tokens`` as :meth:`prefill` does and score each one: a
        :class:`~lloyal.ScoredToken` ``(logprob, top, rank)``, its ``log_softmax`` under the
        logits before it (for the first, the branch's logits; ``None`` on a branch without any),
        the ``top_logprobs`` most likely ``(token, logprob)`` pairs there, best first (0 to 20),
        and its rank there (1 + the tokens with a higher logit, as vLLM counts it; ``None`` with
        the logprob). A prompt's logprobs, as OpenAI's ``echo`` and vLLM's ``prompt_logprobs``
        report them.

        Runs on the context's engine as a prefill whose rows all keep logits, 64 rows a tick
        (each costs the output layer; shared among the decode's threads); a failure leaves the
        branch as it was.

        Example:
            >>> scored = branch.score(ctx.tokenize(" and the cat", add_special=False), top_logprobs=2)
            >>> len(scored), len(scored[0].top), scored[0].rank >= 1, branch.position
            (3, 2, True, 13)
        """
    def ascore(self, tokens: list[int], top_logprobs: int = 0) -> Coroutine[Any, Any, list[ScoredToken]]:
        """Await ``score(tokens, top_logprobs)``: queued on the context's engine, the event loop
        keeps running; cancelling the awaiting task withdraws it (one in flight is rolled back)."""
    def averify(self, draft_tokens: list[int]) -> Coroutine[Any, Any, int]:
        """Await ``verify(draft_tokens)``: queued on the context's engine, the event loop keeps
        running; the number of drafts accepted."""
    def aprefill(self, tokens: list[int]) -> Coroutine[Any, Any, None]:
        """Await ``prefill(tokens)``: queued on the context's engine, the event loop keeps running."""
    def afork(
        self, clone_logits: bool = True, *, at: int | None = None, timeout: float | None = 0.0
    ) -> Coroutine[Any, Any, Branch]:
        """Await ``fork(clone_logits, at=at, timeout=timeout)`` without blocking the event loop:
        made at once when the engine is between ticks, else by the engine before its next tick;
        a fork waiting for a lease is an engine request. Cancelling the task withdraws it (a
        branch made meanwhile is pruned).
        """
    def aprune(self) -> Coroutine[Any, Any, None]:
        """Await ``prune()`` without blocking the event loop: it runs at once when the engine is
        between ticks, else the engine runs it before its next tick.
        """
    def aprune_subtree(self) -> Coroutine[Any, Any, None]:
        """Await ``prune_subtree()`` without blocking the event loop (as :meth:`aprune`)."""
    def acommit(self, token: int) -> Coroutine[Any, Any, None]:
        """Await ``commit(token)``: queued on the context's engine, the event loop keeps running."""
    def reseed(self, sinks: list[int], tail: list[int]) -> int:
        """BlinkKV: replace this branch's sequence with ``sinks + tail``; returns the new position.

        The tokens go to positions ``0..len(sinks) + len(tail)``; sampler history and metrics are
        kept. Needs ``len(sinks) + len(tail)`` free cells once this branch's own cells are freed
        (``KvCacheFullError`` up front otherwise, nothing changed), so it works on a full
        cache. When a lease and enough cells are free to keep the old cells until the new
        ones are written, a failed decode (or Ctrl-C) restores the branch; otherwise it leaves
        the branch empty at position 0. Runs on the context's engine, written like a prefill.

        Example:
            >>> branch.reseed(tokens[:4], tokens[-8:])  # sinks + recent tail
            12
        """
    def reseed_sampler(self, seed: int) -> None:
        """Restart the sampler's RNG with ``seed`` (history kept)."""
    def set_sampler_params(
        self, params: SamplingParams | dict[str, Any] | None = None, **overrides: Any
    ) -> None:
        """Replace the sampling parameters (penalty history and RNG kept).

        A ``SamplingParams`` replaces all of them (keyword overrides then apply on top);
        keyword overrides alone change only those fields of the current parameters. Nothing
        is rebuilt when the parameters are unchanged.

        Example:
            >>> branch.set_sampler_params(temperature=0.2)  # top_k, top_p... unchanged
        """
    def save_state(self) -> bytes:
        """The branch as bytes: KV cells, position, sampler (parameters, history, RNG), grammar,
        metrics, biases and logits; ``Branch.load_state`` resumes it in any process.
        """
    @staticmethod
    def load_state(ctx: Context, data: bytes) -> Branch:
        """A new root branch on ``ctx`` from ``Branch.save_state()`` bytes (takes a lease).
        Corrupt, truncated or foreign data raises ``StateError`` and changes nothing.
        """
    def set_grammar(self, grammar: str | Grammar | None) -> None:
        """Constrain sampling with a grammar (GBNF text or a :class:`Grammar`, whose state is
        copied), or remove it with ``None``. Forks inherit a copy.
        """
    @property
    def grammar_resamples(self) -> int:
        """Sampled tokens a GBNF grammar rejected so far (each cost a full vocabulary mask); always 0
        under llguidance grammars, which mask before sampling.
        """
    def set_sampling(
        self,
        params: SamplingParams,
        *,
        seed: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        grammar: str | Grammar | None = None,
        fresh: bool = False,
    ) -> None:
        """Replace the whole sampling setup in one call (one wait for the context while the
        engine is busy, instead of one per setter): the parameters, the logit bias (None: no
        bias) and the grammar (GBNF text or a :class:`Grammar`; None: none); ``seed`` restarts
        the RNG (None: kept). ``fresh``: also forget the penalty history and the perplexities,
        as a new branch after its prefill has none (for a fork of a branch that sampled
        before). Everything is checked first: on an error nothing changes.

        Example:
            >>> branch.set_sampling(SamplingParams(temperature=0.0), seed=7, logit_bias={})
        """
    def aset_sampling(
        self,
        params: SamplingParams,
        *,
        seed: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        grammar: str | Grammar | None = None,
        fresh: bool = False,
    ) -> Coroutine[Any, Any, None]:
        """Await ``set_sampling(params, seed=seed, logit_bias=logit_bias, grammar=grammar,
        fresh=fresh)`` without blocking the event loop: it runs at once when the engine is
        between ticks, else the engine runs it before its next tick. GBNF text is compiled
        before that, on the calling thread (a :class:`Grammar` made ahead, off the loop, keeps
        it free).
        """
    def set_logit_bias(self, bias: Mapping[int, float]) -> None:
        """Set ``{token: bias}`` added to the logits before sampling; inherited by forks; ``-inf`` bans."""
    def steer(self, bias: Mapping[int, float]) -> None:
        """Set per-branch steering ``{token: bias}`` (not inherited by forks)."""
    def clear_steer(self) -> None:
        """Remove steering."""
    @property
    def logits(self) -> npt.NDArray[np.float32]:
        """A float32 copy of the current logits, shape ``(n_vocab,)``."""
    def set_logits(self, logits: npt.ArrayLike) -> None:
        """Replace the logits snapshot (shape ``(n_vocab,)``; any real dtype, read as float32)."""
    def model_entropy(self, base: str = "nats") -> float:
        """Entropy of the next-token distribution in ``"nats"`` or ``"bits"``."""
    def model_surprisal(self, token: int, base: str = "nats") -> float:
        """Surprisal of ``token`` under the current logits."""
    def generate(
        self,
        max_tokens: int | None = None,
        *,
        prompt: list[int] | None = None,
        stop: list[str] | None = None,
        stop_tokens: list[int] | None = None,
        min_tokens: int = 0,
        include_stop_str: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
        timeout: float | None = None,
        lookahead: int = 1,
        reserve: bool = True,
        waited: float = 0.0,
        commit_last: bool = True,
    ) -> TokenIterator:
        """Generate until a stop (not yielded) or ``max_tokens``, committing each token before
        yielding it. The engine samples and commits in Rust, batched with every other
        generation and commit on the context; one token per ``next()`` (``lookahead=k``: up to
        ``k`` tokens ahead of the reader).

        Args:
            max_tokens: Most tokens to yield (None: until a stop).
            prompt: Tokens the engine prefills first, as part of the request (chunked with
                the other requests' steps); None: the branch's prompt is already written.
            stop: Strings that end generation; matched on the detokenized text across token
                boundaries and not yielded (text that may begin one is held back).
            stop_tokens: Token ids that end generation (not committed), besides the model's
                end-of-generation tokens.
            min_tokens: Tokens to generate before the model's end-of-generation tokens and
                ``stop_tokens`` may end it (they are banned until then, and the sampling
                perplexity counts the ban) and before ``stop`` strings are looked for (vLLM's
                ``min_tokens``: a stop string that ends before then does not count, one that
                begins before and ends after does; text that may begin one is held back).
            include_stop_str: Yield a matched ``stop`` string, the text's end (vLLM's
                ``include_stop_str_in_output``).
            logprobs: Give each Token its ``logprob``.
            top_logprobs: Give each Token its ``top_logprobs`` most likely tokens (0 to 20).
            timeout: Seconds the request may wait (FIFO) for room in the KV cache for its
                ``max_tokens`` before failing; None waits as long as it takes.
            lookahead: Tokens the engine may generate before they are read (1: each one when
                asked for). With ``k > 1`` the next token decodes while the reader handles this
                one, and a reader that stops early leaves the branch up to ``k - 1`` tokens past
                the last it read.
            reserve: Hold ``max_tokens`` KV cells for the request from its start (it waits for
                them). False: it starts when one cell is free and takes one per token, and a
                token that finds the cache full raises ``KvCacheFullError`` at its ``next()``
                (the tokens before it were yielded).
            waited: Seconds the request already waited before this call (in a server's queue).
                The engine paces a prompt next to running streams (a few rows a step) unless it is
                older than they are; ``waited`` makes it that much older, so a request that waited
                while others started prefills at full batch.
            commit_last: Commit the token that reaches ``max_tokens`` before yielding it. False:
                it is yielded as soon as it is sampled and never decoded, one decode less for a
                request whose branch is only kept as a prefix (a server's); the branch then ends
                one token short of what was yielded, and its perplexity leaves that token out.
                It also yields the first token after ``prompt`` as the prompt is written, a step
                before its decode (a shorter time to first token); :attr:`TokenIterator.committed`
                says how many of the yielded tokens the branch holds at the end.

        Raises:
            InvalidTokenError: A stop or prompt token is out of the vocabulary.
            KvCacheFullError: At the first ``next()``: ``max_tokens`` can never fit next to the
                branch's cells, or no room came within ``timeout``; later, with
                ``reserve=False``, when the cache filled up.
            ValueError: An empty stop string, ``top_logprobs`` out of range or another iterator
                of this branch still generating (at the first ``next()``), a negative
                ``timeout`` or ``waited``, or a ``lookahead`` below 1.
        """
    def __iter__(self) -> TokenIterator: ...
    def __aiter__(self) -> TokenIterator: ...
    @property
    def position(self) -> int:
        """Next position to write."""
    @property
    def fork_head(self) -> int:
        """Position where this branch diverged from its parent."""
    @property
    def perplexity(self) -> float:
        """Model perplexity ``exp(mean surprisal)`` of accepted tokens; ``inf`` before any."""
    @property
    def sampling_perplexity(self) -> float:
        """Perplexity under the sampling distribution (penalties, biases, temperature); ``inf``
        before any accepted token. Raises ``LloyalError`` on a context created with
        ``sampling_perplexity=False``."""
    @property
    def parent(self) -> Branch | None:
        """The parent branch, or None for a root."""
    @property
    def children(self) -> list[Branch]:
        """Live children in fork order."""
    @property
    def is_leaf(self) -> bool:
        """Whether the branch has no live children."""
    @property
    def is_active(self) -> bool:
        """Whether the branch is live (holds a lease)."""
    @property
    def disposed(self) -> bool:
        """Whether the branch was pruned, retained away, or its context closed."""
    @property
    def handle(self) -> int:
        """Stable identity; never reused for another branch."""
    @property
    def seq_id(self) -> int:
        """The leased sequence id (read-only; for interop with the flat path)."""
    @property
    def context(self) -> Context:
        """The context this branch lives in."""
    def __enter__(self) -> Branch: ...
    def __exit__(
        self,
        *_exc: object,
    ) -> bool: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class KvPressure:
    """KV occupancy by branches."""

    @property
    def n_ctx(self) -> int:
        """Total cells."""
    @property
    def cells_used(self) -> int:
        """Cells held by branches."""
    @property
    def remaining(self) -> int:
        """Cells left."""
    @property
    def cells_parked(self) -> int:
        """Cells of pruned branches parked until the cache fills (batch-invariant contexts only)."""

@final
class EngineStats:
    """Counters of a context's engine (``Context.engine_stats()``)."""

    @property
    def ticks(self) -> int:
        """Ticks run (each one pass over the queue that decoded something)."""
    @property
    def decode_calls(self) -> int:
        """``llama_decode`` calls made by the engine."""
    @property
    def rows(self) -> int:
        """Rows (tokens) decoded."""
    @property
    def ops_submitted(self) -> int:
        """Operations submitted."""
    @property
    def ops_completed(self) -> int:
        """Operations answered with success."""
    @property
    def ops_failed(self) -> int:
        """Operations answered with an error (validation, decode, cancellation, close)."""
    @property
    def ops_coalesced(self) -> int:
        """Operations whose rows shared a tick with another operation's."""
    @property
    def max_ops_per_tick(self) -> int:
        """The most operations one tick decoded together."""
    @property
    def queue_depth(self) -> int:
        """Operations waiting for the next tick."""
    @property
    def in_flight(self) -> int:
        """Prefills in flight across ticks."""
    @property
    def generating(self) -> int:
        """Generation requests running (``Branch.generate`` iterators)."""
    @property
    def waiting(self) -> int:
        """Generation requests waiting (FIFO) for room in the cache."""
    @property
    def tick_seconds(self) -> float:
        """Seconds spent in ticks that decoded something (validation, packing, decode, sampling,
        publishing and waking callers).
        """
    @property
    def decode_seconds(self) -> float:
        """Seconds of those spent in ``llama_decode``."""
    @property
    def sample_seconds(self) -> float:
        """Seconds of those spent sampling: generation requests' tokens, and the next tokens of
        branches whose commit carried what ``produce`` drew (drawn ahead in the tick).
        """
    @property
    def lease_waiting(self) -> int:
        """``Branch.create`` / ``fork`` calls waiting (first come, first served) for a lease."""
    @property
    def prefill_cap(self) -> int:
        """The prefill cap of the last tick (0: the whole batch; with the paced default, what
        the engine allowed next to the running streams).
        """
    @property
    def paused(self) -> bool:
        """Whether the engine is paused (``Context.pause_engine``)."""
    @property
    def gather(self) -> float:
        """Seconds a tick waits for as many commits as the previous tick decoded."""
    @property
    def burst_waits(self) -> int:
        """Times an idle engine given a prompt waited for the rest of a burst (concurrent
        requests a few milliseconds behind); after a wait no other prompt joined, the next
        prompt starts at once (docs/engine.md).
        """
    @property
    def burst_wait_seconds(self) -> float:
        """Seconds spent in those waits."""
    @property
    def kv_compactions(self) -> int:
        """Times the engine, run dry, moved the KV cache's cells back to its front (cells left
        high by a busy stretch slow every later decode).
        """

@final
class BranchStore:
    """Multi-branch operations on one context: one ``llama_decode`` for N branches."""

    def __new__(cls, ctx: Context) -> BranchStore: ...
    def commit(self, pairs: list[tuple[Branch, int]]) -> None:
        """Accept and decode one token per branch in ONE ``llama_decode``; all-or-nothing."""
    def prefill(self, items: list[tuple[Branch, list[int]]]) -> None:
        """Write each branch's tokens, bin-packed into ``ceil(total / n_batch)`` decodes; all-or-nothing."""
    def retain_only(self, winner: Branch) -> None:
        """Keep ``winner``'s sequence only; every other branch is disposed; the winner becomes a root."""
    def produce_all(self, branches: list[Branch]) -> list[Produced]:
        """Sample every branch in one native call (GIL released)."""
    def acommit(self, pairs: list[tuple[Branch, int]]) -> Coroutine[Any, Any, None]:
        """Await ``commit(pairs)``: queued on the context's engine, the event loop keeps running."""
    def _submit_commit(
        self, lp: asyncio.AbstractEventLoop, fut: asyncio.Future[None], pairs: list[tuple[Branch, int]]
    ) -> Callable[[], None]:
        """Queue ``commit(pairs)`` on the engine now; the engine thread settles ``fut`` on
        ``lp``. Returns a canceller (``lloyal.aio.engine_start`` wraps it).
        """
    def aretain_only(self, winner: Branch) -> Coroutine[Any, Any, None]:
        """Await ``retain_only(winner)`` without blocking the event loop: it runs at once when the
        engine is between ticks, else the engine runs it before its next tick.
        """
    def aprefill(self, items: list[tuple[Branch, list[int]]]) -> Coroutine[Any, Any, None]:
        """Await ``prefill(items)``: queued on the context's engine, the event loop keeps running."""
    @property
    def available(self) -> int:
        """Free leases (as of the last call that finished: read without waiting for a tick)."""
    @property
    def kv_pressure(self) -> KvPressure:
        """KV cells used by branches (as of the last call that finished, like ``available``)."""
    @property
    def context(self) -> Context:
        """The context."""
