"""Request bodies of the OpenAI-compatible endpoints (pydantic models) and the error shape.

Fields follow the OpenAI API reference, with llama-server's and vLLM's common extensions; a field
this server does not implement is refused by name when it asks for something (a value other than
its default) rather than silently ignored. Unknown extra fields are ignored, as OpenAI-compatible
servers do, so clients that send other vendor extensions keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "EmbeddingRequest",
    "LoraScale",
    "StreamOptions",
    "TokenizeRequest",
    "error_body",
]


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` JSON with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_I32_MAX = 2**31 - 1  # the largest value the core's 32-bit fields take


def _lone_surrogate(value: Any, path: str) -> str | None:
    """Where ``value`` (parsed JSON) holds a lone UTF-16 surrogate (a ``\\ud800`` escape
    without its pair: not Unicode text, so it has no UTF-8 to tokenize or match), as an error
    message; ``None`` when it holds none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"{path or 'the body'}: a lone UTF-16 surrogate ({ascii(value[e.start])[1:-1]}) at character "
                f"{e.start} is not Unicode text; send valid UTF-8 (a \\u escape of a surrogate must be "
                "one of a pair)"
            )
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, f"{path}.{ascii(key)[1:-1]}".lstrip(".")) or _lone_surrogate(
                item, f"{path}.{key}".lstrip(".")
            )
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := _lone_surrogate(item, f"{path}.{i}".lstrip(".")):
                return found
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        """Refuse text that is not Unicode (a lone surrogate) wherever it is, before any field
        reads it: it would fail later, mid-stream, as the server's error."""
        if found := _lone_surrogate(data, ""):
            raise ValueError(found)
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class LoraScale(_Body):
    """llama-server's per-request adapter scale: an id of ``GET /lora-adapters`` and its scale."""

    id: int = Field(ge=0)
    scale: float


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=_I32_MAX)  # vLLM/llama-server extension; 0 or -1 disables
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=64)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Output constraints, at most one (:mod:`.constraints`): OpenAI's, llama-server's and vLLM's.
    response_format: dict[str, Any] | None = None
    grammar: str | None = None  # llama-server: GBNF rules (start rule ``root``)
    json_schema: dict[str, Any] | None = None  # llama-server
    guided_json: dict[str, Any] | str | None = None  # vLLM
    guided_regex: str | None = None  # vLLM
    guided_choice: list[str] | None = None  # vLLM
    guided_grammar: str | None = None  # vLLM: GBNF
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer form of the guided_* fields
    # vLLM's (and llama-server's ignore_eos) sampling extensions
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)  # the end (EOG, stop tokens, stop strings) held off until then
    include_stop_str_in_output: bool = False  # a matched stop string ends the text
    skip_special_tokens: bool = True  # refused unless true
    # vLLM: each prompt token's logprob and rank, with the best k (not streamed)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # llama-server's samplers (its /completion fields, which its OpenAI endpoints take too);
    # ``repeat_penalty`` and ``n_predict`` are read as ``repetition_penalty`` and ``max_tokens``
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0)
    repeat_last_n: int = Field(default=64, ge=-1, le=_I32_MAX)  # -1: every token
    mirostat: int = Field(default=0, ge=0, le=2)  # 0: off; 1 or 2: its version
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = Field(default=0.0, ge=0.0)  # 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = Field(default=2, ge=0, le=_I32_MAX)
    dry_penalty_last_n: int = Field(default=-1, ge=-1, le=1 << 20)  # the core's MAX_DRY_WINDOW
    dry_sequence_breakers: list[str] = Field(default_factory=lambda: ["\n", ":", '"', "*"])
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)  # 0: off
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=1.0)
    # llama-server's adapter scales: taken when they are the server's own (--lora), else refused
    lora: list[LoraScale] | None = None
    # vLLM's, refused by name when they ask for something (:mod:`.translate`)
    use_beam_search: bool = False
    truncate_prompt_tokens: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _llama_server_names(cls, data: Any) -> Any:
        """llama-server's ``repeat_penalty`` and ``n_predict`` as OpenAI's names (``n_predict`` -1:
        as if ``max_tokens`` were not given)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for theirs, ours in (("repeat_penalty", "repetition_penalty"), ("n_predict", "max_tokens")):
            if theirs not in data:
                continue
            value = data.pop(theirs)
            if data.get(ours) is not None:
                raise ValueError(f"{theirs} and {ours} are one setting: give one of them")
            if theirs == "n_predict" and value == -1:  # llama-server's "until the end"
                continue
            data[ours] = value
        return data


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt alone (scored)
    best_of: int | None = Field(default=None, ge=1, le=64)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's (and llama-server's chat_template_kwargs) control of the chat template
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's own template: refused by name (:mod:`.translate`)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class EmbeddingRequest(_Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # llama-server's adapter scales: taken when they are the server's own (--lora), else refused
    lora: list[LoraScale] | None = None


class TokenizeRequest(_Body):
    """llama-server's: the BOS token and other special tokens only when ``add_special`` asks."""

    content: str
    add_special: bool = False
    parse_special: bool = True  # special tokens written in ``content`` are read as such
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]
