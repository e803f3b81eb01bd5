"""Speculative decoding against plain decode, in one run (DESIGN.md "Speculative decoding").

For each batch size: the plain engine's decode tokens/s, then each speculative configuration's
(a draft model and/or n-gram prompt lookup, each k), the speedup, the acceptance rate, the mean
tokens a verify step gives a request, the share of steps that speculated, and a speculative step's
time split into verify (the target's forward and the acceptance), draft (the draft model's rounds)
and host (everything else: scheduling, staging, the copy back, detokenizing), from CUDA events
around the graphs' parts.

    # the real tiny pair (stories260K drafted by llama2xs-279K), story prompts:
    python benchmarks/bench_spec_decode.py
    # 8B-class pairs have random weights, so acceptance is set: --synthetic-acceptance 0.8,0
    python benchmarks/bench_spec_decode.py --model qwen3-8b --draft qwen3-0.6b --ngram --load-format dummy \\
        --dtype bfloat16 --synthetic-acceptance 0.8,0 --batch-sizes 1,8,32 --k 4 --output-json spec.json

--synthetic-acceptance A makes the verifier accept each draft token with probability A whatever its
value (a rejected position takes the target's own token): every cost stays real, only acceptance is
set. Random-weight text never repeats, so with it an n-gram lookup that finds nothing proposes the
request's last k tokens (its hit rate taken as 1). It exists only here (LLM(...), the CLI and the server
refuse it); rows that use it say so.

--profile DIR adds, after each engine's timed runs, a torch-profiler trace of a few of its decode steps at
each batch size (speculative engines: at the last acceptance given) and its kernels by launch grid
(fastllm bench --profile's tables): where a speculative step's draft and verify time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys

import numpy as np
import pandas as pd
import torch

from fastllm.bench import ceilings, report
from fastllm.bench.profile import print_profile, profile_decode
from fastllm.bench.runner import run_requests, spec_columns
from fastllm.config import EngineConfig, SpeculativeConfig
from fastllm.engine.llm_engine import LLMEngine
from fastllm.entrypoints.bench import parse_batch_sizes
from fastllm.entrypoints.process_setup import prepare_gc_for_serving

STORY_PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park.",
    "One day, a big bird flew over the town.",
    "The sun was shining and the sky was blue.",
    "Sam had a red ball that he loved very much.",
    "In the forest lived a kind old bear.",
    "Mia wanted to bake a cake for her mom.",
    "The little boat sailed on the big sea.",
]


def build_engine(args, spec: SpeculativeConfig | None) -> LLMEngine:
    config = EngineConfig.from_kwargs(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                                      enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
                                      **({} if args.seed is None else {"seed": args.seed}))
    if spec is not None:
        config = dataclasses.replace(config, speculative=spec)
    return LLMEngine(config)


def with_engine(args, spec: SpeculativeConfig | None, measure_all):
    """measure_all(engine)'s result, the engine's memory freed before the next one is built (it froze its
    startup objects out of the garbage collector's reach)."""
    engine = build_engine(args, spec)
    prepare_gc_for_serving()  # the garbage collector as `fastllm bench` and the server set it
    try:
        return measure_all(engine)
    finally:
        del engine
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


PROFILE_INPUT_LEN = 16  # --profile's random prompts when the runs take story prompts (--input-len 0)


def prompts(engine: LLMEngine, batch_size: int, input_len: int, seed: int) -> list:
    if engine.tokenizer is not None and not input_len:
        return [STORY_PROMPTS[i % len(STORY_PROMPTS)] for i in range(batch_size)]
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, engine.vocab_size, input_len).tolist()} for _ in range(batch_size)]


