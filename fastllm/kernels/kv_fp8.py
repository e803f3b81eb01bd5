"""An FP8 KV cache inside the kernels (kv_cache_dtype="fp8"; reference.kv_to_cache / kv_from_cache).

Writers store e4m3 of x / scale, saturated at +-448 (IEEE division, round to nearest even: bitwise the
reference's on GPUs). Readers load e4m3 K/V, convert them to q's dtype (exact) for the same tl.dot's as a
16-bit cache, and fold the per-tensor scales in outside the loop: k_scale into the softmax scale (the host
passes scale * k_scale), v_scale into the output (its normalization). Keys a kernel takes from elsewhere
than the cache go through the same rounding, so that a token attends alike whichever way its key arrives:
a decode step's new token in registers (to_cache), a prefill chunk's rows as rotary_kv_cache_write returns
them (the e4m3 values, converted to the activations' dtype once).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastllm.kernels.reference import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_cache(x, scale, CACHE_TY: tl.constexpr):
    """x as a cache of CACHE_TY stores it: FP8, e4m3 of x / scale saturated; else x in CACHE_TY."""
    if CACHE_TY == tl.float8e4nv:
        return tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -_FP8_MAX, _FP8_MAX).to(CACHE_TY)
    else:
        return x.to(CACHE_TY)

