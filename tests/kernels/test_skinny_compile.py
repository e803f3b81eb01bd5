"""The weight-streaming kernels compiled for real GPUs on the CPU (Triton's own ptxas, no device): every
launch config in their tables builds for sm_90 and fits the 99 KB of shared memory a block has on sm_89 (the
smallest GPU FP8 runs on), split K builds in every variant, every config builds gated (gated_config's
halved tiles, the SiLU in the epilogue), and so do the fused norm's loads on the one-row FMA configs, gated
or not. So do the kernels that quantize the e4m3
kernel's activations (the quantizer, with rows held in registers up to its widest and rows it loops over; the
RMSNorm and SiLU-and-mul kernels' quantizing variants) and the e4m3 kernel's one row taking them. The
interpreter runs the kernels' math in the other tests; this is what it cannot see: a construct the GPU
compiler rejects, or a config too large.

The compiles run in a child process: under TRITON_INTERPRET=1 (the CPU suite's setting) @triton.jit gives
interpreted functions, which do not compile."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastllm.kernels import fp8_quantize as Q
from fastllm.kernels import fp8_skinny_linear as F
from fastllm.kernels import fused_add_rms_norm as N
from fastllm.kernels import silu_and_mul as A
from fastllm.kernels import skinny_linear as S
from tests.kernels.kernel_testing import compiles_in_a_child

SM89_SHARED_BYTES = 99 * 1024
SM90_SHARED_BYTES = 227 * 1024  # the H100's and H200's most a block may take
_SHAPE_ARGS = {"num_rows": "i32", "n_out": "i32", "k_in": "i32", "stride_xm": "i32"}
_SPLIT_ARGS = {"part_ptr": "*fp32", "counters_ptr": "*i32"}
SPLIT_VARIANTS = [(S.Config(32, 256, 4, 3, True, split_k=4), 8), (S.Config(8, 1024, 4, 2, False, split_k=2), 1)]


def compile_for(capability: int, fn, signature: dict, constexprs: dict, cfg: S.Config) -> int:
    """Compile for sm_<capability>; returns the shared memory a block takes."""
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", capability, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return kernel.metadata.shared


def bf16_kernel(capability: int, cfg: S.Config, rows: int, prologue: int = S.PLAIN, gated: bool = False,
                add_residual: bool = False) -> int:
    dot = cfg.use_dot or rows > 1
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", **_SPLIT_ARGS,
                 **_SHAPE_ARGS, "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "res_out_ptr": "*bf16",
                 "stride_rm": "i32", "eps": "fp32"}
    constexprs = dict(HAS_BIAS=True, BLOCK_M=max(16, rows) if dot else 1, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, EVEN_K=True, USE_DOT=dot, SWAP_AB=dot and cfg.swap_ab,
                      SPLIT_K=cfg.split_k, USE_PDL=capability >= 90,
                      PREFETCH_LINES=0, LINE=64, PROLOGUE=prologue, GATED=gated, ADD_RESIDUAL=add_residual)
    return compile_for(capability, S._skinny_linear_kernel, signature, constexprs, cfg)


def fp8_kernel(capability: int, cfg: S.Config, rows: int, prequant: bool = False, swap_ab: bool = True) -> int:
    """bf16 outputs (SWAP_AB where the dot runs); swap_ab=False: float32's unswapped dot."""
    dot = cfg.use_dot or rows > 1
    prequant = prequant or dot
    signature = {"x_ptr": "*fp8e4nv" if prequant else "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                 "bias_ptr": "*fp32", "input_scale_ptr": "*fp32", "out_ptr": "*bf16", **_SPLIT_ARGS, **_SHAPE_ARGS}
    constexprs = dict(HAS_BIAS=True, STATIC=False, PREQUANT=prequant, BLOCK_M=max(16, rows) if dot else 1,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True, USE_DOT=dot,
                      SWAP_AB=dot and swap_ab, SPLIT_K=cfg.split_k, FP8_MAX=448.0, MIN_AMAX=1e-12,
                      USE_PDL=capability >= 90, PREFETCH_LINES=0, LINE=128)
    return compile_for(capability, F._fp8_skinny_linear_kernel, signature, constexprs, cfg)


def quantize_kernel(capability: int, one_pass: bool, static: bool) -> int:
    block_k = triton.next_power_of_2(Q.ONE_PASS_MAX_K) if one_pass else Q._BLOCK_K
    signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "static_scale_ptr": "*fp32",
                 "k_in": "i32", "stride_xm": "i32"}
    constexprs = dict(STATIC=static, ONE_PASS=one_pass, BLOCK_K=block_k, FP8_MAX=448.0, MIN_AMAX=1e-12,
                      USE_PDL=capability >= 90)
    return compile_for(capability, Q._quantize_rows_kernel, signature, constexprs,
                       S.Config(0, block_k, Q.num_warps(block_k), 3))


