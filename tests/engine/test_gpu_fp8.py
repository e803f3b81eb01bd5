"""FP8 weights on a GPU (sm_89+): the engine with quantization="fp8", eager and compiled with CUDA graphs,
against the CPU's dequantizing reference (float32: 90% of logprobs within 1e-4, all within 0.75, tokens
equal up to near-ties; with quantize_lm_head too; bf16: the same story for a while, as for bf16 without FP8),
and a dummy Llama-3.1-8B in FP8, compiled against eager, with its KV pool sized by the profiling run. Marked
`gpu`: skipped without CUDA.

llama2xs-279K is the tiny model here: every projection's K and N are multiples of 16, so in bf16 prompts of
more than 32 tokens run torch._scaled_mm (stories260K's 172-wide MLP would take the reference there); in
float32 they take the dequantizing reference (fp8_linear.py: _scaled_mm's accumulator on Hopper is not
float32's, and moved 90% of the logprobs by up to 0.155); decode steps run the weight-streaming kernel."""

from __future__ import annotations

import gc

import pytest
import torch

from fastllm import LLM, SamplingParams
from tests.conftest import DRAFT, PROMPTS, cached_llm, release_cached_engines
from tests.engine.test_gpu_engine import leading_agreement

pytestmark = pytest.mark.gpu

SMALL_POOL = {"num_gpu_blocks": 2048}
LOGPROBS = SamplingParams(temperature=0, max_tokens=48, logprobs=2)


def fp8_layers(llm):
    """The modules that run in FP8: projections hold their Fp8Scheme (None in 16/32 bits), lm_head a flag."""
    model = llm.engine.worker.runner.model
    return [m for m in model.modules() if getattr(m, "fp8", None)]


# An e4m3 activation now and then sits next to a rounding boundary: the smallest change in the rounding of
# what feeds the quantizer (the GPU's order of sums in the GEMMs, its attention and norms) flips it, and that
# moves the step's logprobs by up to ~0.68 on llama2xs while nearly every other position stays exact.
# test_fp8_rounding.py measures it on the CPU: runs whose quantizer inputs move by a few float32 ulps (at most
# 0.68 over 112 runs; two GEMM orders alone flip one position, by 0.30). A wrong scale or rounding moves every
# position, so the 90th percentile is the sharp check and the maximum the coarse one.
MAX_LOGPROB_ERR = 0.75
P90_LOGPROB_ERR = 1e-4


def compare_greedy(want, got, max_err: float, what: str, p90_err: float | None = None) -> int:
    """Greedy outputs with logprobs: the logprobs both report agree within `max_err` (and, given p90_err,
    90% of them within it), and the tokens are equal until a near-tie, where the reference's top-2 margin is
    within 2 * max_err (each side's logprobs may move by max_err, so only there may the argmax swap; later
    steps see different inputs). Returns the tokens compared before any parting."""
    compared, parted, errors = 0, 0, []
    for w, g in zip(want, got):
        for i, (tw, tg) in enumerate(zip(w.outputs[0].token_ids, g.outputs[0].token_ids)):
            lw, lg = w.outputs[0].logprobs[i], g.outputs[0].logprobs[i]
            for tid in set(lw) & set(lg):
                err = abs(lw[tid].logprob - lg[tid].logprob)
                errors.append(err)
                assert err <= max_err, f"{what}: logprob of token {tid} at step {i} off by {err:.3g} > {max_err}"
            if tw != tg:
                top = sorted(lw.values(), key=lambda x: -x.logprob)
                margin = top[0].logprob - top[1].logprob
                assert margin <= 2 * max_err, f"{what}: tokens differ at {i} with a clear margin {margin:.3g}"
                parted += 1
                break
            compared += 1
    p90 = float(torch.tensor(errors).quantile(0.9))
    print(f"\n{what}: {compared} tokens equal before any near-tie, {parted} sequences parted at one; "
          f"logprob error max {max(errors):.3g} (tolerance {max_err}), 90th percentile {p90:.3g} "
          f"(tolerance {p90_err})")
    if p90_err is not None:
        assert p90 <= p90_err, f"{what}: 90th percentile logprob error {p90:.3g} > {p90_err}"
    return compared


@pytest.fixture(scope="module")
def cpu_reference():
    """The CPU's dequantizing reference, float32 (the engine refuses FP8 on the CPU: lifted here)."""
    with pytest.MonkeyPatch.context() as patch:
        from fastllm.layers import fp8

        patch.setattr(fp8, "check_device", lambda *args: None)
        llm = cached_llm(DRAFT, device="cpu", dtype="float32", quantization="fp8")
    return llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_fp8_float32_matches_the_cpu_reference(cpu_reference, eager):
    """float32 activations on both sides: the same e4m3 operands (the quantization is bitwise the
    reference's), products summed in another order; compiled + CUDA graphs, or eager."""
    llm = cached_llm(DRAFT, device="cuda", dtype="float32", quantization="fp8", enforce_eager=eager,
                     max_num_seqs=64, **SMALL_POOL)
    layers = fp8_layers(llm)
    assert len(layers) == 4 * 5 and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert (llm.engine.worker.runner.graphs is None) == eager
    compared = compare_greedy(cpu_reference, llm.generate(PROMPTS, LOGPROBS, use_tqdm=False), MAX_LOGPROB_ERR,
                              f"fp8 float32 GPU ({'eager' if eager else 'graphs'}) vs CPU reference",
                              P90_LOGPROB_ERR)
    assert compared >= 8 * 24


