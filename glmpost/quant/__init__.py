"""One quantizer for QAT and offline conversion (DESIGN.md §5, "QAT = quantize").

* :mod:`glmpost.quant.spec` — :class:`QuantSpec` / :func:`make_spec`: every numeric choice;
* :mod:`glmpost.quant.core` — :func:`quantize_weight` (the only source of codes and scales),
  :func:`dequant`, :func:`fake_quant` (STE), int4/int8 packing, per-token activation quant;
* :mod:`glmpost.quant.targets` — which layers a run quantizes;
* :mod:`glmpost.quant.formats` — compressed-tensors / block-FP8 writers and
  :func:`load_quantized_state`, the reader back to float.
"""

from glmpost.quant.core import (
    dequant,
    dequant_activation,
    fake_quant,
    pack_int4,
    pack_int32,
    quantize_activation_per_token,
    quantize_weight,
    unpack_int4,
    unpack_int32,
)
from glmpost.quant.spec import SCHEMES, QuantSpec, make_spec

__all__ = [
    "SCHEMES",
    "QuantSpec",
    "dequant",
    "dequant_activation",
    "fake_quant",
    "make_spec",
    "pack_int4",
    "pack_int32",
    "quantize_activation_per_token",
    "quantize_weight",
    "unpack_int4",
    "unpack_int32",
]
