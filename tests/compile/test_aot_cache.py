"""The saved compiled forward: what its file name depends on, and a broken file never stops the
engine (the compile round trip itself is in test_compile.py)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from fastllm.compile import aot_cache
from fastllm.config import EngineConfig
from fastllm.models.loader import load_model


def _model(**kwargs):
    return load_model(EngineConfig.from_kwargs(None, **kwargs).model, torch.device("cpu"))


def test_key_follows_dtype_and_config_not_the_instance():
    cpu = torch.device("cpu")
    a, b = _model(dtype="float32"), _model(dtype="float32")
    assert aot_cache.artifact_key(a, cpu) == aot_cache.artifact_key(b, cpu)
    assert aot_cache.artifact_key(_model(dtype="bfloat16"), cpu) != aot_cache.artifact_key(a, cpu)
    a.args = dataclasses.replace(a.args, rms_norm_eps=a.args.rms_norm_eps * 2)  # any config field counts
    assert aot_cache.artifact_key(a, cpu) != aot_cache.artifact_key(b, cpu)


def test_broken_file_is_logged_and_skipped(tmp_path, caplog):
    path = tmp_path / "forward.bin"
    path.write_bytes(b"not a compiled function")
    ids = torch.zeros(2, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="fastllm.compile.aot_cache"):
        assert aot_cache._load(path, _model(dtype="float32"), (ids, ids.clone())) is None
    assert "could not load the compiled forward" in caplog.text


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, input_ids, positions):
        return self.embed(input_ids) * positions.unsqueeze(1)


def test_a_failing_aot_compile_falls_back_to_torch_compile(monkeypatch, caplog):
    from fastllm.compile import backend

    def broken(*args, **kwargs):
        raise RuntimeError("no AOT here")

    monkeypatch.setattr(aot_cache, "load_or_compile", broken)
    monkeypatch.setattr(aot_cache, "available", lambda: True)
    monkeypatch.delenv("FASTLLM_DISABLE_COMPILE_CACHE", raising=False)
    model = _Tiny()
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="fastllm.compile.backend"):
        ids = torch.tensor([1, 2, 3])
        forward, how = backend.compile_forward(model, backend.mark_tokens_unbacked(ids, ids.clone()))
        out = forward(torch.tensor([4, 5]), torch.tensor([1, 2]))
        want = model(torch.tensor([4, 5]), torch.tensor([1, 2]))
    assert how.startswith("compiled (AOT compile failed: RuntimeError")
    assert "AOT compile failed" in caplog.text
    torch.testing.assert_close(out, want)



class _Projection(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(1, width)

    def __repr__(self) -> str:  # (the key of every width: the guards tell them apart)
        return "_Projection()"

    def forward(self, input_ids, positions):
        return self.proj((input_ids + positions).unsqueeze(1).float())


def test_a_forward_whose_guards_reject_the_model_is_compiled_again_naming_the_guard(tmp_path, caplog):
    """The saved forward, loaded for a model with a wider weight under the same key: the log names the guard
    that failed, and a fresh compile runs."""
    from fastllm.compile.backend import mark_tokens_unbacked

    if not aot_cache.available():
        pytest.skip(f"torch {torch.__version__} has no AOT compile")
    with torch.inference_mode():  # (as the runner compiles: the guards compare dispatch keys)
        ids = torch.tensor([1, 2, 3])
        _, how = aot_cache.load_or_compile(_Projection(4), mark_tokens_unbacked(ids, ids.clone()), tmp_path)
        assert how.startswith("compiled, saved to")
        with caplog.at_level(logging.WARNING, logger="fastllm.compile.aot_cache"):
            forward, how = aot_cache.load_or_compile(_Projection(6), mark_tokens_unbacked(ids, ids.clone()),
                                                     tmp_path)
        assert forward(ids, ids).shape == (3, 6)
    assert how.startswith("compiled, saved to")
    assert "does not fit this model (a guard failed: [" in caplog.text
    assert "expected 4, actual 6" in caplog.text


def test_a_forward_saved_under_another_thread_count_is_not_overwritten_by_a_rejected_load(tmp_path, caplog):
    """Dynamo guards on torch's thread count: a forward saved by a process with one thread (the tests') is
    another file than one saved with two, so neither process rejects and overwrites the other's."""
    from fastllm.compile.backend import mark_tokens_unbacked

    if not aot_cache.available():
        pytest.skip(f"torch {torch.__version__} has no AOT compile")
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="fastllm.compile.aot_cache"):
            ids = torch.tensor([1, 2, 3])
            saved = {}
            for n in (1, 2):
                torch.set_num_threads(n)
                _, how = aot_cache.load_or_compile(_Projection(4), mark_tokens_unbacked(ids, ids.clone()),
                                                   tmp_path)
                assert how.startswith("compiled, saved to"), how
                saved[n] = how.removeprefix("compiled, saved to ")
            torch.set_num_threads(1)
            _, how = aot_cache.load_or_compile(_Projection(4), mark_tokens_unbacked(ids, ids.clone()),
                                               tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert saved[1] != saved[2]
    assert how == f"loaded {saved[1]}"
    assert "does not fit" not in caplog.text


def test_a_saved_forward_loads_without_inductors_compile_workers(tmp_path, monkeypatch):
    """Loading compiles nothing, so it runs with one compile thread: Inductor's first kernel load would
    otherwise start its pool of compile workers (a process per core on a GPU machine, whose shutdown
    delayed every warm `fastllm generate`'s exit by ~1 s). The setting is restored after the load."""
    from torch._inductor import async_compile
    from torch._inductor import config as inductor_config

    from fastllm.compile.backend import mark_tokens_unbacked

    if not aot_cache.available():
        pytest.skip(f"torch {torch.__version__} has no AOT compile")
    # (patch, not monkeypatch: undoing a monkeypatch removes the option from Inductor's config)
    with inductor_config.patch(compile_threads=4), torch.inference_mode():
        ids = torch.tensor([1, 2, 3])
        aot_cache.load_or_compile(_Projection(4), mark_tokens_unbacked(ids, ids.clone()), tmp_path)
        load = torch.compiler.load_compiled_function
        threads_seen = []

        def recording_load(f):
            threads_seen.append(async_compile.get_compile_threads())
            return load(f)
        monkeypatch.setattr(torch.compiler, "load_compiled_function", recording_load)
        _, how = aot_cache.load_or_compile(_Projection(4), mark_tokens_unbacked(ids, ids.clone()), tmp_path)
        assert inductor_config.compile_threads == 4
    assert how.startswith("loaded"), how
    assert threads_seen == [1]
