"""Serving benchmark (DESIGN.md "Serving"): requests arriving at a given rate to `fastllm serve`.

Each request is a streamed /v1/completions call with a random token-id prompt of input_len tokens and
output_len new tokens (EOS ignored; `return_token_ids` so a chunk says how many tokens it carries).
Arrivals are a Poisson process at request_rate per second (inf: all at once). Per request: TTFT (arrival
to the first streamed token), TPOT ((last token - first token) / (tokens - 1)), the gaps between streamed
chunks (ITL) and the end-to-end latency. The run's row: request and output-token throughput over the
wall time of the run, the delivered request rate between the first and the last completion (the rate the
server keeps up with, without the first request's latency and the last one's drain), and mean / p50 /
p99 of each latency; from the server's /metrics, the engine's mean batch and step time in the window.

The load comes from several client processes (each its own event loop, on a lean HTTP/1.1 client of
raw asyncio streams), so at ~20,000 streamed chunks a second the client is not what is measured.
Arrival times are fixed in advance and shared through CLOCK_MONOTONIC, which all processes read alike.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec


@dataclass
class RequestRecord:
    arrival: float = 0.0
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each chunk carried
    output_tokens: int = 0
    error: str | None = None


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def stream_request(host: str, port: int, body: bytes, headers: bytes, record: RequestRecord) -> None:
    """POST one streamed completion over a fresh connection and read its SSE events as they come."""
    record.arrival = time.monotonic()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n%s\r\n")
        writer.write(head % (host.encode(), len(body), headers) + body)
        status = await reader.readline()
        response_headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b" 200 " not in status:
            record.error = f"{status.decode().strip()}: {(await reader.read(400)).decode(errors='replace')}"
            return
        chunked = b"transfer-encoding: chunked" in response_headers
        pending = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
            now = time.monotonic()
            events = (pending + data).split(b"\n\n")
            pending = events.pop()
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = _decode_chunk(event[6:])
                if chunk.error is not None:
                    record.error = str(chunk.error.get("message", chunk.error))
                    return
                if chunk.usage is not None:
                    record.output_tokens = chunk.usage.completion_tokens
                if chunk.choices:
                    ids = chunk.choices[0].token_ids
                    tokens = 1 if ids is None else len(ids)
                    if tokens:
                        record.first_token = record.first_token or now
                        record.chunk_times.append(now)
                        record.chunk_tokens.append(tokens)
        record.end = time.monotonic()
    except (OSError, asyncio.IncompleteReadError, ValueError, msgspec.DecodeError) as e:
        record.error = repr(e)
    finally:
        if writer is not None:
            writer.close()


def request_body(model: str, prompt: list[int], output_len: int) -> bytes:
    return msgspec.json.encode({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                                "return_token_ids": True})


async def _send_all(url: str, bodies: list[bytes], offsets: list[float], start: float, api_key: str | None,
                    max_concurrency: int | None) -> list[RequestRecord]:
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    headers = b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord() for _ in bodies]

    async def send(body: bytes, offset: float, record: RequestRecord):
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            return await stream_request(host, port, body, headers, record)
        async with limit:
            return await stream_request(host, port, body, headers, record)

    await asyncio.gather(*(send(b, o, r) for b, o, r in zip(bodies, offsets, records)))
    return records


def _client_process(url: str, bodies: list[bytes], offsets: list[float], api_key: str | None,
                    max_concurrency: int | None, conn) -> None:
    """One client process: wait for the start time, send its share, return the records."""
    conn.send("ready")
    start = conn.recv()
    records = asyncio.run(_send_all(url, bodies, offsets, start, api_key, max_concurrency))
    conn.send([(r.arrival, r.first_token, r.end, r.chunk_times, r.chunk_tokens, r.output_tokens, r.error)
               for r in records])
    conn.close()


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Poisson arrivals: seconds after the start (all 0 at rate inf). The exponential gaps are scaled so
    that the offered rate is the one asked for: 1,000 unscaled draws at 32/s offer anywhere from about
    30.7 to 32.6/s depending on the seed, and a delivered rate can only be read against what was offered."""
    if not math.isfinite(request_rate) or num < 2:
        return [0.0] * num
    rng = random.Random(seed)
    gaps = [rng.expovariate(request_rate) for _ in range(num - 1)]
    scale = (num - 1) / request_rate / sum(gaps)
    return [0.0] + list(itertools.accumulate(gap * scale for gap in gaps))


