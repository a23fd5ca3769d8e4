"""Deterministic random tensor contents, generated in fixed-size chunks.

Chunk `i` of tensor `name` comes from its own generator, seeded by `(seed, sha256(name),
i)`: the bytes of a tensor depend only on (seed, name, dtype, shape, init), never on the
order tensors are written in or on what else the checkpoint holds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

CHUNK_ELEMENTS = 1 << 22  # 4 Mi elements: 16 MiB of float32 scratch per chunk

_SQRT3 = math.sqrt(3.0)


@dataclass(frozen=True, slots=True)
class Init:
    """How to fill a tensor.

    kind: "uniform_std" (zero-mean uniform with standard deviation `a`), "offset_std"
    (1 + uniform_std(a): norm weights), "const" (all `a`), "log_uniform" (log of U(a, b):
    A_log), "dt_bias" (inverse softplus of exp(U(log a, log b)): dt_bias), "randint"
    (integers in [a, b): MXFP4 codes and E8M0 scales).
    """

    kind: str
    a: float = 0.0
    b: float = 0.0


def normal(std: float = 0.02) -> Init:
    """Zero-mean weights with standard deviation `std` (uniform: cheaper than Gaussian)."""
    return Init("uniform_std", std)


def norm_weight(std: float = 0.02) -> Init:
    return Init("offset_std", std)


def const(value: float) -> Init:
    return Init("const", value)


def log_uniform(lo: float, hi: float) -> Init:
    return Init("log_uniform", lo, hi)


def dt_bias(lo: float = 1e-3, hi: float = 1e-1) -> Init:
    return Init("dt_bias", lo, hi)


def randint(lo: int, hi: int) -> Init:
    return Init("randint", lo, hi)


def _generator(seed: int, name: str, chunk: int) -> np.random.Generator:
    digest = hashlib.sha256(name.encode()).digest()
    words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 32, 4)]
    return np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, *words, chunk])


def _floats(rng: np.random.Generator, n: int, init: Init) -> np.ndarray:
    """`n` float32 values for a floating-point init."""
    kind = init.kind
    if kind == "const":
        return np.full(n, init.a, dtype=np.float32)
    x = rng.random(n, dtype=np.float32)  # U[0, 1)
    if kind in ("uniform_std", "offset_std"):
        x *= np.float32(2 * _SQRT3 * init.a)
        x -= np.float32(_SQRT3 * init.a)
        if kind == "offset_std":
            x += np.float32(1.0)
        return x
    if kind == "log_uniform":
        x *= np.float32(init.b - init.a)
        x += np.float32(init.a)
        return np.log(x)
    if kind == "dt_bias":
        dt = np.exp(x * np.float32(math.log(init.b) - math.log(init.a)) + np.float32(math.log(init.a)))
        return dt + np.log(-np.expm1(-dt))  # softplus(dt_bias) == dt
    raise ValueError(f"unknown init kind {kind!r}")


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the little-endian element bytes of `dtype`."""
    if dtype == "F32":
        return x.astype("<f4", copy=False)
    if dtype == "BF16":  # the top half of each float32 (truncation: the values are random anyway)
        return x.astype("<f4", copy=False).view("<u2")[1::2]
    if dtype == "F16":
        return x.astype("<f2")
    raise ValueError(f"cannot encode floats as {dtype}")


def tensor_chunks(seed: int, name: str, dtype: str, shape: tuple[int, ...], init: Init) -> Iterator[np.ndarray]:
    """The bytes of one tensor, as numpy arrays of at most `CHUNK_ELEMENTS` elements each."""
    total = math.prod(shape)
    for index, start in enumerate(range(0, total, CHUNK_ELEMENTS)):
        n = min(CHUNK_ELEMENTS, total - start)
        rng = _generator(seed, name, index)
        if init.kind == "randint":
            if dtype != "U8":
                raise ValueError(f"{name}: randint init needs U8, not {dtype}")
            lo, hi = int(init.a), int(init.b)
            yield rng.bytes(n) if (lo, hi) == (0, 256) else rng.integers(lo, hi, n, dtype=np.uint8)
        else:
            yield np.ascontiguousarray(_encode(_floats(rng, n, init), dtype))
