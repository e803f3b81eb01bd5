"""Sliding-window decode: the decode step at a long context against a short one, in one engine, and the KV
blocks a request holds (DESIGN.md benchmark workloads; issue 24's target: Mistral-7B-v0.1 at 16k context
within 10% of its step at 4k, blocks per request bounded by the 4,096-token window).

    python benchmarks/bench_sliding_window.py --model mistral-7b-v0.1 --load-format dummy --dtype bfloat16 \
        --contexts 4096,16384 --batch-sizes 1,8 --output-len 64 --output-json window.json

For each batch size and context: requests of `context` random prompt tokens decode output_len tokens (EOS
ignored); the mean decode step (steps where all the batch decodes, after a warm-up of the same shape) and
the most blocks any decoding request held. The last lines compare each context's step with the first
context's at the same batch size, and the blocks with the window's bound (cdiv(window - 1, block_size) + 1).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def held_blocks_recorder(engine):
    """Wrap the scheduler so that each decode step records the blocks its requests hold; returns the list
    of per-step maxima (the wrapper stays for the engine's life)."""
    scheduler, record = engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        held = [scheduler.kv.num_held_blocks(r) for r, n in out.num_scheduled_tokens.items() if n == 1]
        if held:
            record.append(max(held))
        return out

    scheduler.schedule = recording
    return record


def main(argv: list[str] | None = None) -> int:
    from fastllm.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,16384", help="prompt lengths, comma-separated; the first is "
                        "the baseline")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    from fastllm.bench.runner import random_prompts, run_requests
    from fastllm.engine.llm_engine import LLMEngine
    from fastllm.entrypoints.process_setup import prepare_gc_for_serving

    kwargs = engine_kwargs(args)
    if kwargs.get("max_num_seqs") is None:
        kwargs["max_num_seqs"] = max(batch_sizes)
    engine = LLMEngine.from_kwargs(args.model, **kwargs)
    prepare_gc_for_serving()  # the garbage collector as `fastllm bench` and the server set it
    window = engine.config.model.kv_sliding_window
    block_size = engine.config.cache.block_size
    bound = -(-(window - 1) // block_size) + 1 if window else None
    print(f"model {engine.config.model.model}: window {window}, max_model_len {engine.config.model.max_model_len}, "
          f"{engine.worker.num_gpu_blocks} KV blocks of {block_size}; blocks a decoding request may hold: {bound}",
          flush=True)
    held = held_blocks_recorder(engine)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batch_sizes:
        for context in contexts:
            warm = random_prompts(rng, batch, context, engine.vocab_size)
            run_requests(engine, warm, 8, "warmup", progress=False)  # this shape's compiles and first uses
            held.clear()
            prompts = random_prompts(rng, batch, context, engine.vocab_size)
            run = run_requests(engine, prompts, args.output_len, f"b{batch}c{context}", progress=False)
            # decode steps: every request of the batch decoding (a long prompt's earlier chunks give no first
            # token either, but are prefill work)
            steps = [s.seconds for s in run.steps if s.num_outputs == batch and not s.num_first_tokens]
            row = {"batch_size": batch, "context": context, "decode_step_ms": 1e3 * float(np.mean(steps)),
                   "decode_step_ms_p50": 1e3 * float(np.median(steps)), "decode_steps": len(steps),
                   "max_blocks_held": max(held) if held else None, "block_bound": bound,
                   "jit_compiles": len(run.jit_compiles)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    ok = True
    for row in rows:
        base = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["context"] == contexts[0])
        ratio = row["decode_step_ms"] / base["decode_step_ms"]
        within = bound is None or (row["max_blocks_held"] or 0) <= bound
        ok &= within
        print(f"batch {row['batch_size']:>3} context {row['context']:>6}: decode step {row['decode_step_ms']:.2f} ms "
              f"({ratio:.3f}x of context {contexts[0]}), most blocks held {row['max_blocks_held']} "
              f"(bound {bound}{'' if within else ', EXCEEDED'})")
    engine.check_kv_pool_whole()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"window": window, "block_size": block_size, "rows": rows}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
