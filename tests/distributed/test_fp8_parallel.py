"""FP8 weights and an FP8 KV cache split over two tensor-parallel ranks (gloo, CPU, the dequantizing
references; the fp8_ranks_on_cpu fixture lifts the CPU refusal in the spawned rank too), against one rank
with the same FP8 settings.

Each rank holds its slice of the single-rank FP8 weights: column-parallel layers their rows and those rows'
scales, row-parallel layers their input columns and every row's scale. Its KV heads' cache is e4m3 with
the layer's per-tensor k/v scales, the same on every rank. With static activation scales (a checkpoint's
input_scale) every rank quantizes its part of an activation exactly as one rank does, so the logits
differ from one rank's only in the order of the row-parallel sums. With dynamic scales a row-parallel
layer's rank quantizes its own slice of each token (its amax, as vLLM does: no collective for a scale), a
finer rounding than one rank's, held to one rank's perplexity.
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file, save_file

from fastllm import SamplingParams
from fastllm.kernels.reference import FP8
from fastllm.worker.executor import end_parked_workers
from tests.conftest import DRAFT, PROMPTS, STORIES, cached_llm
from tests.distributed.conftest import shutdown_parallel_llm, start_parallel_llm
from tests.layers.test_fp8 import write_fp8_checkpoint
from tests.models.test_fp8_perplexity import TEXT, perplexity

MAX_TOKENS = 16
# A 24-token budget (long prompts in chunks) and a pool small enough to swap; a second round hits the
# prefix cache.
SETTINGS = dict(max_num_batched_tokens=24, max_model_len=128, block_size=8, num_gpu_blocks=20,
                preemption_mode="swap", num_cpu_blocks=64, kv_cache_dtype="fp8")
LONG = " and then they played in the park with the big red ball until the sun went down"
FIRST = PROMPTS[:6] + [PROMPTS[0] + LONG, PROMPTS[2] + LONG]
SECOND = [PROMPTS[0] + LONG + " again", PROMPTS[2] + LONG + " and ate"]


@pytest.fixture(scope="module", autouse=True)
def end_ranks():
    yield
    end_parked_workers()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, **kw)


def compare(got, want) -> tuple[int, float]:
    """Tokens equal to the reference's up to its first near-tie (a top-2 gap under 1e-4), logprobs within
    1e-4; returns the tokens compared and the largest logprob difference."""
    compared, worst = 0, 0.0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        for i, token in enumerate(w.token_ids):
            assert g.token_ids[i] == token, f"token {i} of {w.token_ids} (got {g.token_ids})"
            worst = max(worst, abs(g.logprobs[i][token].logprob - w.logprobs[i][token].logprob))
            compared += 1
            top = sorted((lp.logprob for lp in w.logprobs[i].values()), reverse=True)
            if top[0] - top[1] < 1e-4:
                break
    assert worst < 1e-4, worst
    return compared, worst


def split_and_one_rank(model, **kwargs):
    """Engines of two ranks and of one with the same settings, each fresh: they take the same steps (a
    prefix hit or a preemption elsewhere computes rows in batches of other sizes, whose sums may round an
    e4m3 value the other way)."""
    settings = {**SETTINGS, **kwargs}
    ref = cached_llm(model, **settings)
    llm = start_parallel_llm(model, tensor_parallel_size=2, reuse_workers=True, **settings)
    assert llm.engine.worker.runner.cache.gpu.dtype == FP8
    return llm, ref


def check_preempted_and_hit(llm):
    assert llm.engine.scheduler.kv.pool.stats.hits > 0 and llm.engine.scheduler.num_preemptions > 0


def test_dynamic_activation_scales(fp8_ranks_on_cpu):
    """Per-token scales: each row-parallel rank rounds its own slice, so the test is quality (teacher-forced
    perplexity within 1% of one rank's) and that chunked prompts and prefix hits run; greedy tokens part
    from one rank's at the first near-tie the two roundings see differently."""
    kw = dict(SETTINGS, max_model_len=256, num_gpu_blocks=64, quantization="fp8")
    llm = start_parallel_llm(STORIES, tensor_parallel_size=2, reuse_workers=True, **kw)
    try:
        base = perplexity(cached_llm(STORIES, max_model_len=256), TEXT)
        one, two = perplexity(cached_llm(STORIES, **kw), TEXT), perplexity(llm, TEXT)
        print(f"\nperplexity float32 {base:.4f}, FP8 weights and KV one rank {one:.4f}, two ranks {two:.4f}")
        assert two != one and abs(two / one - 1) <= 0.01
        assert abs(two / base - 1) <= 0.05  # FP8 weights (3%) and cache (2%)
        outputs = [llm.generate(prompts, greedy(), use_tqdm=False) for prompts in (FIRST, SECOND)]
        assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for out in outputs for o in out)
        assert llm.engine.scheduler.kv.pool.stats.hits > 0
    finally:
        shutdown_parallel_llm(llm)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_calculated_kv_scales_per_rank(fp8_ranks_on_cpu, layout):
    """calculate_kv_scales on two ranks: each calibrates its own KV heads in the same forward (the same random
    tokens; the row-parallel sums all-reduced, or the stages' activations handed on, as in any forward), so
    rank 0's scales are at most the layer's (tensor parallel: its heads' amax) and the cache may round
    differently from one rank's: held to one rank's perplexity."""
    kw = dict(SETTINGS, max_model_len=256, num_gpu_blocks=64, calculate_kv_scales=True)
    split = dict(tensor_parallel_size=2) if layout == "tp2" else dict(pipeline_parallel_size=2)
    llm = start_parallel_llm(STORIES, reuse_workers=True, **split, **kw)
    try:
        ref = cached_llm(STORIES, **kw)
        one, two = perplexity(ref, TEXT), perplexity(llm, TEXT)
        print(f"\nperplexity with calculated KV scales: one rank {one:.4f}, two ranks {two:.4f}")
        assert abs(two / one - 1) <= 0.01
        pairs = [(a.calculated_kv_scales, b.calculated_kv_scales) for a, b in
                 zip(llm.engine.worker.runner.attention_layers, ref.engine.worker.runner.attention_layers)]
        assert all(x <= y * (1 + 1e-4) for rank0, whole in pairs for x, y in zip(rank0, whole))
    finally:
        shutdown_parallel_llm(llm)


