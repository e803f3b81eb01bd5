"""What bounds a Triton kernel's programs a SM, read from its machine code on any machine (no GPU): the kernel
compiled for a GPU target (sm_90 by default) by Triton's own ptxas, then its cubin's registers a thread,
spilled bytes and shared memory (cuobjdump, which Triton's wheel ships). A kernel variant that needs a few
registers more than its neighbours can lose a program a SM, and with it a wave: APPEND held the new token's
k/v across decode attention's key loop, 136 registers against 102 (Triton 3.6), and took 1.76x the time at
B64 x 3840 over an FP8 cache (docs/fp8.md).

Run with TRITON_INTERPRET unset: the interpreter's kernels do not compile.

    python -m fastllm.bench.occupancy            # decode attention's variants (profiling/occupancy.py)
"""

from __future__ import annotations

import itertools
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Hopper's SM: 64K registers, 228 KB of shared memory (1 KB of it reserved per program), 64 warps, 32 programs
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_PROGRAM = 1024
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32


class Resources(NamedTuple):
    registers: int  # a thread
    spilled: int  # bytes a thread keeps in local memory (the stack ptxas reports)
    shared: int  # bytes a program
    num_warps: int

    def programs_per_sm(self) -> int:
        """Resident programs a SM: registers are allocated 256 a warp at a time."""
        per_warp = -(-self.registers * 32 // 256) * 256
        return min(REGISTERS_PER_SM // (per_warp * self.num_warps),
                   SHARED_PER_SM // (self.shared + SHARED_RESERVED_PER_PROGRAM),
                   MAX_WARPS_PER_SM // self.num_warps, MAX_PROGRAMS_PER_SM)


def compile_for(kernel, constexprs: dict[str, Any], types: dict[str, str], num_warps: int, num_stages: int,
                no_divisibility: frozenset[str] = frozenset(), capability: int = 90) -> Resources:
    """kernel (a @triton.jit function) compiled for `capability` with these constexprs. types: a parameter's
    Triton type where the default is wrong (pointers default to *bf16, other parameters to i32). Integer and
    pointer parameters carry the 16-divisibility hint a launch gives its aligned arguments, except those in
    no_divisibility (runtime sizes a launch does not specialize)."""
    assert isinstance(kernel, triton.runtime.JITFunction), "TRITON_INTERPRET's kernels do not compile"
    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        if param.name in constexprs:
            signature[param.name] = "constexpr"
            continue
        signature[param.name] = types.get(param.name, "*bf16" if param.name.endswith("_ptr") else "i32")
        if signature[param.name][0] in "*i" and param.name not in no_divisibility:
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return _resources(compiled.asm["cubin"], compiled.metadata.shared, num_warps)


def _resources(cubin: bytes, shared: int, num_warps: int) -> Resources:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout

    def field(name: str) -> int:
        return int(re.search(rf"\b{name}:(\d+)", usage).group(1))

    return Resources(field("REG"), field("STACK"), shared, num_warps)


def decode_attention(fp8_cache: bool, block_n: int, num_warps: int, num_stages: int, num_splits: int,
                     append: bool, qk_norm: bool = False) -> Resources:
    """paged_decode_attention's kernel as launch_chosen launches it for Llama-3-8B's heads (32 q heads, 8 KV
    heads, head_dim 128) under bf16 queries, over a bf16 or an FP8 cache, with PDL."""
    from fastllm.kernels import paged_decode_attention as pda

    group, head_dim = 4, 128
    flags = pda.fp8_dot_flags(pda.FP8 if fp8_cache else torch.bfloat16, torch.bfloat16, True, num_warps)
    constexprs = dict(
        GROUP=group, HEAD_DIM=head_dim, PAGE=16, BLOCK_G=pda.query_tile_rows(group, flags["SWAP_DOTS"]),
        BLOCK_D=head_dim, BLOCK_N=block_n,
        DIRECT_OUT=num_splits == 1, MERGE_IN_KERNEL=num_splits > 1, BLOCK_GM=group,
        BLOCK_S=pda.merge_block_s(group, head_dim, num_warps), PRECISION="tf32",  # (both powers of two)
        **flags,
        APPEND=append, IS_NEOX=True, HALF=head_dim // 2, QK_NORM=qk_norm, USE_PDL=True, OFFSET_64=False,
        HAS_KV_START=False, SLIDING=False, RETURN_LSE=False, CASCADE=False)
    cache = "*fp8e4nv" if fp8_cache else "*bf16"
    types = {"k_cache_ptr": cache, "v_cache_ptr": cache, "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
             "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "counters_ptr": "*i32", "pos_ptr": "*i64",
             "cos_sin_ptr": "*fp32", "slot_ptr": "*i64", "kv_start_ptr": "*i32", "lse_ptr": "*fp32",
             "prefix_o_ptr": "*fp32", "prefix_lse_ptr": "*fp32", "norm_eps": "fp32", "scale_log2": "fp32",
             "k_scale": "fp32", "v_scale": "fp32"}
    return compile_for(pda._decode_split_kernel, constexprs, types, num_warps, num_stages,
                       frozenset({"num_splits", "min_split_len", "stride_bt", "num_prefix_splits"}))


def persistent_decoder(num_sms: int = 132) -> Resources:
    """The persistent decoder kernel as the draft's rounds launch it for Qwen3-0.6B (bf16, q/k norms) on a
    GPU of num_sms SMs."""
    from fastllm.kernels import persistent_decoder as pd

    shape = pd.Shape(num_layers=28, hidden=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                     intermediate=3072, eps=1e-6)
    constexprs = pd.constexprs(shape, num_sms, pd.num_splits(1, shape.num_kv_heads, num_sms), has_bias=False,
                               is_neox=True, has_qk_norm=True, sync=True, trace=False)
    num_warps = constexprs.pop("num_warps")
    types = {name: "*i64" for name in ("ids_ptr", "pos_ptr", "slot_ptr", "trace")}
    types.update({name: "*i32" for name in ("table_ptr", "seq_len_ptr", "counters", "barrier")})
    types.update({name: "*fp32" for name in ("cos_sin", "part", "ml")})
    bf16 = ("embed", "norm1", "w_qkv", "b_qkv", "q_norm", "k_norm", "w_o", "norm2", "w_gate_up", "w_down",
            "final_norm", "kv_cache", "h", "qkv", "attn", "act", "out")
    types.update({name: "*bf16" for name in bf16})
    types.update(eps="fp32", scale="fp32")
    return compile_for(pd._decoder_kernel, constexprs, types, num_warps, 1,
                       frozenset({"num_rows", "num_layers", "block_size", "stride_table", "stride_cs"}))


def main() -> None:
    from fastllm.kernels.paged_decode_attention import TILE_CONFIGS

    print(f"decode attention (Llama-3-8B heads, bf16 queries, sm_90, Triton {triton.__version__}): "
          "registers a thread, spilled bytes, shared memory, programs a SM")
    columns = ("cache", "keys a tile, warps, stages", "splits", "APPEND", "registers", "spilled", "shared",
               "programs a SM")
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for fp8, tile, splits, (append, qk_norm) in itertools.product(
            (False, True), TILE_CONFIGS, (1, 2), ((False, False), (True, False), (True, True))):
        r = decode_attention(fp8, *tile, splits, append, qk_norm)
        kind = "with q/k norms" if qk_norm else "yes" if append else "no"
        print(f"| {'FP8' if fp8 else 'bf16'} | {tile} | {splits} | {kind} | {r.registers} | {r.spilled} | "
              f"{r.shared} | {r.programs_per_sm()} |", flush=True)


if __name__ == "__main__":
    main()
