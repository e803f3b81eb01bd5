"""Shared fixtures: the real tiny models, random tiny configs, engines, and the check that every
engine's KV block pool is whole again after each test."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch

# Triton kernels run through Triton's interpreter where there is no GPU. The variable must be set
# before anything imports triton (torch.compile's Inductor does), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from tests import triton_interpreter_fp8, triton_interpreter_speed
    except ImportError:  # no triton: the references run alone
        pass
    else:
        triton_interpreter_fp8.patch()
        triton_interpreter_speed.patch()

from fastllm import LLM  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "fastllm" / "assets"
STORIES = str(ASSETS / "stories260K")
DRAFT = str(ASSETS / "llama2xs-279K")
# FASTLLM_TEST_DEVICE=cuda reruns the engine tests on a GPU, with the Triton kernels on.
TEST_DEVICE = os.environ.get("FASTLLM_TEST_DEVICE", "cpu")

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to",
    "One day, a big",
    "The sun was",
    "A cat named",
    "Tim had a red",
    "In the park, there was a tree that",
]

_live_engines: list = []


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N shards of the tests (1-based, by test file): a GPU suite split "
                          "into runs that each fit a time limit")


@pytest.hookimpl(trylast=True)  # after -m/-k deselect: shards balance the tests that run
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is not None:
        kept = shard_items(items, shard)
        keep = set(kept)
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def shard_items(items: list, shard: str) -> list:
    """The items of shard K of N: whole test files, dealt in order of their collected items' count so the
    shards hold about as many tests (files keep their engines warm within a shard)."""
    try:
        k, n = (int(part) for part in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard must be K/N with 1 <= K <= N, got {shard!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard must be K/N with 1 <= K <= N, got {shard!r}")
    files: dict[str, int] = {}
    for item in items:
        files[item.nodeid.split("::")[0]] = files.get(item.nodeid.split("::")[0], 0) + 1
    loads, owner = [0] * n, {}
    for path, count in sorted(files.items(), key=lambda kv: (-kv[1], kv[0])):
        owner[path] = min(range(n), key=lambda i: (loads[i], i))
        loads[owner[path]] += count
    return [item for item in items if owner[item.nodeid.split("::")[0]] == k - 1]


@pytest.fixture(autouse=True)
def kv_pool_whole_after_test():
    """Every engine a test touched must have all its KV blocks back when the test ends. (Only those: late in
    a run, the cached engines' checks, every block of each, took ~0.1-0.3 s a test.)"""
    before = [_activity(llm) for llm in _live_engines]
    yield
    for i, llm in enumerate(_live_engines):
        *_, unfinished = now = _activity(llm)
        if (i >= len(before) or now != before[i]) and not unfinished:
            llm.engine.check_kv_pool_whole()


def _activity(llm) -> tuple:
    """What a test that used the engine changed: its steps, free blocks and open requests."""
    engine = llm.engine
    return engine.core.stats.num_steps, engine.core.scheduler.kv.pool.num_free_blocks, \
        engine.has_unfinished_requests()


@pytest.fixture(autouse=True)
def whole_gpu_tests_run_alone(request):
    """Under `pytest -n` on one GPU, a `whole_gpu` test runs with no other GPU test beside it (beside one, an
    8B engine sized to most of the card left kernel tests out of memory); the others share the card."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    from tests.gpu_lock import gpu_lock

    with gpu_lock(exclusive="whole_gpu" in request.keywords):
        yield


@pytest.fixture(autouse=True)
def gpu_memory_returned_after_test(request):
    """A GPU test's freed tensors go back to the device, not to this process's caching allocator: workers
    of `pytest -n` share the GPU, and ones holding earlier tests' 8 GiB caches left another none."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.empty_cache()


_cache: dict = {}


def cached_llm(model: str = STORIES, **kwargs) -> LLM:
    """One LLM per distinct configuration for the whole session (building one costs ~1 s)."""
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", TEST_DEVICE)
    # The session keeps every cached engine: a small KV pool each (thousands of blocks for the tiny
    # models) keeps the whole suite's memory well under CI's (the default 0.25 GiB each did not), and on a
    # GPU leaves room for the next engine (a profiling run would size each to 90% of what is free).
    if kwargs["device"] == "cpu" and "num_gpu_blocks" not in kwargs:
        kwargs.setdefault("cpu_kv_cache_gib", 0.03)
    elif "gpu_memory_utilization" not in kwargs:
        kwargs.setdefault("num_gpu_blocks", 2048)
    key = (model, repr(sorted(kwargs.items())))  # (repr: dict values, e.g. speculative_config)
    if key not in _cache:
        _cache[key] = LLM(model, **kwargs)
        _live_engines.append(_cache[key])
    return _cache[key]


@pytest.fixture
def make_llm():
    return cached_llm


@pytest.fixture
def allow_fp8_on_cpu(monkeypatch):
    """Lift the engine's refusal of FP8 weights on the CPU: the dequantizing reference runs there, which is
    what the GPU computes up to rounding (layers/fp8.py)."""
    from fastllm.layers import fp8

    monkeypatch.setattr(fp8, "check_device", lambda *args: None)


@pytest.fixture
def allow_fp8_kv_cache_on_cpu(monkeypatch):
    """Lift the engine's refusal of an FP8 KV cache (kv_cache_dtype="fp8") on the CPU: the references
    store e4m3 and dequantize as they read, what the GPU kernels compute up to rounding."""
    from fastllm.layers import fp8

    monkeypatch.setattr(fp8, "check_kv_cache_device", lambda device: None)


@contextlib.contextmanager
def python_sigint_handler():
    """SIGINT raising KeyboardInterrupt in this test process, as in a script (a test runner may ignore it)."""
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)


