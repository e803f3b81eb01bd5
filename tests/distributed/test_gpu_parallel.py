"""Tensor and pipeline parallelism on GPUs over NCCL (skipped unless 2 GPUs are visible; TP 2 x PP 2
needs 4): the split engine compiled, its decode steps replaying CUDA graphs with the all-reduces
inside, gives one GPU's greedy tokens in float32; in bf16 it scores text as one GPU does; the one-shot
all-reduce sums what NCCL sums, eagerly and inside a CUDA graph; a killed worker is an error naming its
rank."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback

import pytest
import torch

from fastllm import SamplingParams
from fastllm.distributed.one_shot import ENV_MAX_BYTES, unavailable_reason
from tests.conftest import release_cached_engines
from tests.distributed.conftest import shutdown_parallel_llm
from tests.distributed.test_parallel_engines import MAX_TOKENS, compare, greedy
from tests.models.test_llama_vs_hf import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

# A fixed pool (no profiling run) small enough for two engines on one GPU; a step budget of 256 tokens
# keeps each engine's startup (its mixed-step graphs and warm-up steps) to seconds.
GPU = dict(device="cuda", num_gpu_blocks=256, max_model_len=256, max_num_batched_tokens=256,
           cuda_graph_sizes=[1, 2, 4, 8])


def start(model: str, **kwargs):
    from fastllm import LLM

    return LLM(model, **GPU, **kwargs)


def prompts_of(n: int = 6):
    g = torch.Generator().manual_seed(0)
    lengths = (5, 17, 33, 9, 60, 2)[:n]
    return [{"prompt_token_ids": torch.randint(3, 512, (k,), generator=g).tolist()} for k in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    release_cached_engines()
    return make_tiny_model(tmp_path_factory, "llama3.1")


@pytest.mark.parametrize("layout", [
    dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
    pytest.param(dict(tensor_parallel_size=2, pipeline_parallel_size=2),
                 marks=pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")),
], ids=["tp2", "pp2", "tp2pp2"])
def test_split_engine_float32_equals_one_gpu(tiny, layout):
    one = start(tiny, dtype="float32")
    want = one.generate(prompts_of(), greedy(), use_tqdm=False)
    del one
    llm = start(tiny, dtype="float32", **layout)
    try:
        runner = llm.engine.worker.runner
        if "pipeline_parallel_size" not in layout:
            assert runner.graphs is not None, "decode steps should replay CUDA graphs"
        got = llm.generate(prompts_of(), greedy(), use_tqdm=False)
    finally:
        shutdown_parallel_llm(llm)
    assert compare(got, want) >= 0.9 * len(want) * MAX_TOKENS


def scores(llm, prompts: list[dict], text: list[list[int]]) -> list[list[tuple[float, int, float]]]:
    """Teacher-forced: for each token of each prompt's continuation, (its logprob, the model's top token,
    the top-2 margin), with prompt and continuation fed as one prompt."""
    fed = [{"prompt_token_ids": p["prompt_token_ids"] + t} for p, t in zip(prompts, text)]
    outs = llm.generate(fed, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    result = []
    for p, t, out in zip(prompts, text, outs):
        n, row = len(p["prompt_token_ids"]), []
        for i, token in enumerate(t):
            entries = sorted(((lp.logprob, k) for k, lp in out.prompt_logprobs[n + i].items()), reverse=True)
            (top, best), second = entries[0], entries[1][0]
            row.append((out.prompt_logprobs[n + i][token].logprob, best, top - second))
        result.append(row)
    return result


def check_bf16_split_scores_as_one_device(start_one, start_split) -> None:
    """bf16 rounding moves these logits by whole ulps (1/16 at the tiny model's magnitudes), so greedy paths
    of two bf16 runs part at any near-tie and the parting says nothing. The check is teacher-forced
    instead: every run scores float32's greedy continuation. The split bf16 engine must stay as close to
    float32 as one device in bf16 does, and pick float32's token wherever float32's margin is clear of that
    noise."""
    prompts = prompts_of()
    fp32 = start_one(dtype="float32")
    text = [list(o.outputs[0].token_ids) for o in fp32.generate(prompts, greedy(), use_tqdm=False)]
    truth = scores(fp32, prompts, text)
    del fp32
    one = start_one(dtype="bfloat16")
    one_bf16 = scores(one, prompts, text)
    del one
    split = start_split(dtype="bfloat16")
    try:
        split_bf16 = scores(split, prompts, text)
    finally:
        shutdown_parallel_llm(split)
    flat = [x for row in truth for x in row]

    def errors(run):
        return [abs(a[0] - b[0]) for a, b in zip(flat, (x for row in run for x in row))]

    noise, split_err = errors(one_bf16), errors(split_bf16)
    mean = sum(noise) / len(noise)
    assert sum(split_err) / len(split_err) <= 1.5 * mean, (split_err, noise)
    assert max(split_err) <= 2 * max(noise), (split_err, noise)
    clear = [(x, s) for x, s in zip(flat, (x for row in split_bf16 for x in row)) if x[2] > 2 * max(noise)]
    assert len(clear) >= len(flat) // 4, "too few clear margins for the token check to mean anything"
    assert all(s[1] == x[1] for x, s in clear), [(x, s) for x, s in clear if s[1] != x[1]]


def test_tp2_bfloat16_scores_text_as_one_gpu_does(tiny):
    check_bf16_split_scores_as_one_device(lambda **kw: start(tiny, **kw),
                                          lambda **kw: start(tiny, tensor_parallel_size=2, **kw))


def one_shot_vs_nccl(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from fastllm.distributed.one_shot import OneShotAllReduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=device)
    try:
        worst = 0.0
        for dtype in (torch.float32, torch.bfloat16):
            one_shot = OneShotAllReduce(dist.group.WORLD, device, dtype, 1 << 20)
            for rows in (1, 3, 64):
                x = torch.randn(rows, 4096, device=device).to(dtype) * (rank + 1)
                nccl = x.clone()
                dist.all_reduce(nccl)
                worst = max(worst, (one_shot.all_reduce(x) - nccl).abs().max().item())
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = one_shot.all_reduce(x)
                x.mul_(2)  # the replay must read the new values
                graph.replay()
                worst = max(worst, (captured - 2 * nccl).abs().max().item())
        results.put((rank, worst))
    except BaseException as e:  # noqa: BLE001  (reported by the test)
        results.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def skip_without_one_shot() -> None:
    reason = unavailable_reason(torch.device("cuda", 0), torch.bfloat16, 2)
    if reason is not None:
        pytest.skip(f"one-shot all-reduce unavailable: {reason}")


def test_one_shot_all_reduce_sums_what_nccl_sums():
    from fastllm.worker.executor import free_port

    skip_without_one_shot()
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=one_shot_vs_nccl, args=(rank, port, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    out = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    # Two ranks: a + b in either order is the same sum, so the results are equal to the bit.
    assert out == {0: 0.0, 1: 0.0}, out


def kill_a_worker_mid_generate(model: str, one_shot_max_bytes: str | None, results) -> None:
    """In a fresh process, whose first multi-process engine may take the one-shot all-reduce: kill rank 1
    while a generate runs, steps into it (rank 0 is then inside a step's collectives, replaying a graph).
    Reports ("step", one-shot path?, what the generate raised, seconds from the kill), then ("shutdown",
    whether a worker outlived it); or ("failed", traceback)."""
    try:
        if one_shot_max_bytes is not None:
            os.environ[ENV_MAX_BYTES] = one_shot_max_bytes
        from fastllm.distributed.communication import get_tp_group

        llm = start(model, dtype="bfloat16", tensor_parallel_size=2)
        executor = llm.engine.executor
        procs = dict(executor.workers.procs)
        killed_at = []

        def kill_mid_generate(first_step: int):
            while executor._last_sent_step < first_step + 20:
                time.sleep(1e-4)
            killed_at.append(time.monotonic())
            os.kill(procs[1].pid, signal.SIGKILL)

        try:
            one_shot = get_tp_group().one_shot is not None
            llm.generate(prompts_of(2), SamplingParams(max_tokens=4), use_tqdm=False)
            threading.Thread(target=kill_mid_generate, args=(executor._last_sent_step,), daemon=True).start()
            error = "no error"
            try:  # 8 requests: every decode step replays a graph; 180 tokens outlast the 20 steps
                llm.generate(prompts_of() + prompts_of(2), SamplingParams(max_tokens=180, ignore_eos=True),
                             use_tqdm=False)
            except RuntimeError as e:
                error = str(e)
            seconds = time.monotonic() - killed_at[0] if killed_at else None
            results.put(("step", one_shot, error, seconds))
        finally:
            llm.engine.shutdown()
        results.put(("shutdown", any(p.is_alive() for p in procs.values())))
    except BaseException:  # noqa: BLE001  (reported by the test)
        results.put(("failed", traceback.format_exc()))


@pytest.mark.parametrize("path", ["one-shot", "nccl"])
def test_a_killed_gpu_worker_is_an_error_naming_its_rank(tiny, path):
    """On either all-reduce path. A step blocked in a collective whose peer is gone must end: the monitor
    raises the one-shot kernel's abort flag and aborts the NCCL groups, whose kernels then return. Each case
    runs in a process of its own, so that a hang fails the test rather than stopping the session."""
    if path == "one-shot":
        skip_without_one_shot()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    one_shot_max_bytes = "0" if path == "nccl" else None  # None: the default limit
    proc = ctx.Process(target=kill_a_worker_mid_generate, args=(tiny, one_shot_max_bytes, results))
    proc.start()
    got = {}
    try:
        while "shutdown" not in got and "failed" not in got:
            kind, *value = results.get(timeout=240)  # the engine's start and two generates; then shutdown
            got[kind] = value
    except queue.Empty:
        pass
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert "failed" not in got, got["failed"][0]
    assert "step" in got, f"{path}: the engine neither raised nor returned after its worker was killed"
    one_shot, error, seconds = got["step"]
    assert one_shot == (path == "one-shot")
    assert "worker rank 1" in error and seconds < 60, (error, seconds)
    assert "shutdown" in got, f"{path}: shutdown did not return after the worker was killed"
    assert not got["shutdown"][0], "a worker outlived shutdown"