def write_checkpoint(path, layout: str) -> str:
    """stories260K as an FP8 checkpoint with static input scales and KV-cache scales: compressed-tensors
    with per-channel weight scales and k_scale / v_scale, or "fp8" with per-tensor ones and one kv_scale.
    The KV scales are powers of two: dividing by one is exact, so the two splits' K and V, which differ in
    the last bits (the order of the row-parallel sums), round to the same e4m3 values unless one sits on a
    rounding boundary; other scales put some there (an e4m3 step apart: logprobs up to 0.14 apart on this
    model), which is the rounding test_fp8_rounding.py measures, not the split."""
    path = write_fp8_checkpoint(path, layout, per_tensor=layout == "fp8", static_input=True)
    tensors = load_file(str(path / "model.safetensors"))
    for i in range(5):
        if layout == "fp8":
            tensors[f"model.layers.{i}.self_attn.kv_scale"] = torch.tensor(2.0 ** -(5 + i % 3))
        else:
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(2.0 ** -(5 + i % 2))
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(2.0 ** -(6 + i % 3))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt", "compressed-tensors")


@pytest.mark.parametrize("layout,quantize_lm_head", [("compressed-tensors", False), ("fp8", False),
                                                     ("compressed-tensors", True)])
def test_fp8_checkpoint_with_static_scales_and_kv_scales(fp8_ranks_on_cpu, fp8_checkpoint, layout, quantize_lm_head,
                                                         tmp_path):
    """quantize_lm_head: each rank's vocabulary rows of the one-rank FP8 head (a scale per row), the whole hidden
    state quantized per token on every rank as on one."""
    llm, ref = split_and_one_rank(fp8_checkpoint if layout == "compressed-tensors" else
                                  write_checkpoint(tmp_path / "ckpt", layout), quantize_lm_head=quantize_lm_head)
    for engine in (llm, ref):
        assert engine.engine.worker.runner.model.lm_head.weight.dtype == (FP8 if quantize_lm_head else torch.float32)
    try:
        compared, worst = 0, 0.0
        for prompts in (FIRST, SECOND):
            got, want = (e.generate(prompts, greedy(logprobs=2), use_tqdm=False) for e in (llm, ref))
            n, err = compare(got, want)
            compared, worst = compared + n, max(worst, err)
        check_preempted_and_hit(llm)
        print(f"\nTP=2 against one rank: {compared} tokens equal, logprobs within {worst:.2g}")
        assert compared >= 0.9 * (len(FIRST) + len(SECOND)) * MAX_TOKENS
    finally:
        shutdown_parallel_llm(llm)


def test_speculative_decoding(fp8_ranks_on_cpu, fp8_checkpoint):
    """Every rank runs the whole 16/32-bit draft and verifies against its shard's FP8 cache (one rank's
    speculative tokens are its plain greedy tokens: tests/engine/test_fp8_combinations.py). No logprobs:
    requests that ask for them do not speculate."""
    llm, ref = split_and_one_rank(fp8_checkpoint, speculative_model=DRAFT, num_speculative_tokens=3,
                                  num_gpu_blocks=17)
    try:
        for prompts in (FIRST, SECOND):
            got, want = ([o.outputs[0].token_ids for o in e.generate(prompts, greedy(), use_tqdm=False)]
                         for e in (llm, ref))
            assert got == want
        check_preempted_and_hit(llm)
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        shutdown_parallel_llm(llm)


@pytest.mark.parametrize("field,value", [("kv_cache_dtype", "fp8"), ("quantization", "fp8")])
def test_split_engines_refuse_fp8_on_the_cpu(field, value):
    """Without the tests' lift, every rank refuses: a ValueError naming the field, not a 16-bit run."""
    from fastllm import LLM

    with pytest.raises(ValueError, match=f"^{field}: "):
        LLM(STORIES, device="cpu", dtype="float32", tensor_parallel_size=2, num_gpu_blocks=40, **{field: value})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_split_engine_with_graphs_agrees_with_one_gpu(fp8_checkpoint):
    """Over NCCL, compiled with CUDA graphs, against one GPU's eager engine; the GEMMs of a rank's half
    sum in another order, so tokens agree up to near-ties of the FP8 rounding bound (test_fp8_combinations)."""
    from fastllm import LLM
    from tests.engine.test_fp8_combinations import agree_until_near_ties

    gpu = dict(device="cuda", dtype="float32", num_gpu_blocks=256, max_model_len=128, max_num_batched_tokens=128,
               kv_cache_dtype="fp8")
    one = LLM(fp8_checkpoint, enforce_eager=True, **gpu)
    want = one.generate(FIRST, greedy(logprobs=2), use_tqdm=False)
    del one
    llm = LLM(fp8_checkpoint, tensor_parallel_size=2, **gpu)
    try:
        assert llm.engine.worker.runner.graphs is not None
        got = [o.outputs[0].token_ids for o in llm.generate(FIRST, greedy(logprobs=2), use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    compared = agree_until_near_ties(want, got)
    print(f"\nTP=2 on GPUs: {compared} tokens equal before a near-tie")
    assert compared >= 0.5 * len(FIRST) * MAX_TOKENS
