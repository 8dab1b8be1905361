"""What a real vLLM refuses in a ``/v1/completions`` request, refused by ``glmpost serve --api vllm`` with
the same status, ``type`` and ``param`` (``tests/test_vllm_standin.py`` sends both servers the same
requests).

Messages as vLLM 0.32 writes them: ``VLLMValidationError`` (``vllm/exceptions.py``) appends
``(parameter=NAME, value=V)`` and answers ``param`` NAME; the sampling checks are
``SamplingParams._verify_args`` (``vllm/sampling_params.py``), the context check
``renderers/params.py`` ``_token_len_check``, the vocabulary check ``renderers/base.py``, the unknown
model ``entrypoints/serve/engine/serving.py`` (404 ``NotFoundError``, ``param`` model).
"""

from __future__ import annotations

from typing import Any

from glmpost.server.parsing import RequestError

__all__ = ["VLLMRequestError", "check_completion"]


class VLLMRequestError(RequestError):
    """A refusal as vLLM answers it: ``param`` names the field (vLLM's ``ErrorResponse.param``)."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, value: Any = None):
        extras = [f"{name}={v}" for name, v in (("parameter", param), ("value", value)) if v is not None]
        if extras:
            message = f"{message} ({', '.join(extras)})"
        super().__init__(message, status)
        self.param = param


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    return default if value is None else float(value)


def check_completion(body: dict, prompts: list[list[int]], *, model_name: str, vocab_size: int, max_model_len: int) -> None:
    """Raise :class:`VLLMRequestError` for what vLLM 0.32 refuses in ``body`` (prompts already parsed)."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise VLLMRequestError(f"The model `{model}` does not exist.", 404, param="model", value=model)
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise VLLMRequestError(f"temperature must be non-negative, got {temperature}.", param="temperature", value=temperature)
    if temperature > 2.0:
        raise VLLMRequestError(f"temperature must be in [0, 2], got {temperature}.", param="temperature", value=temperature)
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise VLLMRequestError(f"top_p must be in (0, 1], got {top_p}.", param="top_p", value=top_p)
    top_k = body.get("top_k")
    if top_k is not None and int(top_k) < -1:
        raise VLLMRequestError(f"top_k must be 0 (disable), or at least 1, got {int(top_k)}.")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and int(max_tokens) < 1:
        raise VLLMRequestError(f"max_tokens must be at least 1, got {int(max_tokens)}.", param="max_tokens",
                               value=int(max_tokens))
    for prompt in prompts:
        if len(prompt) > max_model_len:
            raise VLLMRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
                f"{len(prompt)} input tokens, which exceeds this limit even without any output tokens. Please reduce "
                "the length of the input prompt.", param="input_tokens", value=len(prompt))
        outside = [t for t in prompt if t >= vocab_size]
        if outside:
            raise VLLMRequestError(f"Token id {outside[0]} is out of vocabulary")
