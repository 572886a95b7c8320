"""Request bodies of the OpenAI-compatible API (pydantic, strict types) and the OpenAI error body.

Validation here is the first gate: anything that parses is a well-typed, in-range request; the engine's
own `validate` (context length, token ids) is the second. Unknown fields are ignored (clients send
extras such as `user`), but fields we cannot honour (non-zero penalties, `echo`, top logprobs) are refused
with a 400 rather than silently dropped.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_N = 8
MAX_STOP = 4

Prompt = Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=16)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP)] | None

# fields a client may send that this server cannot honour: a 400 naming them, never silently ignored (neutral values pass)
UNSUPPORTED = {
    "tools": "tool calling is not supported by this server",
    "tool_choice": "tool calling is not supported by this server",
    "functions": "function calling is not supported by this server",
    "function_call": "function calling is not supported by this server",
    "response_format": 'structured output is not supported by this server: only {"type": "text"}',
    "logit_bias": "logit_bias is not supported by this server",
    "guided_json": "guided decoding is not supported by this server",
    "guided_regex": "guided decoding is not supported by this server",
    "guided_choice": "guided decoding is not supported by this server",
    "guided_grammar": "guided decoding is not supported by this server",
    "structured_outputs": "guided decoding is not supported by this server",
    "suffix": "suffix (insertion) is not supported by this server",
}
NEUTRAL = (None, [], {}, "none", "auto", {"type": "text"}, "")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names; top_k and ignore_eos as in vLLM)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0 = off
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: Stop = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None  # only the neutral value is supported
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    tools: Any = None  # UNSUPPORTED: refused unless neutral
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    suffix: Any = None

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _refuse_unsupported(cls, value, info: ValidationInfo):
        if any(value == neutral and type(value) is type(neutral) for neutral in NEUTRAL if neutral is not None) or value is None:
            return None
        if info.field_name == "tool_choice" and value == "none":
            return None
        raise ValueError(UNSUPPORTED[info.field_name])

    @model_validator(mode="after")
    def _stops_non_empty(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return self

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: int | None = None  # 0: each sampled token's log-prob; alternatives (> 0) are not supported
    echo: Literal[False] = False  # echoing the prompt is not supported
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logprobs is not None and self.logprobs != 0:
            raise ValueError("logprobs: only 0 is supported (each sampled token's log-prob, no alternatives)")
        return self

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None  # each sampled token's log-prob
    top_logprobs: int | None = None  # alternatives are not supported: 0 or absent

    @model_validator(mode="after")
    def _unsupported(self):
        if self.top_logprobs:
            raise ValueError("top_logprobs: only 0 is supported (each sampled token's log-prob, no alternatives)")
        return self

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)


class AdoptRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    version: Annotated[int, Field(ge=0)]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | int | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    """Raised by handlers; answered with `status` and the OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)
