"""Triton's interpreter rounds casts to float8 e4m3 wrongly, so CPU runs of the FP8 kernels would test its
bug, not our kernels: it rounds half up on one guard bit (no ties to even, no sticky bits) and a mantissa
that rounds over 0b111 does not carry into the exponent, so 127.9 becomes 64 where the GPU's cvt.rn.satfinite
gives 128 (about 2.4% of normal values; seen in Triton 3.6, 3.8 and 3.9). `patch()` routes the interpreter's
casts from float32/float16/bfloat16 to e4m3 through torch's cast (round to nearest even), saturated at +-448
as the GPU's satfinite conversion is. It also reads e4m3 back through torch: the interpreter reads e4m3's
NaN (0x7f, 0xff) as +-480, so a kernel that read a NaN-poisoned cache slot it should not would pass on the
CPU. Every other conversion stays the interpreter's own.
"""

from __future__ import annotations

import numpy as np
import torch

_FP8_MAX = 448.0


def patch() -> None:
    from triton import language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_fastllm_fp8", False):
        return
    sources = {tl.float32: (np.float32, None), tl.float16: (np.float16, None), tl.bfloat16: (np.int16, torch.bfloat16)}
    # e4m3 read as: torch dtype, its bits, and the bits' numpy dtype (the interpreter returns bits)
    targets = {tl.float32: (torch.float32, torch.int32, np.uint32),
               tl.float16: (torch.float16, torch.int16, np.uint16),
               tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16)}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float8e4nv and output_dtype in targets:
            dtype, bits, np_bits = targets[output_dtype]
            values = torch.from_numpy(np.frombuffer(input.tobytes(), dtype=np.uint8).copy())
            read = values.view(torch.float8_e4m3fn).to(dtype).view(bits).numpy().view(np_bits)
            return read.reshape(input.shape)
        if output_dtype != tl.float8e4nv or input_dtype not in sources:
            return original(input, input_dtype, output_dtype, rounding_mode)
        np_dtype, view = sources[input_dtype]
        values = torch.from_numpy(np.frombuffer(input.tobytes(), dtype=np_dtype).copy())
        if view is not None:
            values = values.view(view)
        rounded = values.float().clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return rounded.view(torch.uint8).numpy().reshape(input.shape)

    convert._fastllm_fp8 = True
    interpreter._convert_float = convert
