"""Bytes per element of the dtypes a memory plan knows."""

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_BYTES))})") from None
