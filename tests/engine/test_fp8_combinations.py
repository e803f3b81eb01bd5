"""FP8 weights (quantization="fp8") and an FP8 KV cache (kv_cache_dtype="fp8") with the engine's other
features, through the dequantizing references on the CPU (conftest's allow_fp8_* fixtures lift the
engine's refusal there). Each feature is held to its own oracle with FP8 on both sides: prefix hits give
the misses' tokens, swapped requests the unpreempted ones', speculative decoding the target's own greedy
tokens, n > 1 siblings and beam search (copy-on-write of e4m3 blocks) what the model scores from scratch,
cascade attention the plain path's tokens; a sliding-window model (Mistral) and Qwen3's q/k norms decode
past their window / through the fused norms alike chunked and unchunked. The KV pool is whole after each.

Equality is exact here, as for 16/32-bit weights, with one caveat FP8 adds: a row computed in a batch of
another size (a decode step's one row against a recomputed prefill's many) sums in another order, and where
that moves an activation or a K/V value across an e4m3 rounding boundary the logprobs part by up to a few
tenths (test_fp8_rounding.py measures it). These workloads cross none on the CPU's float32 GEMMs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._inductor import graph as inductor_graph
from torch._inductor import lowering as inductor_lowering

from fastllm import BeamSearchParams, SamplingParams
from fastllm.kernels.reference import FP8
from tests.conftest import DRAFT, PROMPTS, STORIES, TEST_DEVICE, cached_llm, tokenize
from tests.engine.test_gpu_fp8 import MAX_LOGPROB_ERR
from tests.models.test_llama_vs_hf import make_tiny_model

FP8_BOTH = dict(quantization="fp8", kv_cache_dtype="fp8")
MAX_TOKENS = 12
PREFIX = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"
SHARED = [PREFIX + s for s in (" with", ". One day", " and")] + PROMPTS[1:3]


@pytest.fixture(autouse=True)
def fp8_on_cpu(allow_fp8_on_cpu, allow_fp8_kv_cache_on_cpu):
    pass


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kw)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def fp8_llm(model=STORIES, **kw):
    kw.setdefault("max_model_len", 128)
    llm = cached_llm(model, **FP8_BOTH, **kw)
    runner = llm.engine.worker.runner
    assert runner.cache.gpu.dtype == FP8 and any(getattr(m, "fp8", None) for m in runner.model.modules())
    return llm


def test_prefix_hits_give_the_misses_tokens():
    off = tokens(fp8_llm(enable_prefix_caching=False, block_size=4).generate(SHARED, greedy(), use_tqdm=False))
    llm = fp8_llm(enable_prefix_caching=True, block_size=4)
    first = tokens(llm.generate(SHARED, greedy(), use_tqdm=False))
    hits = llm.engine.scheduler.kv.pool.stats.hits
    second = tokens(llm.generate(SHARED, greedy(), use_tqdm=False))
    assert llm.engine.scheduler.kv.pool.stats.hits > hits
    assert first == second == off


@contextlib.contextmanager
def swaps_checked(cache):
    """Within the block, every block the cache swaps in must hold the bytes it held when swapped out."""
    held, counts = {}, [0, 0]
    swap_out, swap_in = cache.swap_out, cache.swap_in
    raw = lambda pool, b: pool[:, :, b].view(torch.uint8).clone()  # noqa: E731

    def checked_out(pairs):
        swap_out(pairs)
        held.update({cpu: raw(cache.gpu, gpu) for gpu, cpu in pairs})
        counts[0] += len(pairs)

    def checked_in(pairs):
        swap_in(pairs)
        for cpu, gpu in pairs:
            assert torch.equal(raw(cache.gpu, gpu), held.pop(cpu)), f"block {cpu} came back changed"
        counts[1] += len(pairs)

    cache.swap_out, cache.swap_in = checked_out, checked_in
    try:
        yield counts
    finally:
        del cache.swap_out, cache.swap_in


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("spec", [{}, dict(speculative_model=DRAFT, num_speculative_tokens=3)],
                         ids=["plain", "draft"])
def test_preempted_requests_give_the_unpreempted_tokens(mode, spec):
    """Swapped e4m3 blocks come back byte for byte (with a draft, its 16/32-bit cache swaps beside them)."""
    want = tokens(fp8_llm(block_size=4).generate(SHARED, greedy(24), use_tqdm=False))
    llm = fp8_llm(block_size=4, num_gpu_blocks=40, preemption_mode=mode,
                  num_cpu_blocks=64 if mode == "swap" else None, enable_prefix_caching=False, **spec)
    before = llm.engine.scheduler.num_preemptions
    with contextlib.ExitStack() as stack:
        counts = [stack.enter_context(swaps_checked(c)) for c in llm.engine.worker.runner.caches]
        got = tokens(llm.generate(SHARED, greedy(24), use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > before, "the pool was meant to be too small"
    assert all((c[0] > 0 and c[1] == c[0]) if mode == "swap" else c == [0, 0] for c in counts), counts
    assert got == want


@pytest.mark.parametrize("spec", [dict(speculative_model=DRAFT, num_speculative_tokens=3),
                                  dict(speculative_config={"model": DRAFT, "num_speculative_tokens": 3,
                                                           "quantization": "fp8"}),
                                  dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})],
                         ids=["draft", "draft-fp8", "ngram"])
def test_speculative_decoding_gives_the_targets_tokens(spec):
    """The draft's cache stays 16/32-bit; its weights too unless speculative_config's quantization says FP8."""
    prompts = SHARED + ["Tom had a dog. Tom had a dog. Tom had a"]
    want = tokens(fp8_llm().generate(prompts, greedy(16), use_tqdm=False))
    llm = fp8_llm(**spec)
    runner = llm.engine.worker.runner
    if runner.drafter is not None:
        assert runner.drafter.cache.gpu.dtype == runner.dtype
        fp8_draft = "quantization" in spec.get("speculative_config", {})
        assert any(getattr(m, "fp8", None) for m in runner.drafter.model.modules()) == fp8_draft
    stats = llm.engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    assert tokens(llm.generate(prompts, greedy(16), use_tqdm=False)) == want
    assert stats.num_accepted_tokens > before  # drafts were verified against the FP8 cache, and kept


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_quantized_activations_are_what_each_projection_would_quantize(arch, tmp_path_factory):
    """The norms and SiLU-and-mul quantize for qkv (Qwen2's with its bias), gate_up and down
    (QuantizedActivation): the tokens and logprobs, bitwise, of each projection quantizing its own input."""
    # no prefix cache: the second run must compute the same batches (the CPU's sums depend on their shapes)
    llm = fp8_llm(make_tiny_model(tmp_path_factory, arch), block_size=4, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23)]
    ahead = [m for m in llm.engine.worker.runner.model.modules() if getattr(m, "quantize_output", False)]
    assert len(ahead) == 3 * llm.engine.worker.runner.model.args.num_layers  # two norms and SiLU-and-mul a layer

    def run():
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in llm.generate(prompts, greedy(12, logprobs=2), use_tqdm=False)]
    fused = run()
    try:
        for m in ahead:
            m.quantize_output = False
        assert run() == fused
    finally:
        for m in ahead:
            m.quantize_output = True


def test_compiled_forward_gives_the_eager_tokens(tmp_path, monkeypatch):
    """torch.compile (compile_on_cpu) traces the FP8 linear and the e4m3 cache's attention ops, the KV
    scales constants of the graph, and the norms' and SiLU-and-mul's quantized outputs (QuantizedActivation)
    into the projections after them: one graph, no breaks. Inductor meets no fastllm op it has not been
    told of (backend.register_fallback_kernels): on torch 2.11 the first meeting formats the op's arguments,
    and the plain final norm's spell out every layer above it, twice over per layer."""
    want = tokens(fp8_llm().generate(PROMPTS, greedy(), use_tqdm=False))
    monkeypatch.setenv("FASTLLM_CACHE_DIR", str(tmp_path))  # a cold cache: this process traces
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    implicit = []
    log_info = inductor_graph.log.info
    monkeypatch.setattr(inductor_graph.log, "info", lambda msg, *args, **kw: (
        implicit.append(msg) if "implicit fallback" in msg else log_info(msg, *args, **kw)))
    with fastllm_ops_unknown_to_inductor():
        llm = fp8_llm(**({"compile_on_cpu": True} if TEST_DEVICE == "cpu" else {}))  # (a GPU compiles anyway)
    assert not implicit, f"{len(implicit)} ops met without a fallback kernel registered"
    assert llm.engine.worker.runner.compile_how is not None
    assert tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == want
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0, \
        dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])


