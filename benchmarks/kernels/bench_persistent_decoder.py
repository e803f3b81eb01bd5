"""A draft model's one-token decode round: the persistent decoder kernel against the model's forward.

Both as CUDA graphs over the same inputs and KV cache, each followed by the lm_head and argmax (the whole
round as the speculative step runs it; the forward captured with the engine's attention bound, --bound,
which sets its attention splits): milliseconds a round, the layer weights' bytes over the time, and
the largest difference of the two paths' final hidden states.

    python benchmarks/kernels/bench_persistent_decoder.py --model qwen3-0.6b --contexts 128,256,512 --trace
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastllm.bench.ceilings import device_name, git_commit  # noqa: E402
from fastllm.compile.cuda_graphs import record_graph, time_graph  # noqa: E402
from fastllm.config import ModelConfig, resolve_model_path  # noqa: E402
from fastllm.kernels import dispatch, persistent_decoder  # noqa: E402
from fastllm.models.loader import load_model  # noqa: E402
from fastllm.spec_decode.draft_decoder import DraftDecoder  # noqa: E402
from fastllm.worker.attn_metadata import AttentionMetadata, forward_context  # noqa: E402

BLOCK_SIZE = 16


def graph_ms(fn, repeats: int) -> float:
    """Median over `repeats` of a CUDA graph of fn's mean time over 10 replays, in ms."""
    for _ in range(3):  # warm-up: every Triton compile happens here
        fn()
    graph = record_graph(fn, None, torch.cuda.Stream())
    return sorted(time_graph(graph, 10) for _ in range(repeats))[repeats // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", default="256", help="keys in the cache before the round's token, each")
    parser.add_argument("--bound", type=int, default=2056,
                        help="the attention bound (max_seq_len) the forward's graph is captured with, as the "
                             "engine captures the draft's rounds: max_model_len + 2k, 2056 for #21's "
                             "command; it sets the forward's attention splits (the kernel sizes its own)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--trace", action="store_true",
                        help="also each phase's time (a traced launch, %%globaltimer)")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.bound <= max(contexts):
        parser.error(f"--bound {args.bound} must exceed every context (the round's token is one more key)")
    if not torch.cuda.is_available():
        parser.error("it times CUDA graphs of the persistent kernel and the forward: it needs a GPU")
    device = torch.device("cuda")
    config = ModelConfig(model=resolve_model_path(args.model), load_format="dummy", dtype=args.dtype)
    model = load_model(config, device)
    decoder = DraftDecoder(model)
    a = model.args
    width = -(-(max(contexts) + 1) // BLOCK_SIZE)
    kv = torch.randn(a.num_layers, 2, width + 1, BLOCK_SIZE, a.num_kv_heads, a.head_dim, dtype=model.dtype,
                     device=device)
    layers = model.attention_layers()
    for i, layer in enumerate(layers):
        layer.kv_cache = (kv[i, 0], kv[i, 1])
    decoder.kv_cache = kv
    weight_bytes = sum(t.numel() * t.element_size() for t in decoder.weights[1:] if t is not None)
    print(f"# {args.model} {args.dtype}, {a.num_layers} layers, {weight_bytes / 1e6:.0f} MB of layer "
          f"weights; {device_name(device)}; commit {git_commit()}; "
          f"{persistent_decoder.grid(device)} programs; the forward's attention bound {args.bound}")
    results = []
    table = torch.arange(width, dtype=torch.int32, device=device).view(1, width) + 1
    for context in contexts:
        positions = torch.full((1,), context, dtype=torch.int64, device=device)
        slots = table[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
        metadata = AttentionMetadata(
            slot_mapping=slots, block_tables=table, seq_lens=(positions + 1).to(torch.int32),
            query_start_loc=torch.arange(2, dtype=torch.int32, device=device), max_query_len=1,
            max_seq_len=args.bound)
        ids = torch.randint(3, a.vocab_size, (1,), device=device)
        hidden = {}

        def forward():
            with forward_context(metadata, layers):
                hidden["forward"] = model(ids, positions)
            return dispatch.argmax(model.compute_logits(hidden["forward"]))

        def persistent():
            hidden["persistent"] = decoder(ids, positions, metadata)
            return dispatch.argmax(model.compute_logits(hidden["persistent"]))

        with torch.inference_mode():
            forward_ms = graph_ms(forward, args.repeats)
            persistent_ms = graph_ms(persistent, args.repeats)
            forward()
            persistent()
            diff = (hidden["forward"].float() - hidden["persistent"].float()).abs().max().item()
        row = dict(context=context, forward_ms=round(forward_ms, 4), persistent_ms=round(persistent_ms, 4),
                   speedup=round(forward_ms / persistent_ms, 3), max_abs_diff=diff)
        results.append(row)
        print(json.dumps(row))
        if args.trace:
            shape = (a.num_layers, len(persistent_decoder.PHASES), persistent_decoder.grid(device), 2)
            trace = torch.zeros(shape, dtype=torch.int64, device=device)
            with torch.inference_mode():
                for _ in range(3):
                    persistent_decoder.launch(ids, positions, slots, table, metadata.seq_lens,
                                              decoder.weights, decoder.shape, kv, decoder.cos_sin,
                                              decoder.is_neox, decoder.scale, decoder.scratch, decoder.out,
                                              trace)
            torch.cuda.synchronize()
            print(f"context {context}, us a layer per phase: the mean program's work / the slowest's / "
                  "with the barrier")
            for name, (mean, slowest, whole) in persistent_decoder.phase_times(trace.cpu()).items():
                print(f"  {name:9} {mean:6.2f} {slowest:6.2f} {whole:6.2f}")
    print("| context | forward ms | persistent ms | speedup | max abs diff |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['context']} | {r['forward_ms']:.3f} | {r['persistent_ms']:.3f} | {r['speedup']:.2f}x | "
              f"{r['max_abs_diff']:.3g} |")


if __name__ == "__main__":
    main()
