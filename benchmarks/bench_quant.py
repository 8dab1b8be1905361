"""int4 group quantization throughput: glmpost's quantizer vs torchao's ``quantize_affine``.

    PYTHONPATH=/path/to/torchao .venv/bin/python benchmarks/bench_quant.py --layers 4 --rows 4096 --cols 4096 --out runs/bench_quant.json

The same spec on both sides: symmetric int4 (-8..7), groups of ``--group-size`` along the input
dim, ``scale = absmax / 7`` stored in the weight's dtype (bf16), round half to even, then clamp.
Throughput is GB/s of bf16 weights consumed (``numel * 2`` bytes per second), best of
``--repeats`` rounds that run every implementation in turn (interleaved: the CPUs are shared).

- glmpost: :func:`glmpost.quant.quantize_weight` (scale + codes), ``+ pack`` (the int32
  pack-quantized tensor ``glmpost quantize`` writes) and ``quantize_weight_packed`` (the same
  packed tensor, packed while the codes are computed: what ``sync-weights`` runs);
- torchao: the same scale computed in plain torch, then ``torchao.quantization.quant_primitives.
  quantize_affine(w, (1, group), scale.float(), zeros, torch.int8, -8, 7)``. torchao multiplies by
  ``1 / scale`` where glmpost divides, so a few codes can differ by one; the agreement is reported.
  torchao's own ``choose_qparams_affine`` is not used: it divides by 7.5, another spec.
- plain torch reference: a straightforward reshape / amax / div / round / clamp in plain torch
  (a reference implementation, not a library), used when torchao does not import.

torchao is not a glmpost dependency (importing it makes transformers load its CUDA extensions and
print warnings); install it outside the venv, e.g.
``pip install --no-deps --target /tmp/torchao_pkg torchao`` and set ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from glmpost.quant import make_spec, pack_int4, quantize_weight
from glmpost.quant.core import quantize_weight_packed


def _best_interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Best time of each function over ``repeats`` rounds; every round runs all of them in turn, so a
    change in machine load (the CPUs are shared) hits every side alike."""
    for fn in fns.values():
        fn()  # warm-up
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _plain_scale(w: torch.Tensor, group: int) -> torch.Tensor:
    absmax = w.reshape(w.shape[0], -1, group).float().abs().amax(dim=-1)
    return (absmax / 7).clamp_min(torch.finfo(w.dtype).tiny).to(w.dtype)


def _plain_reference(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _plain_scale(w, group)
    q = torch.round(w.reshape(w.shape[0], -1, group).float() / scale.float().unsqueeze(-1))
    return q.clamp(-8, 7).to(torch.int8).reshape(w.shape), scale


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = make_spec("w4a16", group_size=args.group_size)
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(args.rows, args.cols, generator=g) * 0.02).to(torch.bfloat16) for _ in range(args.layers)]
    gb = sum(w.numel() * 2 for w in weights) / 1e9

    fns = {
        "glmpost quantize_weight": lambda: [quantize_weight(w, spec) for w in weights],
        "glmpost quantize_weight + pack": lambda: [pack_int4(quantize_weight(w, spec)[0]) for w in weights],
        "glmpost quantize_weight_packed": lambda: [quantize_weight_packed(w, spec) for w in weights],
    }
    peer, agreement, note = None, None, None
    try:
        from torchao.quantization.quant_primitives import quantize_affine

        def torchao_one(w):
            # the stored bf16 scale, passed as float32 so the product is computed in float32 as ours is
            scale = _plain_scale(w, args.group_size).float()
            zero = torch.zeros_like(scale, dtype=torch.int32)
            return quantize_affine(w, (1, args.group_size), scale, zero, torch.int8, -8, 7)

        def torchao_run():
            return [torchao_one(w) for w in weights]

        peer = "torchao quantize_affine (plain-torch scale)"
        fns[peer] = torchao_run
        ours = [quantize_weight(w, spec)[0] for w in weights]
        theirs = torchao_run()
        same = sum(int((a == b).sum()) for a, b in zip(ours, theirs))
        agreement = same / sum(a.numel() for a in ours)
    except ImportError as exc:
        note = f"torchao not importable ({exc}); compared against the plain-torch reference only"
    ref = "plain-torch reference implementation"
    fns[ref] = lambda: [_plain_reference(w, args.group_size) for w in weights]
    results = {name: gb / seconds for name, seconds in _best_interleaved(fns, args.repeats).items()}
    ref_equal = all(torch.equal(quantize_weight(w, spec)[0], _plain_reference(w, args.group_size)[0]) for w in weights)

    base = results[peer] if peer else results[ref]
    print(f"int4 group-{args.group_size} quantization of {args.layers} x {args.rows}x{args.cols} bf16 ({gb:.3f} GB), "
          f"best of {args.repeats}, {torch.get_num_threads()} threads")
    print(f"{'implementation':<46} {'GB/s':>7} {'vs ' + ('torchao' if peer else 'reference'):>12}")
    for name, rate in results.items():
        print(f"{name:<46} {rate:>7.3f} {rate / base:>11.2f}x")
    if agreement is not None:
        print(f"codes equal to torchao's: {agreement * 100:.5f}% (multiply-by-reciprocal vs divide)")
    print(f"codes equal to the plain-torch reference: {ref_equal}")
    if note:
        print(note)
    payload = {
        "gb": gb, "gb_per_s": results, "peer": peer, "ratio_vs_peer": {k: v / base for k, v in results.items()},
        "torchao_code_agreement": agreement, "reference_codes_equal": ref_equal, "note": note,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
