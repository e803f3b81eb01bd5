"""Mixed steps (a prompt's prefill beside decodes) with and without their CUDA graphs (mixed_graphs.py),
in one engine and one run: the serving gap of issue 22, where a step mixing a 128-token prompt with 48
decodes took 24-25 ms against 6.7 ms for a decode step, most of it host time launching the compiled forward.

    python benchmarks/bench_mixed_steps.py   # Llama-3.1-8B, random weights, bf16 (the defaults below)
    python benchmarks/bench_mixed_steps.py --decodes 48 --prompt-len 128 --rounds 60 --output-json mixed.json

`--decodes` requests decode throughout (their prompts prefilled first, not timed). Each round adds one
`--prompt-len`-token prompt (max_tokens 1, so it leaves after its prefill) and takes two steps: the mixed step
(its prefill beside the decodes) and a decode step. The rounds run twice, with the mixed graphs and then with
them set aside (the engine's runner without its MixedGraphRunner: the compiled forward, as
mixed_cuda_graph_max_tokens=0 runs it), each after `--warmup` untimed rounds. Async scheduling is off by
default so that a step's wall time is its own (schedule, launch, GPU, result); `wait` is the part spent
waiting for the GPU, the rest is host time. Prints the median mixed and decode step of each mode and the
mean of a round (one mixed + one decode step, what a server sees when every other step takes a prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def timed_step(engine) -> tuple[float, float, int]:
    """(wall seconds, seconds waiting for the GPU, tokens scheduled) of one engine step."""
    scheduled = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        scheduled.append(out.total_num_scheduled_tokens)
        return out
    engine.scheduler.schedule = recording
    try:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start, engine.last_step_wait_s, sum(scheduled)
    finally:
        del engine.scheduler.schedule


def run_rounds(engine, rng, prompt_len: int, rounds: int, tag: str) -> dict[str, list]:
    from fastllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = {"mixed": [], "decode": []}
    for i in range(rounds):
        prompt = rng.integers(0, engine.vocab_size, prompt_len).tolist()
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
        out["mixed"].append(timed_step(engine))
        out["decode"].append(timed_step(engine))
    return out


def summarize(samples: dict[str, list], mode: str) -> dict:
    row = {"mode": mode}
    for kind in ("mixed", "decode"):
        wall = np.array([s[0] for s in samples[kind]]) * 1e3
        wait = np.array([s[1] for s in samples[kind]]) * 1e3
        row[f"{kind}_step_ms_p50"] = float(np.median(wall))
        row[f"{kind}_wait_ms_p50"] = float(np.median(wait))
        row[f"{kind}_host_ms_p50"] = float(np.median(wall - wait))
        row[f"{kind}_tokens"] = sorted({s[2] for s in samples[kind]})
    pairs = [m[0] + d[0] for m, d in zip(samples["mixed"], samples["decode"])]
    row["round_ms_mean"] = 1e3 * float(np.mean(pairs))
    return row


def main(argv: list[str] | None = None) -> int:
    from fastllm.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, default=48, help="requests decoding throughout")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens of the prompt joining each round")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--output-json", default=None)
    add_engine_args(parser)
    parser.set_defaults(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", max_model_len=4096,
                        max_num_seqs=64, async_scheduling=False, mixed_cuda_graph_max_tokens=512)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # (the engine would refuse mixed_cuda_graph_max_tokens on the CPU)
        parser.error("it times mixed steps' CUDA graphs against the compiled forward: it needs a GPU")

    from fastllm.engine.llm_engine import LLMEngine
    from fastllm.entrypoints.process_setup import prepare_gc_for_serving
    from fastllm.sampling_params import SamplingParams

    engine = LLMEngine.from_kwargs(args.model, **engine_kwargs(args))
    prepare_gc_for_serving()  # the garbage collector as `fastllm bench` and the server set it
    runner = engine.worker.runner
    mixed_graphs = runner.mixed_graphs
    if mixed_graphs is None:
        print("this engine has no mixed-step CUDA graphs (a GPU, compiled, mixed_cuda_graph_max_tokens > 0)")
        return 1
    print(f"model {engine.config.model.model}, {args.decodes} decoding + one {args.prompt_len}-token prompt "
          f"a round; mixed graphs of {mixed_graphs.buckets} tokens; async_scheduling "
          f"{engine.config.scheduler.async_scheduling}", flush=True)
    rng = np.random.default_rng(0)
    steps_needed = 2 * (args.rounds + args.warmup) * 2 + 64
    decode_params = SamplingParams(temperature=0.0, max_tokens=steps_needed, ignore_eos=True)
    decoding = [f"decode-{i}" for i in range(args.decodes)]
    for rid in decoding:
        engine.add_request(rid, {"prompt_token_ids": rng.integers(0, engine.vocab_size, 128).tolist()},
                           decode_params)
    for _ in range(100):  # until a step is the decodes alone (their prompts prefilled)
        if timed_step(engine)[2] == args.decodes:
            break
    else:
        raise RuntimeError(f"the {args.decodes} requests never decoded alone (max_num_seqs? the budget?)")
    replays, replay = [], mixed_graphs.replay_staged
    mixed_graphs.replay_staged = lambda num_tokens: replays.append(num_tokens) or replay(num_tokens)
    rows = []
    for mode, graphs in (("mixed graphs on", mixed_graphs), ("mixed graphs off", None)):
        runner.mixed_graphs = graphs
        run_rounds(engine, rng, args.prompt_len, args.warmup, f"warm-{len(rows)}")
        replays.clear()
        row = summarize(run_rounds(engine, rng, args.prompt_len, args.rounds, f"timed-{len(rows)}"), mode)
        row["mixed_graph_replays"] = replays.count(args.decodes + args.prompt_len)
        rows.append(row)
        print(json.dumps(row), flush=True)
    runner.mixed_graphs = mixed_graphs
    del mixed_graphs.replay_staged
    assert rows[0]["mixed_graph_replays"] == args.rounds, "every timed mixed step should replay a graph"
    engine.abort_request(decoding)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_kv_pool_whole()
    on, off = rows
    print(f"\nmixed step ({on['mixed_tokens']} tokens): {on['mixed_step_ms_p50']:.2f} ms with graphs "
          f"(host {on['mixed_host_ms_p50']:.2f}), {off['mixed_step_ms_p50']:.2f} ms without "
          f"(host {off['mixed_host_ms_p50']:.2f}): {off['mixed_step_ms_p50'] / on['mixed_step_ms_p50']:.2f}x")
    print(f"decode step: {on['decode_step_ms_p50']:.2f} ms / {off['decode_step_ms_p50']:.2f} ms; a round "
          f"(mixed + decode): {on['round_ms_mean']:.2f} ms with graphs, {off['round_ms_mean']:.2f} ms "
          "without; "
          f"mean step / decode step {on['round_ms_mean'] / 2 / on['decode_step_ms_p50']:.2f}x with graphs, "
          f"{off['round_ms_mean'] / 2 / off['decode_step_ms_p50']:.2f}x without")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"decodes": args.decodes, "prompt_len": args.prompt_len, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