def run_load(url: str, model: str, prompts: list[list[int]], output_len: int, request_rate: float,
             seed: int = 0, max_concurrency: int | None = None, num_clients: int = 1,
             api_key: str | None = None) -> tuple[list[RequestRecord], float]:
    """Send the prompts at Poisson arrivals from num_clients processes (1: this one); returns each
    request's record and the run's wall seconds (start to the last request's end)."""
    bodies = [request_body(model, p, output_len) for p in prompts]
    offsets = arrival_offsets(len(prompts), request_rate, seed)
    num_clients = max(1, min(num_clients, len(prompts)))
    if num_clients == 1:
        start = time.monotonic() + 0.05
        records = asyncio.run(_send_all(url, bodies, offsets, start, api_key, max_concurrency))
    else:
        context = multiprocessing.get_context("spawn")
        share = None if max_concurrency is None else max(1, max_concurrency // num_clients)
        procs, conns = [], []
        for k in range(num_clients):  # request i goes to client i % num_clients
            parent, child = context.Pipe()
            procs.append(context.Process(target=_client_process, daemon=True, args=(
                url, bodies[k::num_clients], offsets[k::num_clients], api_key, share, child)))
            procs[-1].start()
            conns.append(parent)
        for conn in conns:
            assert conn.recv() == "ready"
        start = time.monotonic() + 0.2
        for conn in conns:
            conn.send(start)
        records = [None] * len(prompts)
        for k, conn in enumerate(conns):
            for j, fields in enumerate(conn.recv()):
                records[k + j * num_clients] = RequestRecord(*fields)
        for proc in procs:
            proc.join()
    ends = [r.end for r in records if r.end is not None]
    return records, (max(ends) if ends else time.monotonic()) - start


def summarize(records: list[RequestRecord], wall: float, request_rate: float, input_len: int,
              output_len: int) -> dict:
    import numpy as np

    done = [r for r in records if r.error is None and r.end is not None and r.first_token is not None]
    ms = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else None  # noqa: E731
    mean = lambda xs: float(np.mean(xs)) * 1e3 if xs else None  # noqa: E731
    ttft = [r.first_token - r.arrival for r in done]
    tpot = [(r.end - r.first_token) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.end - r.arrival for r in done]
    out_tokens = sum(r.output_tokens for r in done)
    chunks = sum(len(r.chunk_tokens) for r in done)
    merged = sum(1 for r in done for k in r.chunk_tokens[1:] if k > 1)  # the first may carry the prefill's
    errors = [r.error for r in records if r.error is not None]
    ends = sorted(r.end for r in done)
    arrivals = sorted(r.arrival for r in records)
    return {
        "request_rate": request_rate if math.isfinite(request_rate) else "inf", "num_prompts": len(records),
        "completed": len(done), "failed": len(records) - len(done),
        "first_error": errors[0] if errors else None, "input_len": input_len, "output_len": output_len,
        "wall_s": wall, "req_s": len(done) / wall, "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + input_len * len(done)) / wall,
        # the rate requests were sent at, and the rate they completed at, first to last completion
        "offered_req_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1
        and arrivals[-1] > arrivals[0] else None,
        # (at rate inf requests end in waves, all at once: no rate to speak of)
        "delivered_req_s": (len(ends) - 1) / (ends[-1] - ends[0])
        if math.isfinite(request_rate) and len(ends) > 1 and ends[-1] > ends[0] else None,
        "ttft_ms_mean": mean(ttft), "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
        "tpot_ms_mean": mean(tpot), "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p99": ms(tpot, 99),
        "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
        "itl_p99_over_tpot": (ms(itl, 99) / mean(tpot)) if itl and tpot else None,
        "e2e_ms_mean": mean(e2e), "e2e_ms_p99": ms(e2e, 99),
        "merged_chunk_frac": merged / chunks if chunks else None,  # several tokens a chunk: the server lagged
    }


_METRIC = re.compile(r"^(fastllm_engine_\w+_total) ([0-9.eE+-]+)$", re.M)


def engine_counters(url: str) -> dict[str, float]:
    """The engine's step totals from the server's /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: float(value) for name, value in _METRIC.findall(text)}


def engine_columns(before: dict[str, float], after: dict[str, float]) -> dict:
    """Mean batch and step time of the engine steps between two scrapes (runner.step_columns)."""
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    from fastllm.bench.runner import step_columns

    columns = step_columns(delta("fastllm_engine_steps_total"), delta("fastllm_engine_scheduled_requests_total"),
                           delta("fastllm_engine_step_seconds_total"),
                           delta("fastllm_engine_step_wait_seconds_total"),
                           delta("fastllm_engine_step_cpu_seconds_total"))
    # compiles inside the timed window (the server's log names them) and the steps over a second
    return {**columns, "jit_compiles": int(delta("fastllm_engine_compiles_total")),
            "slow_steps": int(delta("fastllm_engine_slow_steps_total"))}


class ServerProcess:
    """`fastllm serve` in a child process, ready once /health answers; with api_key, the key it wants (given
    by the environment, so that it stays out of the command line and the results)."""

    def __init__(self, serve_args: list[str], port: int, api_key: str | None = None,
                 startup_timeout: float = 900.0):
        import httpx

        from fastllm.entrypoints.openai.limits import API_KEY_ENV

        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        env |= {API_KEY_ENV: api_key} if api_key else {}
        self.proc = subprocess.Popen([sys.executable, "-m", "fastllm", "serve", "--port", str(port),
                                      *serve_args], env=env)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fastllm serve exited with code {self.proc.returncode} during startup")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"fastllm serve did not answer /health within {startup_timeout:.0f} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def warm_up(url: str, model: str, prompts: list[list[int]], num_clients: int, api_key: str | None) -> None:
    """Requests of the workload's prompt length, all at once, before anything is timed: the engine's
    first prefill and mixed steps at these sizes (Triton autotuning, cuBLAS heuristics) and the
    server's first requests happen here."""
    records, _ = run_load(url, model, prompts, 8, float("inf"), num_clients=num_clients, api_key=api_key)
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise RuntimeError(f"warm-up: {len(failed)} of {len(records)} requests failed, the first: "
                           f"{failed[0]}")


def serving_row(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float, seed: int,
                max_concurrency: int | None, num_clients: int, api_key: str | None) -> dict:
    """One rate: the load, its latencies, and the engine's steps meanwhile (from /metrics)."""
    before = engine_counters(url)
    records, wall = run_load(url, model, prompts, output_len, rate, seed=seed,
                             max_concurrency=max_concurrency, num_clients=num_clients, api_key=api_key)
    row = summarize(records, wall, rate, len(prompts[0]), output_len)
    return {**row, **engine_columns(before, engine_counters(url))}


def offline_reference(config, prompts: list[list[int]], output_len: int, batch_sizes: list[int],
                      progress: bool) -> dict:
    """The offline engine on the same workload (`fastllm bench throughput`'s run: all requests at once)
    and its decode step time at each batch size (`fastllm bench latency`'s), in this process."""
    from fastllm.bench.latency import run_latency
    from fastllm.bench.roofline import ModelShape
    from fastllm.bench.throughput import run_throughput
    from fastllm.engine.llm_engine import LLMEngine
    from fastllm.entrypoints.process_setup import prepare_gc_for_serving

    engine = LLMEngine(config)
    prepare_gc_for_serving()  # as the server's processes and `fastllm bench` do
    try:
        row = run_throughput(engine, prompts, output_len, progress=progress,
                             warmup_len=min(len(prompts[0]), 512))
        dtype = str(engine.worker.runner.dtype).replace("torch.", "")
        shape = ModelShape.from_hf_config(config.model.hf_config, dtype)
        step_ms = {}
        for b in sorted(set(batch_sizes)):
            rows = run_latency(engine, [b], len(prompts[0]), min(output_len, 64), None, shape, progress=False)
            step_ms[b] = rows[0]["tpot_ms_mean"]
    finally:
        engine.shutdown()  # the workers of tensor/pipeline parallelism
    steps = {key.replace("engine_", "run_"): value for key, value in row.items() if key.startswith("engine_")}
    return {"output_tok_s": row["output_tok_s"], "requests_s": row["requests_s"], "step_ms_at_batch": step_ms,
            **steps}


def compare_with_offline(row: dict, offline: dict) -> dict:
    """The serving row's numbers against the offline engine's on the same workload."""
    batch = round(row["engine_mean_batch"]) if row.get("engine_mean_batch") else None
    step = offline["step_ms_at_batch"].get(batch)
    return {**row, "offline_output_tok_s": offline["output_tok_s"],
            "vs_offline": row["output_tok_s"] / offline["output_tok_s"] if offline["output_tok_s"] else None,
            "offline_step_ms": step,
            "tpot_vs_offline_step": row["tpot_ms_mean"] / step if step and row.get("tpot_ms_mean") else None}
