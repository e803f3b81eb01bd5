"""Prefill and mixed steps through the mixed-step CUDA graphs (compile/mixed_graphs.py) give the tokens of
the plain path and of Hugging Face: chunked prefill, prefix-cache hits, preemption, async scheduling's
in-flight tokens, prompt logprobs.

On the CPU the graph runners run in their no-replay mode (the staging, the static buffers and the forward
a graph captures, without the capture) and the prefill attention runs the Triton kernel (interpreted, fp32)
over the tile maps, as a graph replays it. On the GPU an engine with the graphs and one without
(mixed_cuda_graph_max_tokens=0) are compared, and the graphs must have been replayed."""

from __future__ import annotations

import pytest
import torch

import fastllm.kernels.dispatch as dispatch
from fastllm import LLM, SamplingParams
from fastllm.compile.cuda_graphs import CUDAGraphRunner
from fastllm.compile.mixed_graphs import MixedGraphRunner, token_buckets
from fastllm.kernels import triton_impl
from tests.conftest import (PROMPTS, STORIES, assert_same_or_near_tie, cached_llm, hf_greedy,
                            release_cached_engines, tokenize)

MAX_TOKENS = 16
# Four requests at a time and a 24-token budget: later prompts are prefilled (in chunks, when long) while
# earlier ones decode; the first four share a prefix of three 8-token blocks (prefix-cache hits).
PREFIX = "Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog. "
MIXED_PROMPTS = [PREFIX + p for p in PROMPTS[:4]] + PROMPTS[5:7]
BASE = dict(max_num_batched_tokens=24, max_model_len=128, max_num_seqs=4, block_size=8)


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)


def expected(prompts=MIXED_PROMPTS):
    return [hf_greedy(STORIES, ids, MAX_TOKENS) for ids in tokenize(prompts)]


def tokens(llm, prompts=MIXED_PROMPTS, params=None):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params or greedy(), use_tqdm=False)]


def install_graph_runners(llm, monkeypatch, triton: bool = True):
    """Decode and mixed-step graph runners in no-replay mode on the engine's runner, the prefill attention on
    the Triton kernel (triton; else the reference, which ignores tile maps) and the decode rows on the decode
    kernel; returns the record of the mixed steps staged ((tokens, in-flight rows) each) and of the prefill
    kernel's launches (whether each had a tile map), and the decode rows each decode launch attended."""
    runner = llm.engine.worker.runner
    cfg = runner.config
    max_len, num_seqs = cfg.model.max_model_len, cfg.scheduler.max_num_seqs
    max_blocks = -(-max_len // runner.block_size)
    decode = CUDAGraphRunner(runner.forward, runner.model.compute_logits, runner.attention_layers, [1, 2, 4],
                             max_blocks, max_len, runner.args.vocab_size, runner.dtype, runner.device)
    decode.graphs = dict.fromkeys(decode.sizes)  # as if captured; replay=False never touches them
    decode.replay = False
    buckets = token_buckets(cfg.scheduler.max_num_batched_tokens)
    mixed = MixedGraphRunner(runner.forward, runner.attention_layers, buckets, num_seqs, max_blocks, max_len,
                             decode, runner.device)
    mixed.replay = False
    staged, launches, decoded = [], [], []
    stage, kernel = mixed.stage, triton_impl("prefill_attention")
    decode_kernel = triton_impl("paged_decode_attention") if triton else dispatch._select(
        "paged_decode_attention", runner.device)

    def recording_stage(stager, in_flight, from_device, ids, *rest):
        staged.append((len(ids), len(from_device)))
        return stage(stager, in_flight, from_device, ids, *rest)

    def recording_kernel(*args):
        launches.append(args[-1] is not None)  # tile_map, the last argument
        return kernel(*args)

    def recording_decode_kernel(*args):
        decoded.append(int((args[4] > 0).sum()))  # seq_lens: the rows that are decodes
        return decode_kernel(*args)

    monkeypatch.setattr(mixed, "stage", recording_stage)
    monkeypatch.setattr(runner, "graphs", decode)
    monkeypatch.setattr(runner, "mixed_graphs", mixed)
    if triton:
        monkeypatch.setitem(dispatch._chosen, ("prefill_attention", runner.device.type), recording_kernel)
    monkeypatch.setitem(dispatch._chosen, ("paged_decode_attention", runner.device.type),
                        recording_decode_kernel)
    return staged, launches, decoded


@pytest.mark.parametrize("num_blocks", [256, 18], ids=["chunked-prefix", "preemption"])
def test_mixed_steps_through_the_graph_inputs(num_blocks, monkeypatch):
    # a fresh engine: its prefix cache starts empty, so prompts are prefilled (in chunks) and hit only the
    # shared prefix. The small pool preempts; it runs the reference attention (the kernel is the first's).
    llm = LLM(STORIES, device="cpu", dtype="float32", num_gpu_blocks=num_blocks, **BASE)
    triton = num_blocks > 100
    staged, launches, decoded = install_graph_runners(llm, monkeypatch, triton)
    prefix_stats = llm.engine.scheduler.kv.pool.stats
    assert tokens(llm) == expected()
    assert any(decoded), "some mixed step's decodes should have run as the decode kernel's rows"
    assert any(n > 16 for n, _ in staged) and any(n <= 16 for n, _ in staged), staged  # both buckets
    assert any(rows for _, rows in staged), "some mixed step should read a token still on the device"
    assert prefix_stats.hits >= 3 * 3 * 8, "the shared prefix should have been hit"
    if triton:
        assert launches and all(launches), "every prefill attention launch should take the tile map"
    else:
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    llm.engine.check_kv_pool_whole()


def test_prompt_logprobs_through_the_graph_inputs(monkeypatch):
    llm = cached_llm(**BASE)
    params = [greedy(prompt_logprobs=2) if i == 4 else greedy() for i in range(len(MIXED_PROMPTS))]

    def scored():
        outs = llm.generate(MIXED_PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], outs[4].prompt_logprobs

    plain_tokens, plain_logprobs = scored()
    staged, _, _ = install_graph_runners(llm, monkeypatch, triton=False)
    got_tokens, got_logprobs = scored()
    assert got_tokens == plain_tokens and staged
    assert len(got_logprobs) == len(plain_logprobs) > 1
    for got, want in zip(got_logprobs[1:], plain_logprobs[1:]):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in want)


