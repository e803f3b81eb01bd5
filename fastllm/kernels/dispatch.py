"""Kernel dispatch (fastllm.kernels.dispatch): the Triton kernel when the tensors are on CUDA and triton imports, else the reference.

Every op here has the signature of its twin in `reference.py`. `FASTLLM_KERNELS=reference` (read once, at
import) forces the plain-PyTorch path everywhere. The chosen path is logged once per op and path on the
"fastllm.kernels" logger, e.g. "paged_decode_attention: reference path (tensors on cpu)".
Triton is imported lazily, so this package imports (and runs the references) without it.

Tests and benchmarks call one implementation directly with `triton_impl(name)` / `reference_impl(name)`;
under TRITON_INTERPRET=1 the Triton implementations also run on CPU tensors.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Callable

import torch

from fastllm.kernels import reference

logger = logging.getLogger("fastllm.kernels")

KERNEL_NAMES = (
    "kv_cache_write",
    "paged_decode_attention",
    "prefill_attention",
    "fused_add_rms_norm",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "argmax",
    "rotary_kv_cache_write",
    "rotary_decode_attention",
    "linear",
    "add_rms_norm_linear",
    "gated_linear",
    "add_rms_norm_gated_linear",
    "rms_norm_folded_linear",
    "rms_norm_folded_gated_linear",
    "linear_add",
    "cascade_prefix_attention",
    "merge_attn_states",
    "cascade_decode_attention",
    "fp8_linear",
    "fp8_linear_quantized",
    "rms_norm_fp8",
    "fused_add_rms_norm_fp8",
    "silu_and_mul_fp8",
)
_MODULE = {  # op -> fastllm.kernels.<module> holding its Triton launcher
    "kv_cache_write": "kv_cache_write",
    "paged_decode_attention": "paged_decode_attention",
    "prefill_attention": "prefill_attention",
    "fused_add_rms_norm": "fused_add_rms_norm",
    "rms_norm": "fused_add_rms_norm",
    "rotary_embedding": "rotary",
    "silu_and_mul": "silu_and_mul",
    "argmax": "argmax",
    "rotary_kv_cache_write": "rotary_kv_cache_write",
    "rotary_decode_attention": "paged_decode_attention",
    "linear": "skinny_linear",
    "add_rms_norm_linear": "skinny_linear",
    "gated_linear": "skinny_linear",
    "add_rms_norm_gated_linear": "skinny_linear",
    "rms_norm_folded_linear": "skinny_linear",
    "rms_norm_folded_gated_linear": "skinny_linear",
    "linear_add": "skinny_linear",
    "cascade_prefix_attention": "cascade_attention",
    "merge_attn_states": "merge_attn_states",
    "cascade_decode_attention": "cascade_attention",
    "fp8_linear": "fp8_linear",
    "fp8_linear_quantized": "fp8_linear",
    "rms_norm_fp8": "fused_add_rms_norm",
    "fused_add_rms_norm_fp8": "fused_add_rms_norm",
    "silu_and_mul_fp8": "silu_and_mul",
}

_MODE = os.environ.get("FASTLLM_KERNELS", "auto").strip().lower() or "auto"
if _MODE not in ("auto", "reference"):
    raise ValueError(f"FASTLLM_KERNELS must be 'auto' or 'reference', got {_MODE!r}")

_chosen: dict[tuple[str, str], Callable] = {}  # (op, device type) -> implementation
_logged: set[tuple[str, str]] = set()  # (op, path) already logged


def reference_impl(name: str) -> Callable:
    if name not in KERNEL_NAMES:
        raise KeyError(f"unknown kernel {name!r}; known: {KERNEL_NAMES}")
    return getattr(reference, name)


def triton_impl(name: str) -> Callable:
    """The Triton launcher of `name` (imports triton; raises ImportError without it)."""
    if name not in KERNEL_NAMES:
        raise KeyError(f"unknown kernel {name!r}; known: {KERNEL_NAMES}")
    return getattr(importlib.import_module(f"fastllm.kernels.{_MODULE[name]}"), name)


def _select(name: str, device: torch.device) -> Callable:
    fn = _chosen.get((name, device.type))
    if fn is not None:
        return fn
    path, why = "reference", None
    if _MODE == "reference":
        why = "FASTLLM_KERNELS=reference"
    elif device.type != "cuda":
        why = f"tensors on {device.type}"
    else:
        try:
            fn = triton_impl(name)
            path, why = "triton", f"tensors on {device.type}"
        except Exception as e:  # triton missing, too old for the kernel module, or broken install
            why = f"triton unavailable: {e}"
    if fn is None:
        fn = reference_impl(name)
    _chosen[(name, device.type)] = fn
    if (name, path) not in _logged:
        _logged.add((name, path))
        logger.info("%s: %s path (%s)", name, path, why)
    return fn


Tensor = torch.Tensor


def kv_cache_write(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    return _select("kv_cache_write", key.device)(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    max_seq_len: int, scale: float, window: int | None = None, kv_start: Tensor | None = None,
    return_lse: bool = False, k_scale: float = 1.0, v_scale: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    return _select("paged_decode_attention", query.device)(
        query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale, window, kv_start, return_lse,
        k_scale, v_scale,
    )


def prefill_attention(
    query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
    seq_lens: Tensor, query_start_loc: Tensor, max_query_len: int, scale: float, window: int | None = None,
    kv_start: Tensor | None = None, return_lse: bool = False, tile_map: Tensor | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    return _select("prefill_attention", query.device)(
        query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
        window, kv_start, return_lse, tile_map, k_scale, v_scale,
    )


def cascade_prefix_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, prefix_rows: Tensor,
    prefix_lens: Tensor, rows: Tensor, row_start: Tensor, max_group_rows: int, max_prefix_len: int, scale: float,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    return _select("cascade_prefix_attention", query.device)(
        query, key_cache, value_cache, block_tables, prefix_rows, prefix_lens, rows, row_start, max_group_rows,
        max_prefix_len, scale, k_scale, v_scale,
    )


def merge_attn_states(out: Tensor, lse: Tensor, prefix_o: Tensor, prefix_lse: Tensor, rows: Tensor) -> None:
    return _select("merge_attn_states", out.device)(out, lse, prefix_o, prefix_lse, rows)


def cascade_decode_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    kv_start: Tensor, prefix_rows: Tensor, prefix_lens: Tensor, rows: Tensor, row_start: Tensor,
    max_group_rows: int, max_prefix_len: int, max_suffix_len: int, scale: float, k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    return _select("cascade_decode_attention", query.device)(
        query, key_cache, value_cache, block_tables, seq_lens, kv_start, prefix_rows, prefix_lens, rows,
        row_start, max_group_rows, max_prefix_len, max_suffix_len, scale, k_scale, v_scale,
    )


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _select("fused_add_rms_norm", x.device)(x, residual, weight, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _select("rms_norm", x.device)(x, weight, eps)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor, is_neox: bool = True,
    q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
) -> None:
    return _select("rotary_embedding", query.device)(positions, query, key, cos_sin_cache, is_neox,
                                                     q_norm_weight, k_norm_weight, norm_eps)


def silu_and_mul(x: Tensor) -> Tensor:
    return _select("silu_and_mul", x.device)(x)


def argmax(logits: Tensor, out: Tensor | None = None) -> Tensor:
    return _select("argmax", logits.device)(logits, out)


def rotary_kv_cache_write(
    positions: Tensor, query: Tensor, key: Tensor, value: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, return_kv: bool,
    q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    return _select("rotary_kv_cache_write", query.device)(
        positions, query, key, value, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping,
        return_kv, q_norm_weight, k_norm_weight, norm_eps, k_scale, v_scale,
    )


def rotary_decode_attention(
    positions: Tensor, query: Tensor, key: Tensor, value: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor,
    max_seq_len: int, scale: float, window: int | None = None,
    q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> Tensor:
    return _select("rotary_decode_attention", query.device)(
        positions, query, key, value, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping, block_tables,
        seq_lens, max_seq_len, scale, window, q_norm_weight, k_norm_weight, norm_eps, k_scale, v_scale,
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
    return _select("linear", x.device)(x, weight, bias, out)


def add_rms_norm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                        bias: Tensor | None) -> tuple[Tensor, Tensor]:
    return _select("add_rms_norm_linear", x.device)(x, residual, norm_weight, eps, weight, bias)


def gated_linear(x: Tensor, weight: Tensor) -> Tensor:
    return _select("gated_linear", x.device)(x, weight)


def add_rms_norm_gated_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor
                              ) -> tuple[Tensor, Tensor]:
    return _select("add_rms_norm_gated_linear", x.device)(x, residual, norm_weight, eps, weight)


def rms_norm_folded_linear(x: Tensor, unit_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
                           ) -> Tensor:
    return _select("rms_norm_folded_linear", x.device)(x, unit_weight, eps, weight, bias)


def rms_norm_folded_gated_linear(x: Tensor, unit_weight: Tensor, eps: float, weight: Tensor) -> Tensor:
    return _select("rms_norm_folded_gated_linear", x.device)(x, unit_weight, eps, weight)


def linear_add(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    return _select("linear_add", x.device)(x, weight, bias, residual)


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
               input_scale: Tensor | None = None) -> Tensor:
    return _select("fp8_linear", x.device)(x, weight, weight_scale, bias, input_scale)


def fp8_linear_quantized(x_q: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                         out_dtype: torch.dtype) -> Tensor:
    return _select("fp8_linear_quantized", x_q.device)(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def rms_norm_fp8(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _select("rms_norm_fp8", x.device)(x, weight, eps)


def fused_add_rms_norm_fp8(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                           ) -> tuple[Tensor, Tensor, Tensor]:
    return _select("fused_add_rms_norm_fp8", x.device)(x, residual, weight, eps)


def silu_and_mul_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    return _select("silu_and_mul_fp8", x.device)(x)
