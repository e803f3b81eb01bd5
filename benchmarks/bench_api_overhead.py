"""The API process's CPU cost per streamed token, on any machine (no GPU, no model).

`fastllm serve`'s app and AsyncLLMEngine run as in production, over a fake engine core in its own process
(the real core loop, core_proc.run_engine_core, driving a FakeCore that gives every running request one
token per step, every --step-ms, up to --max-num-seqs requests a step). The load is `fastllm bench
serving`'s client (streamed /v1/completions with token-id prompts, so no tokenizer, as in the GPU
benchmark). The number: CPU seconds the API process used (all its threads) / tokens streamed.

    python benchmarks/bench_api_overhead.py --num-prompts 1000 --output-len 128 --step-ms 30 --clients 2

At the GPU target (~16,700 tokens/s, one SSE event each) the API process must spend well under 60 us of
CPU a token to keep up on one core.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
from types import SimpleNamespace

from fastllm.bench.serving import run_load, summarize
from fastllm.engine.messages import EngineCoreOutput, SchedulerStats, sample_ids

VOCAB = 32000


class FakeCore:
    """EngineCore's interface, without a model: each step gives every running request one token."""

    def __init__(self, step_s: float, max_num_seqs: int):
        self.step_s, self.max_num_seqs = step_s, max_num_seqs
        self.left: dict[str, int] = {}  # running sample id -> tokens still to give
        self.waiting: list[tuple[str, int]] = []
        self.stats = SchedulerStats()
        self.next_step = time.monotonic()

    def add_request(self, request_id, prompt_token_ids, params):
        self.waiting += [(sample_id, params.max_tokens) for sample_id in sample_ids(request_id, params.n)]

    def finish_requests(self, ids, status=None):
        for i in ids:
            self.left.pop(i, None)
        self.waiting = [w for w in self.waiting if w[0] not in ids]

    def has_unfinished_requests(self):
        return bool(self.left or self.waiting)

    def step(self):
        while self.waiting and len(self.left) < self.max_num_seqs:
            sample_id, max_tokens = self.waiting.pop(0)
            self.left[sample_id] = max_tokens
        delay = self.next_step - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self.next_step = max(self.next_step, time.monotonic() - self.step_s) + self.step_s
        outputs = []
        for sample_id in list(self.left):
            self.left[sample_id] -= 1
            done = self.left[sample_id] == 0
            token = self.left[sample_id] % VOCAB
            outputs.append(EngineCoreOutput(sample_id, [token], "length" if done else None))
            if done:
                del self.left[sample_id]
        self.stats.num_steps += 1
        self.stats.num_scheduled_requests += len(outputs)
        self.stats.num_running = len(self.left)
        return outputs

    def check_kv_pool_whole(self):
        pass


def fake_engine(step_s: float, max_num_seqs: int, max_model_len: int):
    config = SimpleNamespace(model=SimpleNamespace(tokenizer=None, model="fake", max_model_len=max_model_len),
                             scheduler=SimpleNamespace(max_num_seqs=max_num_seqs))
    return SimpleNamespace(config=config, vocab_size=VOCAB, eos_token_id=None, tokenizer=None,
                           worker=SimpleNamespace(num_gpu_blocks=0), core=FakeCore(step_s, max_num_seqs))


def _fake_core_process(input_address, output_address, step_s, max_num_seqs, max_model_len):
    from fastllm.engine.core_proc import run_engine_core

    run_engine_core(lambda: fake_engine(step_s, max_num_seqs, max_model_len), input_address, output_address)


class _FakeCoreProcess:
    """The handle EngineCoreClient expects (alive, reason, stop, sentinel) for the fake core."""

    def __init__(self, input_address, output_address, args):
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=_fake_core_process, daemon=True, args=(
            input_address, output_address, args.step_ms / 1e3, args.max_num_seqs, 4096))
        self.proc.start()
        self.sentinel = self.proc.sentinel

    def alive(self):
        return self.proc.is_alive()

    def reason(self):
        return f"the fake core exited with code {self.proc.exitcode}"

    def stop(self, timeout):
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()


def _server_process(port: int, args, conn) -> None:
    import uvicorn

    from fastllm.engine.async_llm_engine import AsyncLLMEngine
    from fastllm.engine.core_client import EngineCoreClient
    from fastllm.entrypoints.openai.server import build_app

    engine = AsyncLLMEngine(client=EngineCoreClient(lambda i, o: _FakeCoreProcess(i, o, args)))
    app = build_app(engine, "fake", shutdown_engine=True)
    if args.profile:  # cProfile the whole server; written when the benchmark stops it
        import cProfile
        import signal

        profile = cProfile.Profile()

        def dump(*_):
            profile.disable()
            profile.dump_stats(args.profile)
            os._exit(0)
        signal.signal(signal.SIGTERM, dump)
        profile.enable()
    conn.send(os.getpid())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=30.0, help="the fake core's step time")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="cProfile the API process into FILE (pstats)")
    args = p.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_server_process, args=(port, args, child))
    server.start()
    pid = parent.recv()
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    prompts = [[(i * 7 + j) % VOCAB for j in range(args.input_len)] for i in range(args.num_prompts)]
    run_load(url, "fake", prompts[:32], 8, float("inf"), num_clients=1)  # warm-up
    cpu0 = cpu_seconds(pid)
    records, wall = run_load(url, "fake", prompts, args.output_len, args.request_rate,
                             num_clients=args.clients)
    user, system = (b - a for a, b in zip(cpu0, cpu_seconds(pid)))
    cpu = user + system
    row = summarize(records, wall, args.request_rate, args.input_len, args.output_len)
    tokens = sum(r.output_tokens for r in records)
    chunks = sum(len(r.chunk_times) for r in records)
    ceiling = args.max_num_seqs / (args.step_ms / 1e3)
    print(f"{row['completed']}/{row['num_prompts']} done, {tokens} tokens in {wall:.2f} s: "
          f"{row['output_tok_s']:.0f} tok/s (the fake core's ceiling {ceiling:.0f}), "
          f"API process {cpu:.2f} CPU s ({user:.2f} user, {system:.2f} system) = "
          f"{cpu / tokens * 1e6:.1f} us per token, {cpu / chunks * 1e6:.1f} us per "
          f"SSE event ({chunks} events; {100 * (row['merged_chunk_frac'] or 0):.1f}% carried merged tokens), "
          f"tpot {row['tpot_ms_mean']:.1f} ms, "
          f"itl p99 {row['itl_ms_p99']:.1f} ms")
    server.terminate()
    server.join(10)
    return 0 if row["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
