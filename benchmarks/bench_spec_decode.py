"""Speculative decoding (DESIGN.md "Speculative decoding"): batch 1 and small batches of real prompts,
greedy, the same engine with and without the draft model. Reports output tokens/s of each, the
speedup, the draft tokens' acceptance rate and the mean tokens a verification gives a request.

    python benchmarks/bench_spec_decode.py                       # stories260K, llama2xs-279K drafting
    python benchmarks/bench_spec_decode.py --batch-sizes 1,4 --num-speculative-tokens 3 --output-json spec.json

Random prompts or random weights would make acceptance meaningless, so the prompts are story
openings and the models real; --model / --speculative-model take any pair sharing a vocabulary.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import pandas as pd

from fastllm.bench import ceilings, report
from fastllm.bench.runner import run_requests
from fastllm.engine.llm_engine import LLMEngine
from fastllm.entrypoints.bench import parse_batch_sizes

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park.",
    "One day, a big bird flew over the town.",
    "The sun was shining and the sky was blue.",
    "Sam had a red ball that he loved very much.",
    "In the forest lived a kind old bear.",
    "Mia wanted to bake a cake for her mom.",
    "The little boat sailed on the big sea.",
]


def measure(engine: LLMEngine, batch_size: int, output_len: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]
    run_requests(engine, prompts[:1], 4, f"warmup{batch_size}", progress=False)
    run = run_requests(engine, prompts, output_len, f"bs{batch_size}", progress=False)
    return {"output_tok_s": batch_size * output_len / run.total_s, "steps": len(run.steps), **run.spec_columns()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: the embedded stories260K)")
    p.add_argument("--speculative-model", default="llama2xs-279K")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output-json", default=None)
    p.add_argument("--output-csv", default=None)
    args = p.parse_args(argv)
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    common = {"dtype": args.dtype, "device": args.device, "enforce_eager": args.enforce_eager}
    results = {}
    for name, extra in (("baseline", {}), ("spec", dict(speculative_model=args.speculative_model,
                                                        num_speculative_tokens=args.num_speculative_tokens))):
        engine = LLMEngine.from_kwargs(args.model, **common, **extra)
        results[name] = {b: measure(engine, b, args.output_len) for b in batch_sizes}
        device = engine.worker.device
        del engine
        gc.collect()
    rows = []
    for b in batch_sizes:
        base, spec = results["baseline"][b], results["spec"][b]
        rows.append({"batch_size": b, "output_len": args.output_len, "k": args.num_speculative_tokens,
                     "baseline_tok_s": base["output_tok_s"], "spec_tok_s": spec["output_tok_s"],
                     "speedup": spec["output_tok_s"] / base["output_tok_s"],
                     "baseline_steps": base["steps"], "spec_steps": spec["steps"],
                     "acceptance_rate": spec["spec_acceptance_rate"],
                     "mean_accepted_len": spec["spec_mean_accepted_len"]})
    frame = pd.DataFrame(rows)
    meta = {**ceilings.environment(device), "model": args.model or "stories260K",
            "speculative_model": args.speculative_model, "dtype": args.dtype, "enforce_eager": args.enforce_eager}
    print(f"speculative decoding: {meta['model']} drafted by {args.speculative_model} on {meta['device']} "
          f"(commit {meta.get('commit')})")
    print(report.format_frame(frame))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "spec_decode", "meta": meta, "rows": rows}, f, indent=2, default=str)
    if args.output_csv:
        frame.assign(**{k: meta[k] for k in ("device", "torch", "commit") if k in meta}).to_csv(args.output_csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
