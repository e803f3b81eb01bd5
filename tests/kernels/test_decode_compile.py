"""The decode attention kernel over an FP8 cache compiled for sm_90 on the CPU (Triton's own ptxas, no
device), under every query dtype, with the flags the launcher passes on a GPU (fp8_dot_flags), as 4-warp
programs and as the one-warp ones whose dots are swapped: the inline PTX that keeps V's conversion in
registers runs on the GPU only, so the interpreter never sees it; a wrong
operand width there aborts the process in LLVM (float32's V took a pair-of-fp16 move once). Also a decode
cascade's two kernels, whose PDL trigger and wait the interpreter never runs, and the mixed steps' merge.

The compile runs in a child process: under TRITON_INTERPRET=1 @triton.jit gives interpreted functions."""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastllm.kernels import paged_decode_attention as P
from tests.kernels.kernel_testing import compiles_in_a_child

_TRITON_TYPE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
_FLOATS = {"norm_eps", "scale_log2", "k_scale", "v_scale"}  # other scalars: int32
_FP32_POINTERS = {"part_o_ptr", "part_lse_ptr", "lse_ptr", "prefix_o_ptr", "prefix_lse_ptr", "o_ptr"}


def compile_decode(query_dtype: torch.dtype, num_warps: int) -> None:
    """num_warps 1: the table's one-warp programs (their dots swapped under 16-bit queries), split."""
    q = _TRITON_TYPE[query_dtype]
    flags = P.fp8_dot_flags(P.FP8, query_dtype, on_gpu=True, num_warps=num_warps)
    constexprs = dict(GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_G=P.query_tile_rows(4, flags["SWAP_DOTS"]),
                      BLOCK_D=128, BLOCK_N=64 if num_warps == 4 else 32, DIRECT_OUT=num_warps == 4,
                      MERGE_IN_KERNEL=num_warps == 1, BLOCK_GM=4, BLOCK_S=P.merge_block_s(4, 128, num_warps),
                      APPEND=False, IS_NEOX=True, HALF=64, QK_NORM=False, USE_PDL=True, OFFSET_64=False,
                      HAS_KV_START=False, SLIDING=False, RETURN_LSE=False, CASCADE=False,
                      PRECISION="ieee" if query_dtype == torch.float32 else "tf32", **flags)
    compile_sm90(P._decode_split_kernel, constexprs,
                 {"q_ptr": q, "out_ptr": q, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}, num_warps)


def compile_cascade() -> None:
    """A decode cascade's two kernels (bf16): the prefix's PDL trigger, the suffix's wait and merge."""
    from fastllm.kernels import cascade_attention as C

    bf16 = {name: "*bf16" for name in ("q_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr")}
    compile_sm90(P._decode_split_kernel, dict(
        GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, DIRECT_OUT=False,
        MERGE_IN_KERNEL=True, BLOCK_GM=4, BLOCK_S=16, APPEND=False, IS_NEOX=True, HALF=64, QK_NORM=False,
        USE_PDL=True, OFFSET_64=False, HAS_KV_START=True, SLIDING=False, RETURN_LSE=True, CASCADE=True,
        PRECISION="tf32", DOT_F16=False, V_IN_REGISTERS=False, SWAP_DOTS=False), bf16)
    compile_sm90(C._cascade_prefix_kernel, dict(GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_D=128, BLOCK_M=64,
                                                BLOCK_N=64, PRECISION="tf32", TRIGGER=True,
                                                BY_QUERY_ROW=True), bf16)
    from fastllm.kernels import merge_attn_states as M  # a mixed step's merge launch

    compile_sm90(M._merge_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_H=4), bf16)


def compile_sm90(kernel, constexprs: dict, pointers: dict, num_warps: int = 4) -> None:
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*fp32" if name in _FP32_POINTERS else "*i32")
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
    assert set(constexprs) <= set(kernel.arg_names), set(constexprs) - set(kernel.arg_names)
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 2})


def test_fp8_cache_decode_builds_for_sm90_under_every_query_dtype():
    compiles_in_a_child("tests.kernels.test_decode_compile")


if __name__ == "__main__":
    for dtype in _TRITON_TYPE:
        for warps in (4, 1):
            compile_decode(dtype, warps)
    compile_cascade()
    print("compiled", 2 * len(_TRITON_TYPE) + 3, "kernels")
