"""Bytes and FLOPs of a Llama-family step, the floor they set against measured ceilings, and a
report over a `fastllm bench` JSON.

Model math (decode step of B requests, request i attending over ctx_i tokens, ctx_i counting
the new one):
  bytes = weights read once + KV read
        = (all parameters - the input embedding table when untied + the B embedding rows) x dtype bytes
          (FP8 weights: the decoder layers' projections 1 byte each)
          + sum_i ctx_i x kv_bytes_per_token,  kv_bytes_per_token = 2 (K, V) x layers x kv_heads x head_dim x kv dtype bytes
  flops = 2 x matmul_params x B + 4 x layers x heads x head_dim x sum_i ctx_i
matmul_params are the weights of the linear layers (qkv, o, gate_up, down per layer, and lm_head):
the non-embedding parameters less the norms (0.01 % of an 8B model). The untied input embedding is
a gather of B rows, not a read of the table, so it is left out of the weight bytes; activations and
the new token's KV write are left out as well (< 0.1 % at these sizes).
Floor of a step = max(bytes / copy bandwidth, flops / matmul rate), both measured on the GPU.

    python -m fastllm.bench.roofline run.json                       # report of a bench run
    python -m fastllm.bench.roofline --model llama-3.1-8b --batch-size 32 --context 256 [--ceilings c.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fastllm.layers.fp8 import Fp8Scheme
from fastllm.models.llama import LlamaArgs

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelShape(LlamaArgs):
    """A model's shape (LlamaArgs, the one parser of HF configs) and the bytes of its weights and KV."""

    dtype_bytes: int = 2  # weights
    kv_dtype_bytes: int = 2

    @classmethod
    def from_hf_config(cls, cfg: dict, dtype: str = "auto", fp8: Fp8Scheme | None = None) -> "ModelShape":
        """fp8: the model's FP8 scheme (its projections' weights are 1 byte each)."""
        if dtype == "auto":
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
        nbytes = DTYPE_BYTES.get(dtype, 4)
        return replace(super().from_hf_config(cfg), dtype_bytes=nbytes, kv_dtype_bytes=nbytes, fp8=fp8)

    @classmethod
    def from_model(cls, model: str | None, dtype: str = "auto", quantization: str | None = None,
                   quantize_lm_head: bool = False) -> "ModelShape":
        """From a model directory or an embedded config name (as --model takes); quantization and
        quantize_lm_head as the engine arguments (an FP8 checkpoint is FP8 whatever they say)."""
        from fastllm.config import resolve_model_path
        from fastllm.layers.fp8 import scheme_for

        path = Path(resolve_model_path(model)) / "config.json"
        cfg = json.loads(path.read_text())
        return cls.from_hf_config(cfg, dtype, scheme_for(quantization, cfg, quantize_lm_head))

    # parameter counts

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return h * self.qkv_size + self.num_heads * self.head_dim * h + h * 2 * i + i * h

    @property
    def matmul_params(self) -> int:
        """Weights of the linear layers, lm_head included: 2 FLOPs each per token."""
        return self.num_layers * self.layer_matmul_params + self.vocab_size * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter once (a tied lm_head is the embedding)."""
        per_layer = (self.layer_matmul_params + 2 * self.hidden_size
                     + (self.qkv_size if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0))
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + self.hidden_size + self.embedding_params + lm_head

    @property
    def fp8_lm_head(self) -> bool:
        return self.fp8 is not None and self.fp8.lm_head

    @property
    def weight_bytes(self) -> int:
        """Every parameter once, in bytes; FP8 weights (quantization) hold the decoder layers' projections
        in 1 byte each (their scales, 4 bytes a row, left out), and with quantize_lm_head lm_head too (tied:
        an e4m3 copy of the table beside the embedding)."""
        fp8_saved = self.num_layers * self.layer_matmul_params * (self.dtype_bytes - 1) if self.fp8 else 0
        if self.fp8_lm_head:
            lm_head = self.vocab_size * self.hidden_size
            fp8_saved += -lm_head if self.tie_word_embeddings else lm_head * (self.dtype_bytes - 1)
        return self.num_params * self.dtype_bytes - fp8_saved

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    # one step

    def decode_weight_bytes(self, batch_size: int) -> int:
        """Weights one decode step of batch_size requests reads from memory."""
        if self.tie_word_embeddings and not self.fp8_lm_head:  # lm_head reads the table the gather hits
            return self.weight_bytes
        gathered = batch_size * self.hidden_size
        return self.weight_bytes - (self.embedding_params - gathered) * self.dtype_bytes

    def decode_bytes(self, context_lens: Sequence[int]) -> int:
        return self.decode_weight_bytes(len(context_lens)) + self.kv_bytes_per_token * sum(context_lens)

    def attention_flops(self, num_query_tokens_x_context: int) -> int:
        """QK^T and PV: 2 matmuls x 2 FLOPs x head_dim per (query token, key) pair, per head and layer."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * num_query_tokens_x_context

    def decode_flops(self, context_lens: Sequence[int]) -> int:
        return 2 * self.matmul_params * len(context_lens) + self.attention_flops(sum(context_lens))

    def prefill_flops(self, prompt_lens: Sequence[int]) -> int:
        """Whole prompts, causal attention, lm_head on the last token of each only."""
        lm_head = self.vocab_size * self.hidden_size
        tokens = sum(prompt_lens)
        pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
        return 2 * (self.matmul_params - lm_head) * tokens + 2 * lm_head * len(prompt_lens) + self.attention_flops(pairs)

    def summary(self) -> dict:
        return {**asdict(self), "num_params": self.num_params, "matmul_params": self.matmul_params,
                "kv_bytes_per_token": self.kv_bytes_per_token, "weight_bytes": self.weight_bytes}


