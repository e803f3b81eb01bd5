"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

Their differences are config switches (LlamaArgs): qkv bias (Qwen2), per-head q/k RMSNorm
(Qwen3), rope scaling (Llama 3.1), tied embeddings, sliding windows per layer (Mistral, Qwen2/3). Parameter names follow Hugging Face's except
that q/k/v and gate/up are fused (qkv_proj, gate_up_proj); load_weights maps the checkpoint names.

The forward takes a flat batch: input_ids [T] and positions [T]; attention reads the step's
metadata from the forward context.

Tensor parallelism splits the heads and the MLP over the ranks (layers/linear.py), with the KV heads
replicated where there are fewer than ranks; Qwen3's q/k norms act on each head's head_dim, so every
rank applies the whole (replicated) weights to its own heads. Pipeline parallelism gives each stage a
contiguous run of decoder layers: the embedding lives on the first stage, the final norm and lm_head on
the last, and a stage receives its input (hidden states and residual) from the stage before it and
hands its output on, both inside the forward (communication.py's pp_recv / pp_send).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fastllm.config import sliding_windows
from fastllm.distributed import communication  # noqa: F401  (registers the pipeline's send/recv ops)
from fastllm.distributed.parallel_state import ParallelRank, stage_layers
from fastllm.layers.activation import SiluAndMul
from fastllm.layers.attention import Attention
from fastllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from fastllm.layers import fp8
from fastllm.layers.fp8 import Fp8Scheme
from fastllm.layers.linear import ColumnParallelLinear, RowParallelLinear, copy_into, fold_norm_weight
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
    fp8: Fp8Scheme | None = None  # FP8 linear weights (layers/fp8.py); None: the model's dtype
    # The RMSNorms' weights folded into qkv's and gate/up's columns after loading (fold_norms): a draft
    # model's, where its weights are 16/32-bit in one pipeline stage (registry.build_model)
    fold_norms: bool = False

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


def kv_partitions(num_kv_heads: int, tp_size: int) -> int:
    """Into how many slices the KV heads split: one per rank, or one per head when there are fewer
    heads than ranks (each head then replicated on tp_size / num_kv_heads ranks, as vLLM does)."""
    return min(num_kv_heads, tp_size)


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int, stage_index: int, parallel: ParallelRank):
        """layer_index: the layer's number in the model; stage_index: in this rank's pipeline stage (its
        attention layer's number in the forward context)."""
        super().__init__()
        tp_rank, tp = parallel.tp_rank, parallel.tp_size
        kv_parts = kv_partitions(args.num_kv_heads, tp)
        # This rank's heads.
        self.num_heads, self.num_kv_heads = args.num_heads // tp, args.num_kv_heads // kv_parts
        self.head_dim = args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = ColumnParallelLinear(args.hidden_size, [q_size, kv_size, kv_size], args.qkv_bias,
                                             tp_rank, tp, partitions=[tp, kv_parts, kv_parts], fp8=args.fp8)
        self.o_proj = RowParallelLinear(q_size, args.hidden_size, False, tp_rank, tp, fp8=args.fp8)
        # Qwen3: applied inside the attention op's rotary kernels, not launched on their own
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling)
        window = args.sliding_windows[layer_index] if args.sliding_windows else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, args.head_dim, args.head_dim ** -0.5,
                              stage_index, rotary, window)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor:
        """qkv: qkv_proj's output (the decoder layer runs it, its norm fused in) -> o_proj's (+ residual)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(positions, q, k, v, self.q_norm, self.k_norm)
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim), residual)


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs, parallel: ParallelRank):
        super().__init__()
        tp_rank, tp = parallel.tp_rank, parallel.tp_size
        width = args.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(args.hidden_size, [width, width], False, tp_rank, tp,
                                                 fp8=args.fp8)
        self.act = SiluAndMul(quantize_output=fp8.quantizes_ahead(args.fp8))
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size, False, tp_rank, tp,
                                           fp8=args.fp8)

    def activation(self, norm, hidden: torch.Tensor, residual: torch.Tensor | None):
        """(silu(gate) * up of norm(hidden + residual), hidden + residual): with 16/32-bit weights the SiLU in
        gate/up's epilogue at decode rows (and the norm in its loads at one row); with FP8 ones the norm and
        the SiLU kernel quantize for the projection after them."""
        if self.gate_up_proj.fp8 is not None:
            gate_up, residual = self.gate_up_proj.normed(norm, hidden, residual)
            return self.act(gate_up), residual
        return self.gate_up_proj.normed(norm, hidden, residual, gated=True)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int, stage_index: int, parallel: ParallelRank):
        super().__init__()
        self.self_attn = LlamaAttention(args, layer_index, stage_index, parallel)
        self.mlp = LlamaMLP(args, parallel)
        # With FP8 projections (per-token scales) the norms quantize their outputs for qkv and gate_up.
        quantize = fp8.quantizes_ahead(args.fp8)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, quantize_output=quantize)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, quantize_output=quantize)
        self.norms_folded = args.fold_norms

    def fold_norms(self) -> None:
        """Each norm's weight into the columns of the projection after it (rounded once); the norms keep a
        unit weight (their prefill path)."""
        for norm, proj in ((self.input_layernorm, self.self_attn.qkv_proj),
                           (self.post_attention_layernorm, self.mlp.gate_up_proj)):
            fold_norm_weight(proj.weight.data, norm.weight.data)
            norm.weight.data.fill_(1)

    def forward(self, positions, hidden, residual):
        if self.norms_folded:
            assert residual is None, "folded norms carry the residual stream whole"
            return self.forward_folded(positions, hidden), None
        # The residual stream is carried separately so each add fuses into the next norm, and the norm into
        # the projection after it.
        qkv, residual = self.self_attn.qkv_proj.normed(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, qkv)
        act, residual = self.mlp.activation(self.post_attention_layernorm, hidden, residual)
        return self.mlp.down_proj(act), residual

    def forward_folded(self, positions, h):
        """The residual stream h whole: qkv and gate/up scale their sums by 1 / rms(h) (the norms' weights in
        their columns), o and down add h in their epilogues, so a decode layer launches no norm or add."""
        qkv = self.self_attn.qkv_proj.rms_normed(self.input_layernorm, h)
        h = self.self_attn(positions, qkv, residual=h)
        act = self.mlp.gate_up_proj.rms_normed(self.post_attention_layernorm, h, gated=True)
        return self.mlp.down_proj(act, residual=h)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, parallel: ParallelRank):
        super().__init__()
        self.parallel = parallel
        self.layer_range = stage_layers(args.num_layers, parallel.pp_size, parallel.pp_rank)
        first = self.layer_range.start
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, parallel.tp_rank,
                                                   parallel.tp_size) if parallel.is_first_stage else None
        # Other stages' layers are empty placeholders, so parameter names keep the checkpoint's numbers.
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i, i - first, parallel) if i in self.layer_range
                                    else nn.Identity() for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if parallel.is_last_stage else None

    def stage_layers(self) -> list[LlamaDecoderLayer]:
        return [self.layers[i] for i in self.layer_range]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:  # a later pipeline stage: the previous stage's output
            # (Its dtype and width from a weight: a torch.dtype kept on the module breaks loading the
            # saved compiled forward.)
            like = self.layers[self.layer_range.start].input_layernorm.weight
            received = torch.ops.fastllm.pp_recv(input_ids, like, self.parallel.prev_stage_rank)
            hidden, residual = received[0], received[1]
        # Per-layer NVTX ranges are an eager-mode view: a compiled forward (which fuses across layers)
        # never reads the switch, so turning it on later neither recompiles nor trips a saved graph.
        per_layer = not torch.compiler.is_compiling() and layer_ranges_enabled()
        for i, layer in zip(self.layer_range, self.stage_layers()):
            if per_layer:
                with nvtx_range(f"layer{i}"):
                    hidden, residual = layer(positions, hidden, residual)
            else:
                hidden, residual = layer(positions, hidden, residual)
        if self.norm is None:  # not the last stage: hand on; the returned empty tensor keeps the send alive
            return torch.ops.fastllm.pp_send(hidden, residual, self.parallel.next_stage_rank)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, args: LlamaArgs, parallel: ParallelRank = ParallelRank()):
        super().__init__()
        self.args = args
        self.parallel = parallel
        self.model = LlamaModel(args, parallel)
        self.lm_head = None
        if parallel.is_last_stage:
            fp8_lm_head = args.fp8 is not None and args.fp8.lm_head
            self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, parallel.tp_rank,
                                          parallel.tp_size, fp8=fp8_lm_head)
            if args.tie_word_embeddings and parallel.is_first_stage and not fp8_lm_head:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden_size] (an empty tensor on a pipeline
        stage before the last, which hands its output to the next stage instead)."""
        return self.model(input_ids, positions)

    def process_weights_after_loading(self) -> None:
        """With args.fold_norms, the decoder layers' norms folded into their projections (the loader calls
        this once, after the weights are in)."""
        if self.args.fold_norms:
            for layer in self.model.stage_layers():
                layer.fold_norms()

    @property
    def computes_logits(self) -> bool:
        """Whether this rank's forward ends in hidden states that give logits (the last pipeline stage)."""
        return self.lm_head is not None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] in the model's dtype (gathered over the tensor-parallel ranks): the sampler
        upcasts only when it does more than an argmax (a float32 copy of [256, 128k] logits costs ~0.1
        ms a decode step on an H100). out: write them there (a CUDA graph's static buffer)."""
        return self.lm_head.compute_logits(hidden, out)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (a norm's: with FP8 weights a stage's first parameter may be e4m3)."""
        return self.model.stage_layers()[0].input_layernorm.weight.dtype

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.stage_layers()]

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """This rank's KV cache per block and token: (layers, KV heads, head_dim)."""
        layers = self.model.stage_layers()
        return len(layers), layers[0].self_attn.num_kv_heads, self.args.head_dim

    def owns(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (after fusing) belongs to this rank's pipeline stage."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.model.layer_range
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None or self._lm_head_reads_embedding
        if name.startswith(("model.norm.", "lm_head.")):
            return self.lm_head is not None
        return True

    @property
    def _lm_head_reads_embedding(self) -> bool:
        """Tied embeddings where the lm_head does not share the embedding's parameter (a last stage without
        the embedding, or an FP8 lm_head): it loads that table itself."""
        return self.args.tie_word_embeddings and self.lm_head is not None and \
            (self.model.embed_tokens is None or self.lm_head.fp8)

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint tensor parameter `name` is loaded from (the lm_head of a later stage with tied
        embeddings loads the embedding's)."""
        if name == "lm_head.weight" and self._lm_head_reads_embedding:
            return "model.embed_tokens.weight"
        return name

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The shape parameter `name` has with one rank: its whole checkpoint tensor (q/k/v and gate/up
        fused)."""
        module_name, param_name = name.rsplit(".", 1)
        module = self.get_submodule(module_name)
        param = getattr(module, param_name)
        if isinstance(module, ColumnParallelLinear):
            return (sum(module.full_sizes), *param.shape[1:])
        if isinstance(module, RowParallelLinear) and param_name == "weight":
            return (param.shape[0], param.shape[1] * module.tp_size)
        if isinstance(module, VocabParallelEmbedding):
            return (module.vocab_size, param.shape[1])
        return tuple(param.shape)

    def load_param(self, name: str, source, shard: int | None = None) -> None:
        """Copy this rank's part of a whole checkpoint tensor (or of output block `shard` of a fused
        parameter) into parameter `name`."""
        module_name, param_name = name.rsplit(".", 1)
        module = self.get_submodule(module_name)
        if shard is not None:
            module.load_shard(param_name, shard, source)
        elif hasattr(module, "load_weight"):
            module.load_weight(param_name, source)
        else:
            copy_into(getattr(module, param_name), source[:], name)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Copy checkpoint tensors (whole, or lazy safetensors slices) into this rank's parameters;
        every parameter must be covered. Tensors of other pipeline stages are skipped unread."""
        params = dict(self.named_parameters())
        # FP8 scales (buffers; fp8.check_loaded tells of missing ones)
        scales = {name for name, _ in self.named_buffers() if name.endswith(("weight_scale", "input_scale"))}
        # parameter -> the checkpoint tensors (shards of a fused one) it still lacks
        missing = {name: set(range(len(getattr(self.get_submodule(name.rsplit(".", 1)[0]), "full_sizes",
                                               [0])))) for name in params}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.args.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if (kv_scale := fp8.kv_scale_name(name)) is not None:  # an FP8 KV cache's scale
                if self.owns(kv_scale[0]):
                    fp8.load_kv_scale(self.get_submodule(kv_scale[0]).attn, kv_scale[1], tensor, name)
                continue
            shard = None
            for fragment, (fused, index) in self.stacked_params.items():
                if fragment in name:
                    name, shard = name.replace(fragment, fused), index
                    break
            if not self.owns(name):
                continue
            targets = [name]
            if name == "model.embed_tokens.weight" and self._lm_head_reads_embedding:
                targets = ["lm_head.weight"] + ([name] if self.model.embed_tokens is not None else [])
            for target in targets:
                if target not in params and target not in scales:
                    raise ValueError(f"checkpoint tensor {target!r} has no matching parameter in {type(self).__name__}")
                self.load_param(target, tensor, shard)
                missing.get(target, set()).discard(shard or 0)
        absent = sorted(name for name, shards in missing.items() if shards)
        if absent:
            raise ValueError(f"checkpoint is missing {len(absent)} tensors, e.g. {absent[:3]}")