def quantizing_norm_and_silu(capability: int) -> None:
    """Llama-3.1-8B's widths: the norm's 4096 (one row a program, 4 warps), SiLU-and-mul's 14336 (16 warps)."""
    norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv", "res_out_ptr": "*bf16",
            "scale_ptr": "*fp32", "num_rows": "i32", "num_heads": "i32", "n_cols": "i32", "eps": "fp32",
            "stride_xa": "i32", "stride_xh": "i32", "stride_ra": "i32", "stride_rh": "i32"}
    constexprs = dict(HAS_RESIDUAL=True, BLOCK_R=1, BLOCK_N=4096, QUANT=True, FP8_MAX=448.0, MIN_AMAX=1e-12,
                      USE_PDL=capability >= 90)
    compile_for(capability, N._rms_norm_kernel, norm, constexprs, S.Config(0, 0, 4, 3))
    silu = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_xt": "i32", "inter": "i32"}
    constexprs = dict(BLOCK=16384, FP8_MAX=448.0, MIN_AMAX=1e-12, USE_PDL=capability >= 90)
    compile_for(capability, A._silu_and_mul_fp8_kernel, silu, constexprs, S.Config(0, 0, Q.num_warps(16384), 3))


def gated_table() -> list[tuple[int, S.Config]]:
    """(row bucket, config) of every config gated_config can return: the table's, gated, and its own."""
    return sorted({(bucket, S.gated_tiles(cfg, bucket)) for bucket, cfg in table(S)}
                  | {(bucket, cfg) for (bucket, _, _), cfg in S._GATED_TUNED.items()})


def table(module) -> list[tuple[int, S.Config]]:
    """(row bucket, config) of every config the module's table can return."""
    tuned = {(bucket, cfg) for (bucket, _, _), cfg in module._TUNED.items()}
    if module is F:  # the dot's default at every bucket; one row in 16 bits' configs
        one_row = {F._ONE_ROW_16BIT, *F._ONE_ROW_16BIT_TUNED.values()}
        dot = {(bucket, F._DOT) for bucket in S._DEFAULT if bucket <= F.MAX_ROWS}
        return sorted(tuned | dot | {(1, cfg) for cfg in one_row})
    return sorted(tuned | set(module._DEFAULT.items()))


def check_all() -> None:
    for kernel, module in ((bf16_kernel, S), (fp8_kernel, F)):
        for bucket, cfg in table(module):
            shared = kernel(89, cfg, bucket)
            assert shared <= SM89_SHARED_BYTES, (kernel.__name__, bucket, cfg, shared)
            assert kernel(90, cfg, bucket) <= SM90_SHARED_BYTES, (kernel.__name__, bucket, cfg)
        for cfg, rows in SPLIT_VARIANTS:
            kernel(90, cfg, rows)
    for bucket, gated in gated_table():
        assert bf16_kernel(89, gated, bucket, gated=True) <= SM89_SHARED_BYTES, (bucket, gated)
        assert bf16_kernel(90, gated, bucket, gated=True) <= SM90_SHARED_BYTES, (bucket, gated)
    for bucket, cfg in table(S):  # the fused norm's loads: the one-row FMA configs, gated or not
        gated = S.gated_tiles(cfg, bucket)
        if bucket == 1 and not cfg.use_dot:
            for config, is_gated in ((cfg, False), (gated, True)):
                shared = bf16_kernel(89, config, bucket, S.ADD_RMS_NORM, is_gated)
                assert shared <= SM89_SHARED_BYTES, (bucket, cfg)
                bf16_kernel(90, config, bucket, S.ADD_RMS_NORM, is_gated)
    # a folded model's decode layers (sm_90): qkv and gate/up with the sums of squares (their x @ x^T under
    # tl.dot; launched unsplit, never swapped), o and down with the residual in their epilogue
    folded = [(bucket, S.unsplit(cfg)) for bucket, cfg in table(S) if not cfg.swap_ab]
    for bucket, cfg in folded:
        assert bf16_kernel(90, cfg, bucket, S.RMS_NORM_FOLDED) <= SM90_SHARED_BYTES, (bucket, cfg)
    for bucket, cfg in table(S):
        bf16_kernel(90, cfg, bucket, add_residual=True)
    folded_gated = [(bucket, cfg) for bucket, cfg in gated_table() if not cfg.swap_ab]
    for bucket, gated in folded_gated:
        assert bf16_kernel(90, gated, bucket, S.RMS_NORM_FOLDED, True) <= SM90_SHARED_BYTES, (bucket, gated)
    for bucket, cfg in table(F):  # float32 outputs: the unswapped dot
        fp8_kernel(90, cfg, bucket, swap_ab=False)
    for one_pass in (True, False):
        for static in (True, False):
            for capability in (89, 90):
                assert quantize_kernel(capability, one_pass, static) <= SM89_SHARED_BYTES
    for capability in (89, 90):
        quantizing_norm_and_silu(capability)
        fp8_kernel(capability, F._ONE_ROW_16BIT, 1, prequant=True)
    fused = 4 * sum(bucket == 1 and not cfg.use_dot for bucket, cfg in table(S))
    plain = sum(2 * len(table(m)) + len(SPLIT_VARIANTS) for m in (S, F)) + len(table(F)) + 14
    plain += 2 * len(gated_table()) + len(folded) + len(table(S)) + len(folded_gated)
    print("compiled", plain + fused, "kernels")


def test_every_table_config_and_split_k_build_for_sm90_and_fit_sm89_shared_memory():
    compiles_in_a_child("tests.kernels.test_skinny_compile")


if __name__ == "__main__":
    check_all()