# floors against ceilings

def floor_seconds(num_bytes: float, flops: float, ceilings: dict | None) -> dict:
    """Time the memory system and the tensor cores need at their measured rates; the floor is the larger."""
    if not ceilings or not ceilings.get("copy_bytes_per_s") or not ceilings.get("matmul_flops_per_s"):
        return {"memory_s": None, "compute_s": None, "floor_s": None, "bound": None}
    memory_s = num_bytes / ceilings["copy_bytes_per_s"]
    compute_s = flops / ceilings["matmul_flops_per_s"]
    return {"memory_s": memory_s, "compute_s": compute_s, "floor_s": max(memory_s, compute_s),
            "bound": "memory" if memory_s >= compute_s else "compute"}


def report(run: dict, ceilings: dict | None = None) -> "pandas.DataFrame":  # noqa: F821
    """Per batch size of a latency run: bytes and FLOPs per decode step, their floors, the measured step."""
    import pandas as pd

    ceilings = ceilings or run.get("ceilings")
    rows = []
    for r in run.get("rows", []):
        if r.get("bytes_per_step") is None or r.get("tpot_ms_mean") is None:
            continue
        f = floor_seconds(r["bytes_per_step"], r["flops_per_step"], ceilings)
        ms = lambda s: None if s is None else s * 1e3  # noqa: E731
        measured = r["tpot_ms_mean"]
        rows.append({
            "batch_size": r["batch_size"],
            "GB/step": r["bytes_per_step"] / 1e9,
            "GFLOP/step": r["flops_per_step"] / 1e9,
            "memory_floor_ms": ms(f["memory_s"]),
            "compute_floor_ms": ms(f["compute_s"]),
            "bound": f["bound"],
            "roofline_ms": ms(f["floor_s"]),
            "matmul_chain_ms": r.get("floor_ms"),
            "measured_ms": measured,
            "roofline/measured": None if f["floor_s"] is None else f["floor_s"] * 1e3 / measured,
        })
    return pd.DataFrame(rows)


def _format(df) -> str:
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", None, "display.float_format", "{:.3f}".format):
        return df.astype(object).where(df.notna(), "n/a").to_string(index=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roofline", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", help="JSON written by fastllm bench --output-json (latency mode)")
    parser.add_argument("--ceilings", help="ceilings JSON (default: the ones in the run)")
    parser.add_argument("--model", help="print one step's math for this model instead of reading a run")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=["fp8", "fp8-per-tensor"], default=None,
                        help="with --model: FP8 weights (the projections at one byte each)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="with --model and --quantization: lm_head at one byte a weight too")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=256, help="tokens each request attends over")
    args = parser.parse_args(argv)
    try:
        ceilings = json.loads(Path(args.ceilings).read_text()) if args.ceilings else None
        if args.run is None:
            shape = ModelShape.from_model(args.model, args.dtype, args.quantization, args.quantize_lm_head)
            ctx = [args.context] * args.batch_size
            num_bytes, flops = shape.decode_bytes(ctx), shape.decode_flops(ctx)
            f = floor_seconds(num_bytes, flops, ceilings)
            print(f"{args.model or 'default model'}: {shape.num_params / 1e9:.3f} B params, "
                  f"{shape.kv_bytes_per_token} KV bytes/token")
            print(f"decode step, batch {args.batch_size}, context {args.context}: {num_bytes / 1e9:.3f} GB, "
                  f"{flops / 1e9:.1f} GFLOP, arithmetic intensity {flops / num_bytes:.1f} FLOP/B")
            if f["floor_s"] is not None:
                print(f"floor {f['floor_s'] * 1e3:.3f} ms ({f['bound']} bound: memory {f['memory_s'] * 1e3:.3f} ms, "
                      f"compute {f['compute_s'] * 1e3:.3f} ms)")
            return 0
        run = json.loads(Path(args.run).read_text())
    except (OSError, ValueError) as e:
        print(f"roofline: error: {e}", file=sys.stderr)
        return 2
    ceilings = ceilings or run.get("ceilings")
    meta = run.get("meta", {})
    print(f"{meta.get('model')} on {meta.get('device')} (torch {meta.get('torch')}, commit {meta.get('commit')})")
    if ceilings:
        print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
              f"bf16 matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s ({ceilings.get('device')})")
    else:
        print("no ceilings in this run (CPU?): floors are n/a; pass --ceilings FILE")
    df = report(run, ceilings)
    print(_format(df) if len(df) else "no decode steps in this run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
