"""The settings of ``glmpost serve``: :class:`ServeConfig` (its options, under the same names) and
:func:`checked_settings`, the refusals of settings that cannot go together, run before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from glmpost.config import ConfigError, setting, shared
from glmpost.kernel.distribution import LOG_PROB_KINDS
from glmpost.kernel.sglang_client import check_api_key
from glmpost.server.vllm_api import DEFAULT_RELEASE, check_logprobs_mode, check_release

# SGLang's output log-probs: log_softmax(z / T), before top-k / top-p (layers/sampler.py, #5961).
SGLANG_LOG_PROB_KIND = "tempered"


@dataclass
class ServeConfig:
    """The settings of ``glmpost serve`` (its options, under the same names); refusals name these fields."""

    checkpoint: Optional[Path] = None  # a root (its LATEST) or a version directory
    host: str = setting("127.0.0.1", "Address to listen on (loopback by default; 0.0.0.0 exposes it).")
    port: int = setting(30000, "TCP port; 0 picks a free one (printed when ready).", min=0, max=65535)
    device: str = shared("device")
    batch_size: int = setting(32, "Most sequences decoded together in one engine batch.", min=1)
    prefix_cache_batches: int = setting(
        8, "Engine batches whose KV caches are kept for requests that extend their ids (a multi-turn trajectory's "
        "next turn prefills only its new tokens, as with SGLang's radix cache; meta_info.cached_tokens); 0 = off.",
        min=0)
    batch_wait_ms: float = setting(
        50.0, "Most time the engine waits for as many single requests as its last batch had before it starts a batch.", min=0.0)
    weight_version: Optional[str] = setting(None, "Initial weight_version reported; default: the checkpoint's policy version.")
    api_key: Optional[str] = setting(
        None, "Require 'Authorization: Bearer KEY' on every route but /health (HTTP 401 without it), as SGLang's --api-key.",
        cli={"show_default": False})
    admin_api_key: Optional[str] = setting(
        None, "Require this key, and only it, on the control routes (/update_weights_from_disk, /abort_request), as "
        "SGLang's --admin-api-key.", cli={"show_default": False})
    log_prob_kind: str = setting(
        SGLANG_LOG_PROB_KIND, "What output log-probs are log-probs of (reported in /server_info; greedy requests "
        "are always raw; the default is what SGLang returns since v0.4.7): "
        + "; ".join(f"{kind}: {what}" for kind, what in LOG_PROB_KINDS.items()) + ".")
    deterministic_topk: bool = shared("deterministic_topk")
    attention: str = shared("attention")
    log_requests: bool = setting(False, "Log every HTTP request to stderr.")
    metrics: Optional[Path] = setting(
        None, "Append the server's counters to this JSONL file every --metrics-interval seconds and at stop.",
        cli={"dir_okay": False})
    metrics_interval: float = setting(10.0, "Seconds between --metrics lines.", min=0.1)
    max_queued: int = setting(1024, "Most requests waiting for the engine; a request beyond them is answered 503 with "
                              "Retry-After (never a reset connection).", min=1)
    max_body_bytes: int = setting(64 << 20, "Largest request body read; a larger one is answered 413 before it is read.", min=1)
    api: str = setting("sglang", "The HTTP API served: sglang (SGLang's native routes) or vllm (the vLLM OpenAI-server "
                       "routes glmpost uses: /v1/completions, /v1/models, dev-mode /server_info, /collective_rpc "
                       "reload_weights, /pause, /resume, /reset_prefix_cache; --api-key then guards only /v1, /v2, /inference).")
    max_model_len: Optional[int] = setting(None, "With --api vllm: vLLM's --max-model-len, the longest prompt served and "
                                           "reported (default: the model's max_position_embeddings).", min=1)
    max_logprobs: int = setting(20, "With --api vllm: vLLM's --max-logprobs, the most log-probs per position a request may "
                                "ask for (logprobs, prompt_logprobs); -1 = the vocabulary.", min=-1)
    logprobs_mode: str = setting("raw_logprobs", "With --api vllm: vLLM's --logprobs-mode, what output log-probs are (in place of "
                                 "--log-prob-kind): raw_logprobs (kind raw) or processed_logprobs (kind sampled).")
    vllm_dev_mode: bool = setting(True, "With --api vllm: serve the routes vLLM serves only with VLLM_SERVER_DEV_MODE=1 "
                                  "(/server_info, /collective_rpc, /reset_prefix_cache, /pause, /resume, /is_paused, "
                                  "/update_weight_version, /weight_info); off, they answer 404 as there.",
                                  flag="--vllm-dev-mode/--no-vllm-dev-mode")
    vllm_release: str = setting(DEFAULT_RELEASE, "With --api vllm: the vLLM release answered by /version and mimicked: "
                                "from 0.34 a request that comes while paused is answered 503 (before, it waits for "
                                "/resume) and return_weight_versions gives each choice its weight_versions.")
    enable_lora: bool = setting(
        False, "Load LoRA adapters at run time and serve requests naming one (SGLang's and vLLM's --enable-lora): "
        "/load_lora_adapter, /unload_lora_adapter and lora_path per request; with --api vllm /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter and the model field. Each adapter is applied unmerged onto the served weights, "
        "a model of its own (the base's memory again).")
    enable_return_routed_experts: bool = setting(
        False, "With --api vllm: vLLM's --enable-return-routed-experts (MoE models): every /v1/completions choice "
        "carries routed_experts (base64 .npy [prompt + output - 1, num_hidden_layers, k], dense layers' rows 0). "
        "The SGLang API answers return_routed_experts per request.")


def checked_settings(config: ServeConfig) -> Optional[str]:
    """Refuse an unknown ``log_prob_kind`` or an API key that cannot go in a header (without
    repeating it); returns the key (None for none)."""

    if config.api not in ("sglang", "vllm"):
        raise ConfigError("{api} must be sglang or vllm, got {value!r}", value=config.api)
    try:
        check_logprobs_mode(config.logprobs_mode)
    except ValueError as exc:
        raise ConfigError("{logprobs_mode} {reason}", reason=exc) from None
    if config.api == "vllm" and config.log_prob_kind != SGLANG_LOG_PROB_KIND:
        raise ConfigError("{log_prob_kind} is for {api} sglang; with {api} vllm say {logprobs_mode}")
    if config.api == "sglang" and (config.logprobs_mode != "raw_logprobs" or config.max_logprobs != 20):
        raise ConfigError("{logprobs_mode} and {max_logprobs} are for {api} vllm")
    try:
        check_release(config.vllm_release)
    except ValueError as exc:
        raise ConfigError("{vllm_release} {reason}", reason=exc) from None
    if config.api == "sglang" and config.enable_return_routed_experts:
        raise ConfigError("{enable_return_routed_experts} is for {api} vllm (the SGLang API answers "
                          "return_routed_experts per request)")
    if config.log_prob_kind not in LOG_PROB_KINDS:
        raise ConfigError("{log_prob_kind} must be one of {kinds}, got {value!r}", kinds=", ".join(LOG_PROB_KINDS),
                          value=config.log_prob_kind)
    check_api_key(config.admin_api_key, "admin_api_key")
    return check_api_key(config.api_key)


__all__ = ["SGLANG_LOG_PROB_KIND", "ServeConfig", "checked_settings"]
