"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

Their differences are config switches (LlamaArgs): qkv bias (Qwen2), per-head q/k RMSNorm
(Qwen3), rope scaling (Llama 3.1), tied embeddings, sliding windows per layer (Mistral, Qwen2/3). Parameter names follow Hugging Face's except
that q/k/v and gate/up are fused (qkv_proj, gate_up_proj); load_weights maps the checkpoint names.

The forward takes a flat batch: input_ids [T] and positions [T]; attention reads the step's
metadata from the forward context.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fastllm.config import sliding_windows
from fastllm.kernels import dispatch as kernels
from fastllm.layers.activation import SiluAndMul
from fastllm.layers.attention import Attention
from fastllm.layers.linear import Linear, MergedLinear
from fastllm.layers.norm import RMSNorm
from fastllm.layers.rotary import RotaryEmbedding, rope_parameters
from fastllm.tracing import layer_ranges_enabled, nvtx_range

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer (config.sliding_windows); () for none

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArgs":
        arch = (cfg.get("architectures") or [""])[0]
        num_heads = cfg["num_attention_heads"]
        theta, scaling = rope_parameters(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_windows=sliding_windows(cfg),
        )


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = MergedLinear(args.hidden_size, [q_size, kv_size, kv_size], bias=args.qkv_bias)
        self.o_proj = Linear(q_size, args.hidden_size)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling)
        self.attn = Attention(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim ** -0.5, layer_index,
                              rotary, args.sliding_windows[layer_index] if args.sliding_windows else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(positions, q, k, v)
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_up_proj = MergedLinear(args.hidden_size, [args.intermediate_size] * 2)
        self.act = SiluAndMul()
        self.down_proj = Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int):
        super().__init__()
        self.self_attn = LlamaAttention(args, layer_index)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        # The residual stream is carried separately so each add fuses into the next norm.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        # Per-layer NVTX ranges are an eager-mode view: a compiled forward (which fuses across layers)
        # never reads the switch, so turning it on later neither recompiles nor trips a saved graph.
        per_layer = not torch.compiler.is_compiling() and layer_ranges_enabled()
        for i, layer in enumerate(self.layers):
            if per_layer:
                with nvtx_range(f"layer{i}"):
                    hidden, residual = layer(positions, hidden, residual)
            else:
                hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits in the model's dtype: the sampler upcasts only when it does more than an argmax
        (a float32 copy of [256, 128k] logits costs ~0.1 ms a decode step on an H100). out: write
        them there (a CUDA graph's static buffer); the same kernel as lm_head's forward."""
        if out is None:
            return self.lm_head(hidden)
        return kernels.linear(hidden, self.lm_head.weight, None, out=out)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters; every parameter must be covered."""
        params = dict(self.named_parameters())
        missing = {name: set(range(len(getattr(self.get_submodule(name.rsplit(".", 1)[0]), "output_sizes", [0]))))
                   for name in params}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.args.tie_word_embeddings and name == "lm_head.weight"):
                continue
            shard = None
            for fragment, (fused, index) in self.stacked_params.items():
                if fragment in name:
                    name, shard = name.replace(fragment, fused), index
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            if shard is None:
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
                shard = 0
            else:
                module_name, param_name = name.rsplit(".", 1)
                self.get_submodule(module_name).load_shard(param_name, shard, tensor)
            missing[name].discard(shard)
        absent = sorted(name for name, shards in missing.items() if shards)
        if absent:
            raise ValueError(f"checkpoint is missing {len(absent)} tensors, e.g. {absent[:3]}")
