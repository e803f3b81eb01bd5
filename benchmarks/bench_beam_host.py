"""The host time of a beam-search step against a decode step, on the CPU: what a GPU cannot hide.

    python benchmarks/bench_beam_host.py [--graph-path] [--synchronous]

A beam step runs to its end before the next is scheduled (the search picks the next inputs), so all of
its host work lies between two forwards; a plain decode overlaps it with the GPU (async scheduling).
This runs both on the embedded tiny model with the forward replaced by a lookup of fixed hidden states
(the logits and the sampler still run), and reports:

- host ms per generated position, for a batch-W greedy decode and a width-W beam search (the difference
  of a --long and a --short run over the difference of their lengths, the median of --repeats);
- the beam step's exposed host time: from a step's tokens being ready (its output's result() entered) to
  the next forward's call, where that forward waited for them; a step launched before the last one's
  result() was entered (run-ahead beam steps, core/beam_run_ahead.py) exposes none, as long as the device's
  step outlasts the host's (the host ms per position above). The steps that waited are split into the
  output's readback, the search's update (advance, forks, frees), scheduling, the runner's state update and
  the step's inputs (block copies, staging).

--synchronous runs the beams' synchronous steps (beam_run_ahead=False), the before.
--graph-path stages the inputs as a CUDA graph's decode step does (the graph runner's no-replay mode),
which is the path a GPU takes. The numbers are this machine's; a GPU host's differ by a factor, and
its CUDA calls add to them (see README's host times).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from fastllm import BeamSearchParams, SamplingParams
from fastllm.compile.cuda_graphs import CUDAGraphRunner
from fastllm.core.scheduler import Scheduler
from fastllm.engine.llm_engine import LLMEngine
from fastllm.worker import async_output, beam_slots, model_runner

# (phase, method) pairs timed on the critical path, in the order they run
PHASES = [("readback", async_output.AsyncRunnerOutput, "result"), ("readback", beam_slots.BeamSlotOutput, "result"),
          ("search update", Scheduler, "update_from_output"),
          ("schedule", Scheduler, "schedule"),
          ("runner states", model_runner.ModelRunner, "_update_states")]


class Trace:
    """Timestamps of the phases' entries and exits and of the forward calls, while on."""

    def __init__(self):
        self.on = False
        self.events: list[tuple[str, float]] = []
        self.num_forwards = 0
        self.readback_of: dict[int, int] = {}  # event index of a readback's entry -> its step's forward number

    def mark(self, name: str) -> None:
        if self.on:
            self.events.append((name, time.perf_counter()))

    def forward(self) -> None:
        self.num_forwards += 1
        self.mark("forward")

    def number_outputs(self, owner) -> None:
        """Tag each step's output with the number of its forward (None: the step ran none)."""
        fn = owner.execute_model

        def execute_model(runner, sched):
            before = self.num_forwards
            out = fn(runner, sched)
            out.bench_forward = self.num_forwards if self.num_forwards > before else None
            return out

        owner.execute_model = execute_model

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def traced(*args, **kwargs):
            forward = getattr(args[0], "bench_forward", None) if name == "readback" else None
            if forward is not None and self.on:
                self.readback_of[len(self.events)] = forward
            self.mark(name + ">")
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(name + "<")

        setattr(owner, attr, traced)

    def critical_path(self) -> tuple[float, dict[str, float], int, int]:
        """Mean exposed ms per step (a forward that came after the last step's readback entered: the time
        between them; one launched before it: none), the phases of the steps that waited (mean ms per step; the
        time outside the traced phases is 'inputs and launch' when it falls after the runner's states), the
        steps, and how many were launched ahead."""
        forward_at = {}
        for i, (name, _) in enumerate(self.events):
            if name == "forward":
                forward_at[len(forward_at) + 1] = i
        exposed, phases, ahead = [], defaultdict(float), 0
        for start, k in sorted(self.readback_of.items()):
            f1 = forward_at.get(k - self.first_forward + 2)
            if f1 is None:
                continue
            if start > f1:  # the next step was launched before this one's tokens were asked for
                ahead += 1
                exposed.append(0.0)
                continue
            exposed.append(self.events[f1][1] - self.events[start][1])
            opened = {}
            for name, t in self.events[start:f1 + 1]:
                if name.endswith(">"):
                    opened[name[:-1]] = t
                elif name.endswith("<"):
                    phases[name[:-1]] += t - opened.pop(name[:-1], t)
            last_exit = max(t for name, t in self.events[start:f1] if name.endswith("<"))
            phases["inputs and launch"] += self.events[f1][1] - last_exit
        n = max(len(exposed), 1)
        return sum(exposed) / n * 1e3, {k: v / n * 1e3 for k, v in phases.items()}, len(exposed), ahead

    def start(self) -> None:
        self.events.clear()
        self.readback_of.clear()
        self.first_forward = self.num_forwards + 1  # the number of the first forward traced
        self.on = True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--short", type=int, default=32)
    p.add_argument("--long", type=int, default=160)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--graph-path", action="store_true",
                   help="stage the inputs as a CUDA graph's decode step does")
    p.add_argument("--synchronous", action="store_true", help="no run-ahead beam steps (the synchronous path)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engine = LLMEngine.from_kwargs(None, dtype="float32", device="cpu", cpu_kv_cache_gib=0.03,
                                   beam_run_ahead=not args.synchronous)
    runner, trace = engine.worker.runner, Trace()
    hidden = torch.randn(4096, runner.args.hidden_size, generator=torch.Generator().manual_seed(0))

    def forward(input_ids, positions):  # fixed hidden states at once: the logits still differ by row and step
        trace.forward()
        return hidden[(input_ids * 7 + positions) % hidden.shape[0]]

    runner.forward = forward
    if args.graph_path:
        config = engine.config
        max_len = config.model.max_model_len
        graphs = CUDAGraphRunner(forward, runner.model.compute_logits, runner.attention_layers, [1, 2, 4, 8],
                                 -(-max_len // config.cache.block_size), max_len, runner.args.vocab_size,
                                 runner.dtype, runner.device)
        graphs.graphs, graphs.replay = dict.fromkeys(graphs.sizes), False
        runner.graphs = graphs
    for name, owner, attr in PHASES:
        trace.wrap(owner, attr, name)
    trace.number_outputs(model_runner.ModelRunner)
    prompt = np.random.default_rng(0).integers(0, engine.vocab_size, args.input_len).tolist()

    def run(num_tokens: int, beam: bool) -> float:
        tag = f"{'beam' if beam else 'decode'}-{num_tokens}-{time.perf_counter_ns()}"
        if beam:
            engine.add_beam_search(tag, {"prompt_token_ids": prompt},
                                   BeamSearchParams(args.width, num_tokens, ignore_eos=True))
        else:
            params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
            for i in range(args.width):
                engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    def per_position_ms(beam: bool) -> float:
        span = args.long - args.short
        return statistics.median((run(args.long, beam) - run(args.short, beam)) / span * 1e3
                                 for _ in range(args.repeats))

    for beam in (False, True):  # warm up
        run(8, beam)
    decode, beams = per_position_ms(False), per_position_ms(True)
    paths = []
    for _ in range(args.repeats):
        trace.start()
        run(args.long, True)
        trace.on = False
        paths.append(trace.critical_path())
    total, phases, steps, ahead = min(paths, key=lambda path: path[0])  # the least disturbed run
    engine.check_kv_pool_whole()
    staging = ("CUDA-graph staging" if args.graph_path else "eager staging") + \
        (", synchronous beam steps" if args.synchronous else "")
    print(f"host ms per position (the forward a lookup), width {args.width}, prompt {args.input_len}, "
          f"{staging}: decode {decode:.3f}, beam {beams:.3f}")
    print(f"beam step exposed host time (tokens ready -> next forward, where it waited): {total:.3f} ms a step, "
          f"over {steps} steps, {ahead} launched ahead ({100 * ahead / max(steps, 1):.0f}%)")
    for name, ms in phases.items():
        print(f"  {name:18s} {ms:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
