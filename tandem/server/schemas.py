"""Request bodies of the OpenAI-compatible API (pydantic, strict types) and the OpenAI error body.

Validation here is the first gate: anything that parses is a well-typed, in-range request; the engine's
own `validate` (context length, token ids) is the second. Every field of OpenAI's and vLLM's request bodies
that changes the output is either honoured as vLLM does or, in UNSUPPORTED, refused with a 400 naming it
unless it holds its neutral value. Other unknown fields are ignored: they change nothing (`user`,
`metadata`, `store`, `service_tier`, `priority`, `request_id`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from tandem.config import MAX_TOP_LOGPROBS

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_N = 8
MAX_STOP = 4
MAX_STOP_TOKEN_IDS = 64

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
    "parallel_tool_calls": "tool calling is not supported by this server",
    "allowed_token_ids": "allowed_token_ids is not supported by this server",
    "bad_words": "bad_words is not supported by this server",
    "logits_processors": "custom logits processors are not supported by this server",
    "use_beam_search": "beam search is not supported by this server",
    "length_penalty": "length_penalty (beam search) is not supported by this server",
    "prompt_logprobs": "prompt_logprobs is not supported by this server: use completions with echo and logprobs",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported by this server",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported by this server",
    "skip_special_tokens": "skip_special_tokens: only true is supported (special tokens are skipped)",
    "spaces_between_special_tokens": "spaces_between_special_tokens: only true is supported",
    "add_special_tokens": "add_special_tokens is not supported by this server (prompts are encoded as given)",
    "echo_chat": "echo is not supported by chat completions on this server",
    "add_generation_prompt": "add_generation_prompt: only true is supported (the assistant turn is always opened)",
    "continue_final_message": "continue_final_message is not supported by this server",
    "chat_template": "a per-request chat_template is not supported by this server",
    "chat_template_kwargs": "chat_template_kwargs is not supported by this server",
    "documents": "documents (RAG templates) are not supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "modalities": 'modalities: only ["text"] is supported',
    "audio": "audio output is not supported by this server",
    "reasoning_effort": "reasoning_effort is not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "tool_calls": "tool calls in messages are not supported by this server",
}
NEUTRAL = (None, [], {}, "none", "auto", {"type": "text"}, "")
FIELD_NEUTRAL = {  # neutral values beyond NEUTRAL: what the server does anyway
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "add_special_tokens": (False,),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "echo_chat": (False,), "use_beam_search": (False,),
    "length_penalty": (1.0, 1), "parallel_tool_calls": (False, True), "return_tokens_as_token_ids": (False,), "modalities": (["text"],),
}


def _is_neutral(field_name: str, value) -> bool:
    """None, or a value that asks for what the server does anyway (an empty list, "none", True for skip_special_tokens...)."""
    neutral = NEUTRAL + FIELD_NEUTRAL.get(field_name, ())
    return value is None or any(value == n and type(value) is type(n) for n in neutral if n is not None)


def _refused(field_name: str, value):
    if _is_neutral(field_name, value):
        return None
    raise ValueError(UNSUPPORTED[field_name])


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # usage in every chunk is not supported: only false


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
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None  # vLLM's: 1 = off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
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
    parallel_tool_calls: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None

    @field_validator(*(f for f in UNSUPPORTED if f not in ("add_special_tokens", "echo_chat", "add_generation_prompt", "continue_final_message",
                                                             "chat_template", "chat_template_kwargs", "documents", "prediction", "modalities",
                                                             "audio", "reasoning_effort", "web_search_options", "tool_calls")), mode="before")
    @classmethod
    def _refuse_unsupported(cls, value, info: ValidationInfo):
        return _refused(info.field_name, value)

    @model_validator(mode="after")
    def _stops_non_empty(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return self

    @model_validator(mode="after")
    def _min_tokens_within_max(self):
        limit = self.max_tokens if self.max_tokens is not None else getattr(self, "max_completion_tokens", None)
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: must not exceed max_tokens ({limit}), got {self.min_tokens}")
        return self

    def sampling_fields(self) -> dict:
        """The SamplingParams fields these requests set beyond max_tokens / temperature / top_p / top_k / seed / logprobs."""
        return {"stop": self.stop_list(), "stop_token_ids": tuple(self.stop_token_ids or ()), "ignore_eos": self.ignore_eos,
                "min_tokens": self.min_tokens, "min_p": self.min_p or 0.0, "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "frequency_penalty": self.frequency_penalty or 0.0, "presence_penalty": self.presence_penalty or 0.0,
                "include_stop_str_in_output": self.include_stop_str_in_output}

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # each token's log-prob and this many alternatives
    echo: bool = False  # the prompt's text (and with logprobs its tokens' log-probs) before the completion
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None  # only 1: choosing the best of several is not supported
    add_special_tokens: Any = None

    @field_validator("add_special_tokens", mode="before")
    @classmethod
    def _refuse_completion_unsupported(cls, value, info: ValidationInfo):
        return _refused(info.field_name, value)

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def top_logprobs_n(self) -> int:
        return self.logprobs or 0


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None  # passed to the chat template, as vLLM does
    tool_calls: Any = None

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _refuse_unsupported(cls, value, info: ValidationInfo):
        return _refused(info.field_name, value)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None  # each sampled token's log-prob
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # alternatives per token (needs logprobs)
    echo: Any = None  # chat has no echo: refused unless false
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    prediction: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    @field_validator("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
                     "prediction", "modalities", "audio", "reasoning_effort", "web_search_options", mode="before")
    @classmethod
    def _refuse_chat_unsupported(cls, value, info: ValidationInfo):
        return _refused(info.field_name, value)

    @field_validator("echo", mode="before")
    @classmethod
    def _refuse_echo(cls, value):
        return _refused("echo_chat", value)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def top_logprobs_n(self) -> int:
        return self.top_logprobs or 0 if self.logprobs else 0


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
