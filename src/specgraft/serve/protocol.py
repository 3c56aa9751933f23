"""OpenAI's request fields (and ours), validated once, and the error envelope.

Every bad request gets ``{"error": {"message", "type", "param", "code"}}`` with the right status and never
reaches the engine thread; a field we do not support is refused by name rather than silently ignored.
Our fields ride in the body as extras (the openai client's ``extra_body``): ``method``, ``budget``,
``verify`` (an opt-in LOSSY rule is labelled in the response), ``top_k``, ``min_p``, ``eta``, ``options``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..core.sampling import SEED_MAX, SamplingParams
from ..errors import SpecgraftError
from ..lossy.rules import parse_rule
from ..registry import check_lossy, check_options
from .options import ClientPolicy

MAX_STOP = 4  # OpenAI's "up to 4 sequences"
MAX_STOP_CHARS = 256  # each; streamed text is held back by the longest one's length


class APIError(Exception):
    """An OpenAI-style error: the HTTP status and the envelope's fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


Number = Union[int, float]


class _Common(BaseModel):
    """The fields both endpoints share. ``extra="forbid"``: an unsupported OpenAI field is a 400 by name."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # ours
    method: str | None = None
    budget: Union[int, Literal["auto"], None] = None
    verify: str | None = None
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    eta: float | None = Field(None, ge=0, le=1)
    options: dict[str, Union[str, int, float, bool]] | None = None
    return_token_ids: bool = False  # as vLLM's extension: each choice also carries its token ids


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


@dataclass
class Job:
    """A validated request, ready for the engine: everything :meth:`Engine.add_request` takes."""

    prompt: Union[str, list[dict], list[int]]
    chat: bool
    method: str
    sampling: SamplingParams
    max_tokens: int | None  # None: the server's default, clamped to what fits
    stop: tuple[str, ...]
    budget: Union[int, str, None]
    verify: str
    options: dict
    stream: bool
    include_usage: bool
    return_token_ids: bool = False

    def engine_kwargs(self) -> dict:
        return dict(method=self.method, sampling=self.sampling, max_new_tokens=self.max_tokens, stop=self.stop,
                    chat=self.chat, budget=self.budget, verify=self.verify, **self.options)

    def ar_kwargs(self) -> dict:
        """The same request decoded autoregressively (what a shed request runs: serve/runner.py)."""
        return dict(method="ar", sampling=self.sampling, max_new_tokens=self.max_tokens, stop=self.stop,
                    chat=self.chat, budget=0, verify=self.verify)


def _refuse(cond, param: str, message: str) -> None:
    if cond:
        raise APIError(400, message, param=param, code="unsupported_parameter")


def to_job(req: ChatRequest | CompletionRequest, default_method: str, default_options: dict,
           default_budget, policy: ClientPolicy | None = None) -> Job:
    """Check what pydantic cannot (n, refused features, the client policy, method options, lossy rules) and
    build the job. ``max_tokens`` stays None when the request sets none (the server clamps its default to
    what fits the context once the prompt is tokenised)."""
    _refuse(req.n not in (None, 1), "n", f"n must be 1 (one choice per request), got {req.n}")
    _refuse(bool(req.logprobs) or getattr(req, "top_logprobs", None), "logprobs", "logprobs are not supported yet")
    _refuse(req.presence_penalty not in (None, 0, 0.0), "presence_penalty", "presence_penalty is not supported")
    _refuse(req.frequency_penalty not in (None, 0, 0.0), "frequency_penalty", "frequency_penalty is not supported")
    _refuse(bool(req.logit_bias), "logit_bias", "logit_bias is not supported")
    if isinstance(req, CompletionRequest):
        _refuse(req.echo, "echo", "echo is not supported")
        _refuse(req.suffix, "suffix", "suffix is not supported")
        _refuse(req.best_of not in (None, 1), "best_of", "best_of must be 1")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s or len(s) > MAX_STOP_CHARS for s in stop) or len(stop) > MAX_STOP:
        raise APIError(400, f"stop must be up to {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters",
                       param="stop")
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                    for m in req.messages]
        if not messages[-1]["content"].strip():
            raise APIError(400, "the last message is empty", param="messages")
        prompt, chat = messages, True
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            _refuse(len(prompt) != 1, "prompt", "prompt must be one string (batched prompts are not supported)")
            prompt = prompt[0]
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise APIError(400, "prompt must not be empty", param="prompt")
        chat, max_tokens = False, req.max_tokens
    method = req.method or default_method
    options = dict(default_options) if req.method in (None, default_method) else {}
    options.update(req.options or {})
    budget = req.budget if req.budget is not None else (default_budget if req.method in (None, default_method)
                                                        else None)
    try:
        auto_ready = method == default_method and default_budget == "auto"
        (policy or ClientPolicy()).check(method, req.budget, req.options or {}, auto_ready)
        check_options(method, options)
        sampling = SamplingParams(1.0 if req.temperature is None else req.temperature, req.top_k or 0,
                                  1.0 if req.top_p is None else req.top_p, req.seed, req.min_p or 0.0, req.eta or 0.0)
        rule = parse_rule(req.verify or "lossless")
        if rule.lossy:
            check_lossy(rule, method, options, sampling)
    except SpecgraftError as err:
        msg = str(err)
        param = next((p for p in ("budget", "options", "method", "temperature", "seed", "verify")
                      if msg.startswith(p) or f"{p} '" in msg or f" {p} " in msg), None)
        raise APIError(400, msg, param=param) from None
    return Job(prompt, chat, method, sampling, max_tokens, stop, budget, rule.spec, options,
               req.stream, bool(req.stream_options and req.stream_options.include_usage), req.return_token_ids)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's / FastAPI's validation errors as one 400: malformed JSON, missing fields, bad types, ranges."""
    err = errors[0] if errors else {}
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', 'cannot parse')}")
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported parameter: {param}", param=param, code="unsupported_parameter")
    return APIError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}"
                         f"{'' if len(errors) < 2 else f' (and {len(errors) - 1} more)'}", param=param)
