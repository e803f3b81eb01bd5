"""An FP8 KV cache (kv_cache_dtype="fp8") in the engine, through the dequantizing references (the engine
refuses it on the CPU; conftest's allow_fp8_kv_cache_on_cpu lifts that).

Quality: teacher-forced perplexity of stories260K on test_fp8_perplexity's eight stories (pooled: one
story's ratio has a standard error of ~1.2%, the eight's ~0.5%) within 2% of the float32 cache's (issue #26's
target) with calculate_kv_scales; with the default scales of 1.0 (vLLM's, no checkpoint scales) it is +2.2%.
Also: the calibration itself, the engine decodes with the cache, its blocks hold half the bytes (twice the
blocks in the same memory), the refusals, and checkpoint scales."""

from __future__ import annotations

import contextlib

import pytest
import torch

import fastllm.kernels.dispatch as dispatch
from fastllm import LLM, SamplingParams
from fastllm.kernels.reference import FP8
from fastllm.worker import kv_scales
from fastllm.worker.cache_engine import CacheEngine
from tests.conftest import PROMPTS, STORIES, cached_llm
from tests.models.test_fp8_perplexity import MORE_TEXTS, TEXT, perplexity
from tests.models.test_llama_vs_hf import make_tiny_model

TEXTS = [TEXT, *MORE_TEXTS]


def test_stories260k_perplexity_within_2_percent(allow_fp8_kv_cache_on_cpu):
    base = perplexity(cached_llm(STORIES), *TEXTS)
    default = perplexity(cached_llm(STORIES, kv_cache_dtype="fp8"), *TEXTS)
    llm = cached_llm(STORIES, kv_cache_dtype="fp8", calculate_kv_scales=True)
    fp8_kv = perplexity(llm, *TEXTS)
    print(f"\nstories260K perplexity over {len(TEXTS)} stories: float32 KV {base:.4f}, fp8 KV {fp8_kv:.4f} "
          f"({fp8_kv / base - 1:+.2%}; scales of 1.0: {default / base - 1:+.2%})")
    assert llm.engine.worker.runner.cache.gpu.dtype == FP8
    assert 2 < base < 5 and fp8_kv != base  # the cache really is quantized
    assert abs(fp8_kv / base - 1) <= 0.02
    # scales of 1.0 leave most of V's values (amax 1.5-3.6) in e4m3's subnormals: +2.2% here
    assert abs(default / base - 1) <= 0.03


def _kv_amax_of_a_prefill(model: str, num_tokens: int, **kw) -> list[tuple[float, float]]:
    """Each layer's K and V amax in a float32 cache after a prefill of calculate_kv_scales's tokens."""
    draw = torch.Generator().manual_seed(kv_scales.SEED)
    ids = torch.randint(0, 512, (num_tokens,), generator=draw).tolist()
    llm = LLM(model, dtype="float32", num_gpu_blocks=256, enable_prefix_caching=False, **kw)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.engine.check_kv_pool_whole()
    return [(k.abs().max().item(), v.abs().max().item())
            for k, v in (layer.kv_cache for layer in llm.engine.worker.runner.attention_layers)]


@pytest.mark.parametrize("feature", ["llama", "qwen3", "mistral-window"])
def test_calculate_kv_scales_measures_what_the_cache_would_hold(allow_fp8_kv_cache_on_cpu, feature,
                                                                tmp_path_factory):
    """The calibration forward's amax per layer are those of a prefill of the same tokens (float32; its
    attention is plain PyTorch's, the prefill's the reference kernels': equal up to rounding), so every layer
    sees text-like input, not the profiling run's stand-in; the scales are amax / 200 (K) and / 100 (V).
    Qwen3: K after its k_norm; the window (16) shorter than the 64 tokens."""
    model = STORIES if feature == "llama" else make_tiny_model(tmp_path_factory, feature)
    kw = dict(max_num_batched_tokens=64, max_model_len=128)
    want = _kv_amax_of_a_prefill(model, 64, **kw)
    llm = LLM(model, dtype="float32", num_gpu_blocks=256, kv_cache_dtype="fp8", calculate_kv_scales=True,
              **kw)
    layers = llm.engine.worker.runner.attention_layers
    got = [(k * kv_scales.K_SCALE_CONSTANT, v * kv_scales.V_SCALE_CONSTANT) for k, v in
           (layer.calculated_kv_scales for layer in layers)]
    assert len(got) == len(want) >= 2
    assert [x for pair in got for x in pair] == pytest.approx([x for pair in want for x in pair], rel=1e-4)
    assert all(layer.kv_scales == dict(zip(("k_scale", "v_scale"), layer.calculated_kv_scales))
               for layer in layers)
    assert all(layer.kv_amax is None for layer in layers)