@contextlib.contextmanager
def fastllm_ops_unknown_to_inductor():
    """Inductor's lowerings as in a fresh process: without the fastllm ops earlier compiles registered."""
    ours = {op: fn for op, fn in inductor_lowering.lowerings.items() if getattr(op, "namespace", None) == "fastllm"}
    for op in ours:
        del inductor_lowering.lowerings[op]
    try:
        yield
    finally:
        inductor_lowering.lowerings.update(ours)


def test_cascade_attention_gives_the_plain_paths_tokens():
    off = tokens(fp8_llm(cascade_attention=False, block_size=4).generate(SHARED, greedy(), use_tqdm=False))
    llm = fp8_llm(cascade_attention=True, block_size=4)
    runner, cascaded = llm.engine.worker.runner, []
    plan = runner.cascade.plan
    runner.cascade.plan = lambda *a: cascaded.append(plan(*a)) or cascaded[-1]
    try:
        llm.generate(SHARED, greedy(), use_tqdm=False)
        on = tokens(llm.generate(SHARED, greedy(), use_tqdm=False))
    finally:
        del runner.cascade.plan
    assert any(p is not None for p in cascaded), "no step cascaded"
    assert on == off


def scored_from_scratch(llm, prompt_ids: list[int], generated: list[int]) -> float:
    """The model's summed logprob of `generated` after the prompt, teacher-forced in one prefill."""
    out = llm.generate({"prompt_token_ids": prompt_ids + generated}, greedy(1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return sum(out.prompt_logprobs[len(prompt_ids) + i][t].logprob for i, t in enumerate(generated))


def test_n_siblings_share_the_prompts_blocks():
    want = tokens(fp8_llm(enable_prefix_caching=False, block_size=4).generate(SHARED[3:], greedy(),
                                                                              use_tqdm=False))
    llm = fp8_llm(enable_prefix_caching=False, block_size=4)
    got = tokens(llm.generate(SHARED[3:], greedy(n=3), use_tqdm=False))
    assert got == [w * 3 for w in want]


def test_beam_search_scores_what_the_model_scores_from_scratch():
    """The beams fork each step (copy-on-write of the last e4m3 block); each beam's cumulative logprob is
    what a fresh prefill of its tokens gives (no block shared)."""
    llm = fp8_llm(block_size=4)
    prompts = SHARED[3:]
    outs = llm.beam_search(prompts, BeamSearchParams(3, max_tokens=8, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        prompt_ids = llm.get_tokenizer()(prompt)["input_ids"]
        assert len(out.sequences) == 3 and len({tuple(s.tokens) for s in out.sequences}) == 3
        for s in out.sequences:
            generated = s.tokens[len(prompt_ids):]
            assert s.cum_logprob == pytest.approx(scored_from_scratch(llm, prompt_ids, generated), abs=1e-4)


@pytest.mark.parametrize("eos", [None, 426])
def test_run_ahead_beam_steps_equal_the_synchronous_path(eos, monkeypatch):
    """Run-ahead beam steps (worker/beam_slots.py) copy each slot's partial e4m3 block from its parent on the device
    (CacheEngine.copy_indexed): the beams and scores of the synchronous path (async_scheduling=False), to the bit,
    and a lost copy is caught."""
    from fastllm.worker.cache_engine import CacheEngine

    params = BeamSearchParams(3, max_tokens=10, ignore_eos=eos is None)
    results = []
    # (no prefix cache: a prompt an earlier test computed would be a hit on one engine only, rounded otherwise)
    for llm in (fp8_llm(block_size=4, enable_prefix_caching=False, beam_run_ahead=True),
                fp8_llm(block_size=4, enable_prefix_caching=False, beam_run_ahead=True, async_scheduling=False)):
        monkeypatch.setattr(llm.engine, "eos_token_id", eos)
        steps = llm.engine.scheduler.num_run_ahead_steps
        results.append([[(s.tokens, s.score) for s in o.sequences] for o in llm.beam_search(SHARED[3], params)])
        llm.engine.check_kv_pool_whole()
        assert (llm.engine.scheduler.num_run_ahead_steps > steps) == llm.engine.config.scheduler.async_scheduling
    assert results[0] == results[1]
    monkeypatch.setattr(CacheEngine, "copy_indexed", lambda self, src, dst: None)
    lost = fp8_llm(block_size=4, enable_prefix_caching=False, beam_run_ahead=True).beam_search(SHARED[3], params)
    assert [[(s.tokens, s.score) for s in o.sequences] for o in lost] != results[0]
    fp8_llm(block_size=4, enable_prefix_caching=False, beam_run_ahead=True).engine.check_kv_pool_whole()


@pytest.mark.parametrize("arch", ["mistral-window", "qwen3"])
def test_sliding_window_and_qk_norm_models_chunked_and_whole(arch, tmp_path_factory):
    """Mistral's window (decoded past it) and Qwen3's q/k norms with FP8 weights and cache: chunked prefill
    and prefix hits give the tokens of whole prompts."""
    model = make_tiny_model(tmp_path_factory, arch)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (5, 23, 40)]
    whole = tokens(fp8_llm(model, block_size=4, enable_prefix_caching=False).generate(prompts, greedy(24),
                                                                                      use_tqdm=False))
    llm = fp8_llm(model, block_size=4, max_num_batched_tokens=8)
    for _ in range(2):  # the second round hits the prefix cache
        assert tokens(llm.generate(prompts, greedy(24), use_tqdm=False)) == whole


# GPU (sm_89+): the compiled engine with CUDA graphs (decode, mixed, speculative and cascade graphs) against
# the eager engine, FP8 weights and cache on both sides, llama2xs-279K as the target (its projections run
# torch._scaled_mm, stories260K's 172-wide MLP would take the reference). The two sides run the same
# kernels in batches of other sizes (graphs pad them), so an e4m3 rounding may go the other way now and
# then: tokens are held equal until the eager run's top-2 margin is within twice the rounding bound of
# test_gpu_fp8.py (each side's logprobs may move by it), and most tokens must be compared.
GPU_MARGIN = 2 * MAX_LOGPROB_ERR
GPU_FEATURES = {
    "cascade": dict(cascade_attention=True, block_size=4),
    "draft": dict(speculative_model=STORIES, num_speculative_tokens=3),
    # adaptive=False: every step speculates (the policy stops proposing where the tiny pair or the prompts'
    # few n-gram matches would not pay, and then the graphs' speculative steps go untested)
    "draft-fp8": dict(speculative_config={"model": STORIES, "num_speculative_tokens": 3,
                                          "quantization": "fp8", "adaptive": False}),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}),
    # 24 blocks of 4 hold fewer than the ~34 blocks the five requests reach even with their shared prefix
    "swap": dict(num_gpu_blocks=24, block_size=4, max_model_len=64, preemption_mode="swap", num_cpu_blocks=64),
    "beam": dict(block_size=4),
    "qwen3": dict(block_size=4, max_num_batched_tokens=16),  # q/k norms in the rotary kernels; chunked
    "mistral-window": dict(block_size=4, max_num_batched_tokens=16),  # decoded past its window of 16
}


def agree_until_near_ties(want, got: list[list[int]]) -> int:
    """Tokens of `got` equal to the reference outputs `want` (with logprobs) until they part, which they may
    only where the reference's top-2 margin is within GPU_MARGIN (test_gpu_fp8.compare_greedy's rule);
    returns how many were equal before that."""
    compared = 0
    for w, g in zip(want, got):
        w = w.outputs[0]
        for i, token in enumerate(w.token_ids):
            if g[i] != token:
                top = sorted((lp.logprob for lp in w.logprobs[i].values()), reverse=True)
                assert top[0] - top[1] <= GPU_MARGIN, f"token {i}: {g} against {w.token_ids}, margin {top[0] - top[1]}"
                break
            compared += 1
    return compared


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("feature", list(GPU_FEATURES))
def test_gpu_graphs_equal_eager(feature, tmp_path_factory):
    model = make_tiny_model(tmp_path_factory, feature) if feature in ("qwen3", "mistral-window") else DRAFT
    extra = GPU_FEATURES[feature]
    speculates = any("speculative" in k for k in extra)
    repeats = ["Tom had a dog. Tom had a dog. Tom had a"] if speculates else []  # n-grams to look up
    prompts = [{"prompt_token_ids": ids} for ids in tokenize(SHARED + repeats)]
    kw = dict(device="cuda", dtype="float32", max_model_len=128, num_gpu_blocks=2048, **FP8_BOTH)
    plain = {k: v for k, v in extra.items() if "speculative" not in k}
    eager = cached_llm(model, enforce_eager=True, **{**kw, **plain})
    llm = cached_llm(model, **{**kw, **extra})
    runner = llm.engine.worker.runner
    assert runner.graphs is not None and runner.cache.gpu.dtype == FP8
    if feature == "beam":
        params = BeamSearchParams(3, max_tokens=12, ignore_eos=True)
        want, got = (e.beam_search(prompts, params) for e in (eager, llm))
        for w, g in zip(want, got):  # the best beam, unless the eager run's best two are a near-tie
            if g.sequences[0].tokens != w.sequences[0].tokens:
                assert w.sequences[0].score - w.sequences[1].score <= GPU_MARGIN
            assert g.sequences[0].score == pytest.approx(w.sequences[0].score, abs=GPU_MARGIN)
        return
    want = eager.generate(prompts, greedy(16, logprobs=2), use_tqdm=False)
    # Requests with logprobs speculate on the eager path: the speculative engines' tokens only (graphs).
    params = greedy(16) if speculates else greedy(16, logprobs=2)
    llm.generate(prompts, params, use_tqdm=False)  # the second round hits the prefix cache (cascade groups)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    compared = agree_until_near_ties(want, got)
    print(f"\n{feature}: {compared} tokens equal before a near-tie")
    assert compared >= 0.5 * len(SHARED) * 16
    if speculates:
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    if feature == "swap":
        assert llm.engine.scheduler.num_preemptions > 0


def test_what_fp8_settings_leave_alone_is_said(caplog, tmp_path):
    """The draft model keeps 16/32-bit weights and cache under an FP8 target, and a checkpoint's KV scales
    do nothing with a 16/32-bit cache: both said in the log, not silent."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fastllm import LLM

    shutil.copytree(STORIES, tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    tensors["model.layers.0.self_attn.kv_scale"] = torch.tensor(0.5)
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    small = dict(device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks=40)
    with caplog.at_level("INFO", logger="fastllm"):
        LLM(str(tmp_path / "ckpt"), **small)
        assert "FP8 KV-cache scales apply with kv_cache_dtype='fp8' only" in caplog.text
        LLM(STORIES, speculative_model=DRAFT, num_speculative_tokens=2, **FP8_BOTH, **small)
        assert "apply to the target only; the draft's KV cache is torch.float32" in caplog.text
