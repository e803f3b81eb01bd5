"""Serving benchmark (DESIGN.md "Serving"): requests arriving at a given rate to `fastllm serve`.

Each request is a streamed /v1/completions call with a random token-id prompt of input_len tokens and
output_len new tokens (EOS ignored). Arrivals are a Poisson process at request_rate per second (inf: all at
once). Per request: TTFT (arrival to the first streamed token), TPOT ((last token - first token) /
(tokens - 1)), the gaps between streamed chunks (ITL) and the end-to-end latency. The run's row: request
and output-token throughput over the wall time of the run, and mean / p50 / p99 of each latency.

The server runs in its own process (started here from the same engine arguments unless a --url is
given), so the client's host work does not share a GIL with the engine's.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from fastllm.bench.runner import percentile


@dataclass
class RequestRecord:
    arrival: float = 0.0
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def _one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
                       record: RequestRecord) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    record.arrival = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    record.first_token = record.first_token or now
                    record.chunk_times.append(now)
        record.end = time.perf_counter()
    except httpx.HTTPError as e:
        record.error = repr(e)


async def run_load(url: str, model: str, prompts: list[list[int]], output_len: int, request_rate: float,
                   seed: int = 0, max_concurrency: int | None = None) -> tuple[list[RequestRecord], float]:
    """Send the prompts at Poisson arrivals; returns each request's record and the run's wall seconds."""
    rng = random.Random(seed)
    records = [RequestRecord() for _ in prompts]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        async def send(prompt, record):
            if limit is None:
                return await _one_request(client, url, model, prompt, output_len, record)
            async with limit:
                return await _one_request(client, url, model, prompt, output_len, record)

        start = time.perf_counter()
        tasks = []
        for prompt, record in zip(prompts, records):
            tasks.append(asyncio.create_task(send(prompt, record)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return records, wall


def summarize(records: list[RequestRecord], wall: float, request_rate: float, input_len: int,
              output_len: int) -> dict:
    done = [r for r in records if r.error is None and r.end is not None and r.first_token is not None]
    ms = lambda xs, q: percentile(xs, q) * 1e3 if xs else None  # noqa: E731
    mean = lambda xs: float(np.mean(xs)) * 1e3 if xs else None  # noqa: E731
    ttft = [r.first_token - r.arrival for r in done]
    tpot = [(r.end - r.first_token) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.end - r.arrival for r in done]
    out_tokens = sum(r.output_tokens for r in done)
    errors = [r.error for r in records if r.error is not None]
    return {
        "request_rate": request_rate if math.isfinite(request_rate) else "inf", "num_prompts": len(records), "completed": len(done), "failed": len(errors),
        "first_error": errors[0] if errors else None, "input_len": input_len, "output_len": output_len,
        "wall_s": wall, "req_s": len(done) / wall, "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + input_len * len(done)) / wall,
        "ttft_ms_mean": mean(ttft), "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
        "tpot_ms_mean": mean(tpot), "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p99": ms(tpot, 99),
        "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
        "e2e_ms_mean": mean(e2e), "e2e_ms_p99": ms(e2e, 99),
    }


class ServerProcess:
    """`fastllm serve` in a child process, ready once /health answers."""

    def __init__(self, serve_args: list[str], port: int, startup_timeout: float = 900.0):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "fastllm", "serve", "--port", str(port), *serve_args])
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
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
