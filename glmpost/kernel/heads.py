"""The two halves of a Hugging Face causal LM the chunked log-prob paths apply separately: the
decoder body and the LM head (and whether the head is a bare linear layer they may fuse)."""

from __future__ import annotations

from typing import Callable

import torch

# Config attributes of Hugging Face heads that post-process logits after the LM head; the chunked
# path applies the head module alone, so it refuses such models rather than return wrong numbers.
_LOGIT_POSTPROCESSING_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def plain_linear(head) -> bool:
    """A bare ``nn.Linear`` whose ``weight`` is the tensor its forward uses: no parametrization
    (QAT's fake quant), no hooks (DeepSpeed ZeRO-3 gathers partitioned weights in them), no
    subclass. Only such a head may be applied as ``F.linear(rows, weight, bias)`` directly."""
    from torch.nn.modules import module as nn_module

    return (
        type(head) is torch.nn.Linear
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and not head._backward_hooks
        and not nn_module._global_forward_hooks
        and not nn_module._global_forward_pre_hooks
        and not hasattr(head.weight, "ds_id")
    )


def split_causal_lm(
    model: torch.nn.Module,
) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """``(decoder body, LM head module)`` of a Hugging Face causal LM."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} exposes no LM head (get_output_embeddings())")
    config = getattr(model, "config", None)
    for attr in _LOGIT_POSTPROCESSING_ATTRS:
        value = getattr(config, attr, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__} post-processes its logits (config.{attr}={value}); "
                "chunked log-probs apply the LM head alone and do not support it"
            )
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if body is None or body is model:
        body = getattr(model, "model", None)
    if body is None or body is model:
        body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise ValueError(
            f"{type(model).__name__} exposes no decoder body (get_decoder(), .model, .base_model)"
        )
    return body, head


def vocab_size_of(head: torch.nn.Module) -> int | None:
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] > 0:
        return weight.shape[0]
    out_features = getattr(head, "out_features", None)
    return out_features if isinstance(out_features, int) else None


def in_head_dtype(hidden: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    """``hidden`` in the dtype of ``head``'s weight: with float32 master weights the head (and what
    follows it: log-probs, the loss) runs in float32 whatever dtype the body ran in (bf16 autocast).
    Call it, and the head, with autocast off."""
    weight = getattr(head, "weight", None)
    if weight is None or not weight.is_floating_point() or weight.dtype == hidden.dtype:
        return hidden
    return hidden.to(weight.dtype)