def test_fp8_lm_head_float32_matches_the_cpu_reference():
    """quantize_lm_head: the e4m3 head (compiled, its logits in the CUDA graphs' buffers) against the CPU
    reference with the same flag, held to the same bounds."""
    with pytest.MonkeyPatch.context() as patch:
        from fastllm.layers import fp8

        patch.setattr(fp8, "check_device", lambda *args: None)
        want = cached_llm(DRAFT, device="cpu", dtype="float32", quantization="fp8", quantize_lm_head=True
                          ).generate(PROMPTS, LOGPROBS, use_tqdm=False)
    llm = cached_llm(DRAFT, device="cuda", dtype="float32", quantization="fp8", quantize_lm_head=True,
                     max_num_seqs=64, **SMALL_POOL)
    head = llm.engine.worker.runner.model.lm_head
    assert head.weight.dtype == torch.float8_e4m3fn and llm.engine.worker.runner.graphs is not None
    compared = compare_greedy(want, llm.generate(PROMPTS, LOGPROBS, use_tqdm=False), MAX_LOGPROB_ERR,
                              "fp8 float32 with an FP8 lm_head, GPU (graphs) vs CPU reference", P90_LOGPROB_ERR)
    assert compared >= 8 * 24


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_fp8_bfloat16_writes_the_same_story(cpu_reference, eager):
    """bf16 activations (quantized from bf16, outputs rounded to it) against the float32 reference: the
    same story for a while, as test_gpu_engine.py asks of bf16 without FP8."""
    llm = cached_llm(DRAFT, device="cuda", dtype="bfloat16", quantization="fp8", enforce_eager=eager,
                     max_num_seqs=64, **SMALL_POOL)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)]
    agree = [leading_agreement(g, w.outputs[0].token_ids) for g, w in zip(got, cpu_reference)]
    print(f"\nfp8 bf16 ({'eager' if eager else 'graphs'}) vs float32 reference: leading tokens agreeing per "
          f"prompt {agree}, mean {sum(agree) / len(agree):.1f} of {LOGPROBS.max_tokens}")
    assert sum(agree) / len(agree) >= 8


@pytest.mark.whole_gpu
def test_dummy_llama_8b_fp8_compiled_vs_eager_and_its_memory():
    release_cached_engines()
    prompts = [{"prompt_token_ids": torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(n))
                .tolist()} for n in (17, 64, 128, 5)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    results = {}
    for eager in (True, False):
        # What the GPU holds before the engine (the CUDA context, what earlier tests of the process or other
        # processes keep) is no engine's to take, bf16's or FP8's.
        free, total_bytes = torch.cuda.mem_get_info(0)
        held = (total_bytes - free) / 2**30
        llm = LLM("llama-3.1-8b", load_format="dummy", dtype="bfloat16", quantization="fp8",
                  max_model_len=4096, gpu_memory_utilization=0.85, enforce_eager=eager, max_num_seqs=64)
        worker = llm.engine.worker
        model = worker.runner.model
        weights = sum(t.numel() * t.element_size() for t in model.parameters()) / 2**30
        how = "eager" if eager else "compiled+graphs"
        print(f"\nLlama-3.1-8B dummy FP8 ({how}): weights {weights:.2f} GiB, "
              f"{worker.num_gpu_blocks} KV blocks, {worker.kv_cache_gib():.2f} GiB; "
              f"startup {llm.engine.startup_seconds:.1f} s")
        # e4m3 projections (6.98 B weights) + bf16 embedding, lm_head and norms = 8.46 GiB; bf16: 14.96 GiB
        assert 8.4 < weights < 8.5
        total = total_bytes / 2**30
        # more KV than bf16 can ever get: its 14.96 GiB of weights alone leave it less than that
        bound = total * 0.85 - held - 14.96
        kv = worker.kv_cache_gib()
        assert kv > bound, f"KV {kv:.2f} GiB <= {bound:.2f} (0.85 of {total:.2f} GiB, {held:.2f} held first)"
        results[eager] = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_kv_pool_whole()
        del llm, worker, model
        gc.collect()
        torch.cuda.empty_cache()
    # Compiled and eager round differently (Inductor's fusions, a mixed step's CUDA graph): bf16's test
    # allows 5% of a logprob, ~0.3 at these (-6 to -7), which bounds 90% of them here. An e4m3 activation
    # flipped by that rounding moves a position by up to MAX_LOGPROB_ERR (the CPU measures it: top of this
    # file); the prompts of 64 and 128 tokens meet one (H200: 0.66 at a fourth token, p90 0.10).
    compare_greedy(results[True], results[False], MAX_LOGPROB_ERR, "Llama-3.1-8B FP8 compiled vs eager",
                   p90_err=0.3)