def test_mixed_cuda_graph_max_tokens_is_checked():
    from fastllm.config import EngineConfig

    for bad in (-1, 8, 15, 2.5):
        with pytest.raises(ValueError, match="mixed_cuda_graph_max_tokens"):
            EngineConfig.from_kwargs(mixed_cuda_graph_max_tokens=bad)
    assert EngineConfig.from_kwargs().compile.mixed_cuda_graph_max_tokens == 2048
    assert EngineConfig.from_kwargs(mixed_cuda_graph_max_tokens=0).compile.mixed_cuda_graph_max_tokens == 0


# ---- on the GPU: captured and replayed ----

def gpu_run(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    return llm.generate(prompts, params, use_tqdm=False)


def count_replays(llm):
    mixed = llm.engine.worker.runner.mixed_graphs
    assert mixed is not None and mixed.graphs, "no mixed-step graph was captured"
    buckets = []
    replay = mixed.replay_staged

    def counted(num_tokens):
        buckets.append(mixed.bucket(num_tokens))
        return replay(num_tokens)
    mixed.replay_staged = counted
    return buckets


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=64, max_num_seqs=4, block_size=8, max_model_len=256, num_gpu_blocks=512),
    dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=8, max_model_len=128, num_gpu_blocks=18),
], ids=["chunked-prefix", "preemption"])
def test_gpu_mixed_graphs_on_and_off_agree(dtype, engine_args):
    release_cached_engines()
    prompts = MIXED_PROMPTS + [PREFIX * 3 + p for p in PROMPTS[:4]]  # ~95 tokens: prefilled in two chunks
    runs = {}
    for max_tokens in (64, 0):
        llm = LLM(STORIES, device="cuda", dtype=dtype, mixed_cuda_graph_max_tokens=max_tokens, **engine_args)
        if max_tokens:
            replayed = count_replays(llm)
        gpu_run(llm, prompts[:3])  # warm the prefix cache: later prompts hit it
        runs[max_tokens] = gpu_run(llm, prompts)
        if not max_tokens:
            assert llm.engine.worker.runner.mixed_graphs is None
        if engine_args["num_gpu_blocks"] < 100:
            assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
        llm.engine.check_kv_pool_whole()
        del llm
        torch.cuda.empty_cache()
    assert len(set(replayed)) >= 2, f"mixed graphs of several buckets should have replayed: {replayed}"
    on, off = runs[64], runs[0]
    if dtype == "float32":
        assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
        assert [o.outputs[0].token_ids for o in on][:len(MIXED_PROMPTS)] == \
            [hf_greedy(STORIES, ids, MAX_TOKENS) for ids in tokenize(MIXED_PROMPTS)]
    else:
        assert_same_or_near_tie([o.outputs[0].token_ids for o in on], off)


@pytest.mark.gpu
def test_gpu_replay_and_compiled_only_agree():
    """Replaying the mixed graphs and running the same staged steps through the compiled forward without
    them run the same kernels on the same buffers: identical tokens."""
    release_cached_engines()
    # no prefix caching: both runs schedule the same steps
    llm = LLM(STORIES, device="cuda", dtype="bfloat16", num_gpu_blocks=512, enable_prefix_caching=False,
              mixed_cuda_graph_max_tokens=24, **BASE)
    mixed = llm.engine.worker.runner.mixed_graphs
    replayed = count_replays(llm)
    mixed.replay = False
    compiled_only = [o.outputs[0].token_ids for o in gpu_run(llm, MIXED_PROMPTS)]
    mixed.replay = True
    replayed.clear()
    assert [o.outputs[0].token_ids for o in gpu_run(llm, MIXED_PROMPTS)] == compiled_only
    assert replayed and set(replayed) == {16, 24}, replayed
    llm.engine.check_kv_pool_whole()
