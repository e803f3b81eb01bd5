"""The draft model's one-token rounds as one launch each (kernels/persistent_decoder.py).

A small draft's decode round is latency-bound: ~150 launches of a few microseconds' work. DraftDecoder
stacks the draft's layer weights (its parameters become views of the stacks: no second copy) and runs a
round's decoder layers in one persistent kernel; the lm_head and sampling stay the model's.

Off unless FASTLLM_PERSISTENT_DRAFT=1: against the draft's forward graphed at the engine's attention bound,
its one-row round gains at short contexts only and loses from a few hundred cached keys, and the GPU suite
has not run with it on (docs/speculative_decoding.md), so the rounds run the forward by default.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fastllm.kernels import persistent_decoder as kernel
from fastllm.worker.attn_metadata import AttentionMetadata

_MAX_K = 4096  # the kernel holds a whole K of x and of each row of its W shares in registers
_MAX_PROJECTION_BYTES = 16 << 20  # a draft's projections: latency-bound, which is what the kernel is for


def unsupported(model, device: torch.device) -> str | None:
    """Why this model's rounds cannot run in the kernel (None: they can)."""
    args = model.args
    setting = os.environ.get("FASTLLM_PERSISTENT_DRAFT", "0").strip()
    if setting not in ("0", "1"):
        raise ValueError(f"FASTLLM_PERSISTENT_DRAFT must be 0 or 1, got {setting!r}")
    if setting == "0":
        return "FASTLLM_PERSISTENT_DRAFT is not 1 (opt-in)"
    if device.type != "cuda":
        return f"a {device.type} device (the kernel's programs wait for each other: a GPU's)"
    if model.parallel.tp_size > 1 or model.parallel.pp_size > 1:
        return "a draft split over ranks"
    if args.fp8 is not None:
        return "FP8 weights"
    if any(w is not None for w in args.sliding_windows):
        return "sliding windows"
    if model.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {model.dtype}"
    d = args.head_dim
    if d & (d - 1) or d < 2:
        return f"head_dim {d} (not a power of two)"
    widths = (args.hidden_size, args.intermediate_size, args.num_heads * d)
    if max(widths) > _MAX_K:
        return f"widths {widths} (over {_MAX_K})"
    largest = 2 * args.intermediate_size * args.hidden_size * model.dtype.itemsize
    if largest > _MAX_PROJECTION_BYTES:
        return f"projections of up to {largest >> 20} MiB (a model this large is not launch-bound)"
    held = kernel.held_share_bytes(_shape(model), kernel.grid(device), model.dtype.itemsize)
    if held > kernel.MAX_SHARE_BYTES:
        return (f"a program's weight shares of {held >> 10} KiB on {kernel.grid(device)} SMs (its registers "
                f"hold {kernel.MAX_SHARE_BYTES >> 10})")
    return None


def _shape(model) -> kernel.Shape:
    args = model.args
    return kernel.Shape(args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                        args.intermediate_size, args.rms_norm_eps)


def _stack(params: list[nn.Parameter]) -> torch.Tensor:
    """One tensor [L, ...] of the layers' parameters, which become its views."""
    stacked = torch.stack([p.data for p in params])
    for i, p in enumerate(params):
        p.data = stacked[i]
    return stacked


class DraftDecoder:
    def __init__(self, model):
        """model: a LlamaForCausalLM (unsupported(model) is None, or a test's CPU model under the
        interpreter)."""
        args = model.args
        layers = model.model.stage_layers()
        attn = layers[0].self_attn

        def stack(get) -> torch.Tensor:
            return _stack([get(layer) for layer in layers])

        qk_norm = attn.q_norm is not None
        self.weights = kernel.Weights(
            embed=model.model.embed_tokens.weight,
            norm1=stack(lambda layer: layer.input_layernorm.weight),
            w_qkv=stack(lambda layer: layer.self_attn.qkv_proj.weight),
            b_qkv=stack(lambda layer: layer.self_attn.qkv_proj.bias) if args.qkv_bias else None,
            q_norm=stack(lambda layer: layer.self_attn.q_norm.weight) if qk_norm else None,
            k_norm=stack(lambda layer: layer.self_attn.k_norm.weight) if qk_norm else None,
            w_o=stack(lambda layer: layer.self_attn.o_proj.weight),
            norm2=stack(lambda layer: layer.post_attention_layernorm.weight),
            w_gate_up=stack(lambda layer: layer.mlp.gate_up_proj.weight),
            w_down=stack(lambda layer: layer.mlp.down_proj.weight),
            final_norm=model.model.norm.weight)
        self.shape = _shape(model)
        rotary = attn.attn.rotary
        self.cos_sin, self.is_neox, self.scale = rotary.cos_sin_cache, rotary.is_neox, attn.attn.scale
        device = self.weights.w_qkv.device
        self.scratch = kernel.Scratch(self.shape, self.weights.w_qkv.dtype, device)
        self.out = torch.zeros(1, args.hidden_size, dtype=self.weights.w_qkv.dtype, device=device)
        self.kv_cache: torch.Tensor | None = None  # the draft's CacheEngine pool, once allocated

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
                 ) -> torch.Tensor:
        """The draft's final hidden state [1, H] of a one-request round's token (its decode metadata)."""
        return kernel.launch(input_ids, positions, metadata.slot_mapping, metadata.block_tables,
                             metadata.seq_lens, self.weights, self.shape, self.kv_cache, self.cos_sin,
                             self.is_neox, self.scale, self.scratch, self.out)
