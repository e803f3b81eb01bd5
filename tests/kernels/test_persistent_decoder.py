"""The persistent decoder kernel (a draft's one-token round in one launch) against the model's own forward:
the final hidden states and the K/V it writes, on tiny random configs of each architecture it takes.

On the CPU the interpreter runs one program, which does every phase's work in order (programs cannot wait for
each other there); on a GPU the one cooperative launch, its programs meeting at the grid barriers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fastllm.config import ModelConfig
from fastllm.models.loader import load_model
from fastllm.kernels import persistent_decoder
from fastllm.spec_decode import draft_decoder
from fastllm.spec_decode.draft_decoder import DraftDecoder
from fastllm.worker.attn_metadata import AttentionMetadata, forward_context
from tests.models.test_llama_vs_hf import make_tiny_model

ARCHS = ["llama3.1", "mistral", "qwen2", "qwen3"]  # the kernel's: no sliding windows
BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=ARCHS)
def tiny_path(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory, request.param)


def round_inputs(model, rows: list[tuple[int, bool]], device, generator):
    """A decode round of len(rows) rows (the kernel's: one), (cached keys, writes its KV) each, over a cache
    of random history: (input_ids, positions, metadata, kv pool)."""
    a = model.args
    num_blocks = 64
    kv = torch.randn(a.num_layers, 2, num_blocks, BLOCK_SIZE, a.num_kv_heads, a.head_dim, generator=generator)
    kv = kv.to(device=device, dtype=model.dtype)
    perm = torch.randperm(num_blocks, generator=generator)
    width = 8
    tables = perm[:len(rows) * width].view(len(rows), width).to(torch.int32)
    positions = torch.tensor([cached for cached, _ in rows])
    blocks = tables.gather(1, (positions // BLOCK_SIZE).view(-1, 1)).view(-1).long()
    writes = torch.tensor([writes for _, writes in rows])
    slots = torch.where(writes, blocks * BLOCK_SIZE + positions % BLOCK_SIZE, -1)
    ids = torch.randint(3, a.vocab_size, (len(rows),), generator=generator)
    metadata = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        seq_lens=(positions + 1).to(torch.int32).to(device),
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device), max_query_len=1,
        max_seq_len=int(positions.max()) + 1)
    return ids.to(device), positions.to(device), metadata, kv


def model_round(model, ids, positions, metadata, kv):
    """The model's own forward over the round (its attention writes into kv)."""
    layers = model.attention_layers()
    for i, layer in enumerate(layers):
        layer.kv_cache = (kv[i, 0], kv[i, 1])
    with torch.inference_mode(), forward_context(metadata, layers):
        return model(ids, positions)


def assert_close(got, expected, tolerance, what):
    """Within tolerance of expected in norm, relative to its norm (bf16: the two paths sum in different
    orders, so values round a bf16 step apart here and there, and that moves what follows a little)."""
    error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert error <= tolerance, f"{what}: relative error {error:.2e} > {tolerance:.0e}"


def check_round(path, device, dtype, rows, tolerance, seed=0):
    model = load_model(ModelConfig(model=path, dtype=dtype), torch.device(device))
    g = torch.Generator().manual_seed(seed)
    ids, positions, metadata, kv = round_inputs(model, rows, device, g)
    decoder = DraftDecoder(model)  # (its stacks leave the model's forward as it was)
    decoder.kv_cache = kv.clone()
    before = kv.clone()
    expected = model_round(model, ids, positions, metadata, kv)
    got = decoder(ids, positions, metadata)
    assert_close(got, expected, tolerance, "final hidden states")
    written = metadata.slot_mapping[metadata.slot_mapping >= 0]
    flat = (model.args.num_layers, 2, -1, model.args.num_kv_heads, model.args.head_dim)
    if written.numel():
        new_kv, got_kv = kv.view(flat)[:, :, written], decoder.kv_cache.view(flat)[:, :, written]
        assert not torch.equal(new_kv, before.view(flat)[:, :, written]), "the model's round wrote no K/V"
        assert_close(got_kv, new_kv, tolerance, "the K/V written")
    unwritten = torch.ones(kv.view(flat).shape[2], dtype=torch.bool, device=kv.device)
    unwritten[written] = False
    assert torch.equal(decoder.kv_cache.view(flat)[:, :, unwritten], before.view(flat)[:, :, unwritten]), \
        "the kernel wrote K/V where it should not (a slot < 0 writes nothing)"
    return decoder


# (cached keys, writes its K/V): a first position, block edges, keys over several splits, a slot < 0 (a CUDA
# graph's warm-up writes nothing)
ROWS = [[(37, True)], [(0, True)], [(16, True)], [(95, True)], [(63, False)]]
ROW_IDS = ["37", "0", "16", "95", "no-write"]


@pytest.mark.parametrize("rows", ROWS, ids=ROW_IDS)
def test_round_equals_the_models_forward(tiny_path, rows):
    check_round(tiny_path, "cpu", "float32", rows, 1e-5)


def test_counters_are_zero_after_a_round(tiny_path):
    decoder = check_round(tiny_path, "cpu", "float32", ROWS[3], 1e-5)
    assert not decoder.scratch.counters.any(), "a split counter was left set: the next round merges too early"


def test_unsupported_models_say_why(tiny_path, tmp_path_factory, monkeypatch):
    model = load_model(ModelConfig(model=tiny_path, dtype="float32"), torch.device("cpu"))
    monkeypatch.delenv("FASTLLM_PERSISTENT_DRAFT", raising=False)
    assert "FASTLLM_PERSISTENT_DRAFT is not 1" in draft_decoder.unsupported(model, torch.device("cuda"))
    monkeypatch.setenv("FASTLLM_PERSISTENT_DRAFT", "yes")
    with pytest.raises(ValueError, match="FASTLLM_PERSISTENT_DRAFT"):
        draft_decoder.unsupported(model, torch.device("cuda"))
    monkeypatch.setenv("FASTLLM_PERSISTENT_DRAFT", "1")
    assert "cpu device" in draft_decoder.unsupported(model, torch.device("cpu"))
    monkeypatch.setattr(persistent_decoder, "grid", lambda device: 132)  # (an H100's SMs, on any machine)
    assert draft_decoder.unsupported(model, torch.device("cuda")) is None
    monkeypatch.setattr(persistent_decoder, "MAX_SHARE_BYTES", 256)
    assert "weight shares of" in draft_decoder.unsupported(model, torch.device("cuda"))
    window_config = ModelConfig(model=make_tiny_model(tmp_path_factory, "mistral-window"), dtype="float32")
    window = load_model(window_config, torch.device("cpu"))
    assert draft_decoder.unsupported(window, torch.device("cuda")) == "sliding windows"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("rows", ROWS, ids=ROW_IDS)
def test_gpu_round_equals_the_models_forward(tiny_path, rows, dtype, tolerance):
    """One cooperative launch, its programs meeting at the grid barriers."""
    check_round(tiny_path, "cuda", dtype, rows, tolerance)


@pytest.mark.parametrize("n_out,programs", [(3072, 132), (4096, 132), (1024, 132), (1024, 114), (192, 1),
                                            (96, 1), (4864, 132), (7, 8)])
def test_shares_cover_every_column_once(n_out, programs):
    """The one-row kernel's programs each own [p n / P, (p + 1) n / P) of a projection's n columns, held as
    two power-of-two pieces: together the shares cover 0 .. n once, and every share fits its pieces."""
    first, second = persistent_decoder.share_pieces(n_out, programs)
    assert first & (first - 1) == 0 and second & (second - 1) == 0
    bounds = [p * n_out // programs for p in range(programs + 1)]
    assert bounds[0] == 0 and bounds[-1] == n_out and bounds == sorted(bounds)
    assert max(hi - lo for lo, hi in zip(bounds, bounds[1:])) <= first + second
    assert first <= -(-n_out // programs)  # (the first piece is never all padding)


def test_the_drafts_shares_fit_its_registers():
    """Qwen3-0.6B, the draft the kernel is for, takes the one-row kernel on an H100 / H200 (132 SMs); the
    same model on 114 SMs (an H100 PCIe) would hold more than the registers do."""
    shape = persistent_decoder.Shape(num_layers=28, hidden=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                                     intermediate=3072, eps=1e-6)
    assert persistent_decoder.held_share_bytes(shape, 132, 2) <= persistent_decoder.MAX_SHARE_BYTES
    assert persistent_decoder.held_share_bytes(shape, 114, 2) > persistent_decoder.MAX_SHARE_BYTES


def test_rounds_compile_for_sm90_without_spills():
    """The GPU's kernel (the interpreter above runs the same code without the barriers): it compiles for
    sm_90 at the draft's shapes, and the weight shares stay in registers (a spill would put every share's
    load through local memory). sm_90 machine code, compiled here."""
    code = ("import json; from fastllm.bench.occupancy import persistent_decoder as p; "
            "print(json.dumps(p()[:2]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (interpreted: no compile)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    registers, spilled = json.loads(out.stdout.splitlines()[-1])
    assert spilled == 0 and registers <= 255, (registers, spilled)