def measure(engine: LLMEngine, batch_size: int, args) -> dict:
    """Decode tokens/s of batches of batch_size requests (the steps after each prefill), after a warm-up
    batch: as many batches, one after another, as make --min-requests requests. One request of 256 tokens
    verifies only ~70 times, and every run draws the same synthetic acceptances (the engine seeds torch's
    generators from its seed; --seed changes it), so a single batch-1 batch reported one fixed draw: 3.75
    tokens a step at alpha 0.8, 3.36 expected."""
    spec = engine.worker.runner.spec
    run_requests(engine, prompts(engine, batch_size, args.input_len, 1), args.output_len, f"warm{batch_size}",
                 progress=False)
    if spec is not None:
        spec.step.clear_timings()
        spec.step.timing = spec.step.replay  # CUDA events only where there are graphs
    spec_before = dataclasses.replace(engine.scheduler.spec_stats)
    runs = [run_requests(engine, prompts(engine, batch_size, args.input_len, 2 + i), args.output_len,
                         f"bs{batch_size}-{i}", progress=False)
            for i in range(-(-args.min_requests // batch_size))]
    decode = [s for run in runs for s in run.decode_steps()]
    # A batch's speculative requests finish at different steps (each accepts its own number of tokens a
    # step), so its last steps run fewer than batch_size requests; plain decode's never do. full_batch_tok_s
    # times only the steps that returned tokens for all batch_size requests: the batch size's steady state.
    full = [s for s in decode if s.num_outputs == batch_size]

    def tok_s(steps):
        return sum(s.num_tokens for s in steps) / sum(s.seconds for s in steps) if steps else None

    row = {"decode_tok_s": tok_s(decode), "full_batch_tok_s": tok_s(full),
           "full_batch_steps": len(full) / len(decode),
           "batches": len(runs), "steps": sum(len(run.steps) for run in runs),
           "jit_in_window": sum(len(run.jit_compiles) for run in runs)}
    if spec is not None:
        spec.step.timing = False
        timed = spec.step_timings  # (verify, draft) ms of each step that ran the batched step's graphs
        step_ms = 1e3 * float(np.mean([s.seconds for s in decode]))
        verify_ms = float(np.mean([t[0] for t in timed])) if timed else None
        draft_ms = float(np.mean([t[1] for t in timed])) if timed else None
        graphed = len(timed) / len(decode)
        stats = engine.scheduler.spec_stats.since(spec_before)
        row.update(**spec_columns(stats), graphed_spec_steps=graphed, step_ms=step_ms, verify_ms=verify_ms,
                   draft_ms=draft_ms, host_ms=step_ms - verify_ms - draft_ms if graphed == 1.0 else None)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: the embedded stories260K)")
    p.add_argument("--draft", default="llama2xs-279K", help="draft model ('none': no draft-model rows)")
    p.add_argument("--draft-quantization", default=None, choices=["fp8", "fp8-per-tensor"],
                   help="the draft's weights in FP8 (speculative_config's quantization); the target's stay as given")
    p.add_argument("--ngram", action="store_true", help="also n-gram prompt lookup rows")
    p.add_argument("--k", default="4", help="num_speculative_tokens values, comma-separated")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--input-len", type=int, default=0, help="random prompts of this length (0: story prompts)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=8,
                   help="time batches one after another until this many requests have run (batch 1: 8 batches)")
    p.add_argument("--synthetic-acceptance", default=None,
                   help="comma-separated acceptance rates to force (benchmark only; random-weight models)")
    p.add_argument("--no-adaptive", action="store_true", help="speculate every step (the policy off)")
    p.add_argument("--seed", type=int, default=None,
                   help="the engines' seed, which the synthetic acceptances are drawn from (and dummy weights): "
                        "the default seed draws the same acceptances in every run")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output-json", default=None)
    p.add_argument("--output-csv", default=None)
    p.add_argument("--profile", metavar="DIR",
                   help="after each engine's runs, a torch-profiler trace of a few decode steps per batch "
                   "size to DIR/<row> and its kernels by launch grid")
    p.add_argument("-v", "--verbose", action="store_true", help="the engine's log (paths taken, policy decisions)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    ks = parse_batch_sizes(args.k)
    alphas = [float(a) for a in args.synthetic_acceptance.split(",")] if args.synthetic_acceptance else [None]
    methods = ([] if args.draft == "none" else [("draft_model", args.draft)]) + ([("ngram", None)] if args.ngram else [])
    if args.draft_quantization and args.draft == "none":
        p.error("--draft-quantization needs a draft model (--draft)")
    if not methods:
        p.error("--draft none without --ngram leaves no speculative rows to measure")

    meta = {"model": args.model or "stories260K", "dtype": args.dtype, "seed": args.seed}

    def profiled(engine, name: str) -> None:
        for b in batch_sizes if args.profile else ():
            print(f"\n== profile: {name}, batch {b}")
            trace_dir = f"{args.profile}/{name}_b{b}"
            print_profile(profile_decode(engine, b, args.input_len or PROFILE_INPUT_LEN, trace_dir))

    def plain(engine):
        meta.update(ceilings.environment(engine.worker.device))
        measured = {b: measure(engine, b, args) for b in batch_sizes}
        profiled(engine, "plain")
        return measured

    baseline = with_engine(args, None, plain)
    rows = []

    def speculative(method, draft, k):
        def run(engine):
            for alpha in alphas:
                if alpha is not None:
                    engine.worker.runner.spec.set_synthetic_acceptance_rate(alpha)
                for b in batch_sizes:
                    got = measure(engine, b, args)
                    label = f"draft {draft}" + (f" ({args.draft_quantization})" if args.draft_quantization else "")
                    rows.append({"method": method if method == "ngram" else label, "k": k, "batch_size": b,
                                 "acceptance": "measured" if alpha is None else f"synthetic {alpha}",
                                 "plain_tok_s": baseline[b]["decode_tok_s"], "spec_tok_s": got.pop("decode_tok_s"),
                                 **got})
                    rows[-1]["speedup"] = rows[-1]["spec_tok_s"] / rows[-1]["plain_tok_s"]
                    drafter = engine.worker.runner.spec.drafter
                    if drafter is not None:  # (n-gram: none)
                        rows[-1]["draft_rounds"] = drafter.rounds_path
                    full, plain_full = got["full_batch_tok_s"], baseline[b]["full_batch_tok_s"]
                    rows[-1]["full_batch_speedup"] = full / plain_full if full and plain_full else None
            profiled(engine, f"{method}_k{k}")
        return run

    for method, draft in methods:
        for k in ks:
            spec = SpeculativeConfig(method=method, model=draft, num_speculative_tokens=k, adaptive=not args.no_adaptive,
                                     synthetic_acceptance_rate=alphas[0],
                                     quantization=args.draft_quantization if method == "draft_model" else None)
            with_engine(args, spec, speculative(method, draft, k))
    frame = pd.DataFrame(rows)
    cols = ["method", "k", "batch_size", "acceptance", "plain_tok_s", "spec_tok_s", "speedup",
            "full_batch_steps", "full_batch_speedup", "spec_acceptance_rate", "spec_mean_accepted_len",
            "graphed_spec_steps", "step_ms", "verify_ms", "draft_ms", "host_ms", "jit_in_window"]
    print(f"speculative decoding: {meta['model']} on {meta['device']} (commit {meta.get('commit')}), "
          f"{args.input_len or 'story'} in / {args.output_len} out, {args.dtype}")
    print(report.format_frame(frame[[c for c in cols if c in frame]]))
    for path in sorted({r["draft_rounds"] for r in rows if "draft_rounds" in r}):
        print(f"the draft's one-token rounds ran through the {path}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "spec_decode", "meta": meta, "baseline": baseline, "rows": rows}, f, indent=2,
                      default=str)
    if args.output_csv:
        frame.to_csv(args.output_csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