@contextlib.contextmanager
def nth_step_fails(worker, n: int):
    """Within the block, the n-th step with scheduled tokens that `worker` executes raises
    RuntimeError("planted step failure"); yields the scheduler outputs of those steps as they come."""
    execute, calls = worker.execute_model, []

    def execute_model(sched):
        if not sched.is_empty:  # (a run-ahead beam step schedules slots, no request tokens)
            calls.append(sched)
            if len(calls) == n:
                raise RuntimeError("planted step failure")
        return execute(sched)

    worker.execute_model = execute_model
    try:
        yield calls
    finally:
        del worker.execute_model  # the class's method again


def release_cached_engines() -> None:
    """Drop every cached engine (and its GPU memory) before a test that needs the whole device."""
    import gc

    for llm in _live_engines:
        if not llm.engine.has_unfinished_requests():
            llm.engine.check_kv_pool_whole()
    _cache.clear()
    _live_engines.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_hf_cache: dict = {}


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face transformers' greedy continuation (float32, batch of one, no padding)."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _hf_cache:
        _hf_cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = _hf_cache[model_dir]
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len, vocab] of one sequence, teacher-forced."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _hf_cache:
        _hf_cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return _hf_cache[model_dir](torch.tensor([token_ids])).logits[0].float()


BF16_MARGIN = 0.1  # nats: bf16 attention/matmul rounding moves these logits by up to a few hundredths


def assert_same_or_near_tie(got: list[list[int]], want) -> list[int]:
    """Greedy token ids equal to `want`'s (outputs run with logprobs=2), or parting only where `want`'s top-2
    logprobs nearly tie: two bf16 runs that round differently may pick either of two nearly tied tokens.
    Returns how many leading tokens each request has in common."""
    agree = []
    for g, w in zip(got, want, strict=True):
        w = w.outputs[0]
        n = next((i for i, (a, b) in enumerate(zip(g, w.token_ids)) if a != b), None)
        if n is not None:
            top = sorted(w.logprobs[n].values(), key=lambda x: -x.logprob)
            assert top[0].logprob - top[1].logprob < BF16_MARGIN, f"parted at {n} with a clear margin"
        agree.append(len(w.token_ids) if n is None else n)
    return agree


def tokenize(prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    return [tok(p)["input_ids"] for p in prompts]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The test models are tiny: intra-op threads only add overhead and fight over CI's two cores.
torch.set_num_threads(1)