def test_calculated_kv_scales_take_the_place_of_the_checkpoints(allow_fp8_kv_cache_on_cpu, tmp_path, caplog):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(STORIES, tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    tensors["model.layers.0.self_attn.kv_scale"] = torch.tensor(0.5)
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    kw = dict(device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks=40, kv_cache_dtype="fp8")
    assert LLM(str(tmp_path / "ckpt"), **kw).engine.worker.runner.attention_layers[0].kv_scales == \
        dict(k_scale=0.5, v_scale=0.5)
    with caplog.at_level("INFO", logger="fastllm"):
        llm = LLM(str(tmp_path / "ckpt"), calculate_kv_scales=True, **kw)
    layer = llm.engine.worker.runner.attention_layers[0]
    assert layer.checkpoint_kv_scales == (0.5, 0.5) and layer.kv_scales["k_scale"] != 0.5
    assert layer.kv_scales == dict(zip(("k_scale", "v_scale"), layer.calculated_kv_scales))
    assert "calculated at startup (in place of the checkpoint's)" in caplog.text


def test_calculate_kv_scales_needs_an_fp8_cache():
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        LLM(STORIES, device="cpu", calculate_kv_scales=True)


def test_decodes_with_an_fp8_cache(allow_fp8_kv_cache_on_cpu):
    """Greedy decode over prefill + many decode steps (chunked prompts too); the text stays close to the
    float32 cache's (the first tokens agree) and the pool is whole after."""
    prompts = ["Once upon a time", "Tim and the dog walked to the park. They"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = cached_llm(STORIES).generate(prompts, params, use_tqdm=False)
    llm = cached_llm(STORIES, kv_cache_dtype="fp8", max_num_batched_tokens=8)  # chunked prefill
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outs, base):
        assert len(out.outputs[0].token_ids) == 24
        assert out.outputs[0].token_ids[:4] == ref.outputs[0].token_ids[:4]
    llm.engine.check_kv_pool_whole()


def test_fp8_blocks_are_half_the_bytes():
    shape = (4, 2, 64)  # layers, KV heads, head dim
    bf16 = CacheEngine.bytes_per_block(*shape, 16, torch.bfloat16)
    assert CacheEngine.bytes_per_block(*shape, 16, FP8) * 2 == bf16 == 4 * 2 * 16 * 2 * 64 * 2


def test_engine_sizes_twice_the_blocks(allow_fp8_kv_cache_on_cpu):
    """The same KV memory (cpu_kv_cache_gib) holds twice the blocks with an FP8 cache (bf16 model)."""
    kw = dict(device="cpu", dtype="bfloat16", cpu_kv_cache_gib=0.01, enforce_eager=True)
    auto = LLM(STORIES, **kw).engine.worker
    fp8 = LLM(STORIES, kv_cache_dtype="fp8", **kw).engine.worker
    assert fp8.runner.kv_bytes_per_block() * 2 == auto.runner.kv_bytes_per_block()
    assert fp8.num_gpu_blocks in (2 * auto.num_gpu_blocks, 2 * auto.num_gpu_blocks + 1)
    assert fp8.runner.cache.gpu.dtype == FP8 and fp8.runner.cache.gpu.shape[2] == fp8.num_gpu_blocks


def test_refused_on_the_cpu_and_bad_values():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(STORIES, kv_cache_dtype="fp8", device="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(STORIES, kv_cache_dtype="int8", device="cpu")


def test_copies_move_fp8_bytes():
    """Copy-on-write (few pairs and many) and swaps move e4m3 blocks bit for bit."""
    cache = CacheEngine(2, 2, 8, 4, FP8, torch.device("cpu"), num_blocks=12, num_cpu_blocks=4)
    cache.gpu.copy_((torch.randn(cache.gpu.shape) * 50).to(FP8))
    before = cache.gpu.clone()
    raw = lambda t: t.view(torch.uint8)  # noqa: E731
    cache.copy([(0, 1)])
    assert torch.equal(raw(cache.gpu[:, :, 1]), raw(before[:, :, 0]))
    pairs = [(2, 6), (3, 7), (4, 8), (5, 9), (10, 11)]
    cache.copy(pairs)
    for src, dst in pairs:
        assert torch.equal(raw(cache.gpu[:, :, dst]), raw(before[:, :, src]))
    cache.swap_out([(2, 0), (3, 3)])
    cache.swap_in([(3, 0)])
    assert torch.equal(raw(cache.gpu[:, :, 0]), raw(before[:, :, 3]))


@contextlib.contextmanager
def reference_kernels():
    """Within the block, every op dispatches to its reference (ops choose at each call)."""
    saved = dispatch._MODE, dispatch._chosen
    dispatch._MODE, dispatch._chosen = "reference", {}
    try:
        yield
    finally:
        dispatch._MODE, dispatch._chosen = saved


def _gpu_llms(dtype):
    """The compiled engine (CUDA graphs for decode and mixed steps, the Triton kernels) over an FP8 cache,
    the same over a 16/32-bit cache, and an eager engine over an FP8 cache for reference_kernels()."""
    kw = dict(dtype=dtype, device="cuda", num_gpu_blocks=2048)
    llm, base_llm = cached_llm(STORIES, kv_cache_dtype="fp8", **kw), cached_llm(STORIES, **kw)
    assert llm.engine.worker.runner.graphs is not None and llm.engine.worker.runner.cache.gpu.dtype == FP8
    with reference_kernels():
        ref_llm = cached_llm(STORIES, kv_cache_dtype="fp8", enforce_eager=True, **kw)
    return llm, base_llm, ref_llm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_engine_with_cuda_graphs(dtype):
    """The kernels over an FP8 cache against the reference kernels over one: float32 greedy tokens equal;
    bf16 teacher-forced perplexity within 1% (e4m3 turns the two paths' bf16 rounding differences into
    whole e4m3 steps wherever a value sits near a boundary, so greedy text parts early at near-ties:
    2 of 8 prompts agreed over 32 tokens on an H200). The pool whole after.
    (Against the 16/32-bit cache's tokens there is no such equality either: e4m3 flips near-ties, e.g. the
    third token of "Lily had a cat", the same on the CPU's references.)"""
    llm, _, ref_llm = _gpu_llms(dtype)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with reference_kernels():
        ref = [o.outputs[0].token_ids for o in ref_llm.generate(PROMPTS, params, use_tqdm=False)]
    if dtype == "float32":
        assert got == ref
    else:
        agree = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(g)) for g, r in zip(got, ref)]
        kernels = perplexity(llm, TEXT)
        with reference_kernels():
            reference = perplexity(ref_llm, TEXT)
        print(f"\nbf16, FP8 cache: leading tokens agreeing {agree}; perplexity kernels {kernels:.4f}, "
              f"reference {reference:.4f}")
        assert abs(kernels / reference - 1) <= 0.01
    llm.engine.check_kv_pool_whole()
    ref_llm.engine.check_kv_pool_whole()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_perplexity_within_2_percent(dtype):
    """Issue #26's quality target on the GPU: an FP8 cache with calculate_kv_scales within 2% of the
    16/32-bit cache's perplexity over the eight stories (the CPU references: float32 +1.6%, bf16 +1.9%). (On
    the first story alone with scales of 1.0, an H200 gave bf16 +2.41%, float32 +1.64%.)"""
    _, base_llm, _ = _gpu_llms(dtype)
    llm = cached_llm(STORIES, kv_cache_dtype="fp8", calculate_kv_scales=True, dtype=dtype, device="cuda",
                     num_gpu_blocks=2048)
    base, fp8_kv = perplexity(base_llm, *TEXTS), perplexity(llm, *TEXTS)
    print(f"\nGPU {dtype}: perplexity over {len(TEXTS)} stories {base:.4f}, fp8 KV {fp8_kv:.4f} "
          f"({fp8_kv / base - 1:+.2%})")
    assert abs(fp8_kv / base - 1) <= 0.02
