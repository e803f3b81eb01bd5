"""Shared helpers for the kernel tests: marks, error metrics, poisoned paged-KV setups, the oracle."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fastllm.kernels import reference_impl

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def gpu(fn):
    """Decorator for the full-size matrix: marked `gpu`, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn))


# bf16 is GPU-only under the triton 3.x interpreter: tl.dot on bf16 operands returns garbage there, and
# fp32 -> bf16 casts truncate instead of rounding to nearest even (the GPU rounds). bf16 loads and
# stores are fine, so a pure copy (kv_cache_write) still tests bf16 on CPU.
BF16 = pytest.param(
    torch.bfloat16,
    marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRET, reason="interpreter: bf16 dot/casts are wrong")],
    id="bfloat16",
)


def triton_on_cpu(monkeypatch, names) -> set[str]:
    """The engine's ops `names` through their Triton kernels on CPU tensors (the interpreter) in place of
    their references, for this test. Returns the set each op adds its name to when called."""
    from fastllm.kernels import dispatch

    called: set[str] = set()
    for name in names:
        kernel = dispatch.triton_impl(name)

        def traced(*args, _kernel=kernel, _name=name):
            called.add(_name)
            return _kernel(*args)
        monkeypatch.setitem(dispatch._chosen, (name, "cpu"), traced)
    return called


def record_launches(monkeypatch) -> list[tuple[int, bool]]:
    """(prologue kind: skinny_linear.PLAIN or ADD_RMS_NORM, gated) of every skinny_linear launch of this
    test, in order."""
    from fastllm.kernels import skinny_linear

    kinds: list[tuple[int, bool]] = []
    launch = skinny_linear.launch

    def recorded(*args, **kwargs):
        kinds.append((kwargs.get("prologue", skinny_linear.Prologue()).kind, kwargs.get("gated", False)))
        return launch(*args, **kwargs)
    monkeypatch.setattr(skinny_linear, "launch", recorded)
    return kinds


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def max_abs(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if ref.numel() else 0.0


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float, abs_: float, what: str = "") -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten or read poison?)"
    err, mx = rel_err(out, ref), max_abs(out, ref)
    assert err <= rel and mx <= abs_, f"{what}: rel err {err:.3g} (tol {rel:g}), max abs {mx:.3g} ({abs_:g})"


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, what: str = "lse") -> None:
    """Log-sum-exps agree: -inf (a row with no key) exactly where the reference has it, else within 1e-4
    (base-2 logs of O(1)-O(10) sums: an absolute tolerance)."""
    assert lse.shape == ref.shape and lse.dtype == torch.float32, (lse.shape, ref.shape, lse.dtype)
    empty = ref == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), f"{what}: -inf at other rows than the reference's"
    assert torch.isfinite(lse[~empty]).all(), f"{what}: non-finite"
    assert max_abs(lse[~empty], ref[~empty]) <= 1e-4, f"{what}: max abs err {max_abs(lse[~empty], ref[~empty]):.3g}"


def bucket_edges(bucket: int) -> list[int]:
    """The smallest and largest row count of a skinny_linear config table's row bucket."""
    from fastllm.kernels import skinny_linear

    buckets = [1, 8, 16, 32, 64]
    assert buckets[-1] == skinny_linear.MAX_ROWS and all(skinny_linear.row_bucket(b) == b for b in buckets)
    below = buckets[buckets.index(bucket) - 1] if bucket > 1 else 0
    return sorted({below + 1, bucket})


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKV:
    """A NaN-poisoned paged cache with `seq_lens` random tokens per request behind permuted block tables.

    Every slot that no request owns stays NaN, and block-table entries past a request's last block point
    at an all-NaN block: a kernel that reads outside [0, seq_len) (or forgets to zero masked V rows)
    produces NaN instead of passing by luck.
    """

    def __init__(self, seq_lens, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen,
                 extra_table_cols: int = 1):
        self.seq_lens_list = list(seq_lens)
        self.block_size = block_size
        need = [cdiv(n, block_size) for n in self.seq_lens_list]
        assert sum(need) + 1 <= num_blocks, "not enough blocks"
        # permuted ids drawn from the whole range, so high block ids (int64 offsets) get exercised
        perm = torch.randperm(num_blocks, generator=gen)[: sum(need) + 1]
        self.poison_block = int(perm[0])
        ids = perm[1:].tolist()
        width = max(need + [0]) + extra_table_cols
        table = torch.full((len(need), width), self.poison_block, dtype=torch.int32)
        slots = [torch.zeros(0, dtype=torch.long)]
        for i, (n, length) in enumerate(zip(need, self.seq_lens_list)):
            row, ids = torch.tensor(ids[:n], dtype=torch.long), ids[n:]
            table[i, :n] = row.int()
            t = torch.arange(length)
            slots.append(row[t // block_size] * block_size + t % block_size)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        slot_t = torch.cat(slots).to(device)
        for cache in (self.key_cache, self.value_cache):  # values from the seeded global generator
            vals = torch.randn(len(slot_t), num_kv_heads, head_dim, device=device).to(dtype)
            cache.view(-1, num_kv_heads, head_dim)[slot_t] = vals
        self.block_tables = table.to(device)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=device)

    def chunk_slots(self, q_lens) -> torch.Tensor:
        """The flat cache slots of each request's last q_len tokens, in query-row order."""
        slots = [torch.zeros(0, dtype=torch.long)]
        for i, (q, length) in enumerate(zip(q_lens, self.seq_lens_list)):
            pos = torch.arange(length - q, length)
            blocks = self.block_tables[i].cpu().long()[pos // self.block_size]
            slots.append(blocks * self.block_size + pos % self.block_size)
        return torch.cat(slots).to(self.key_cache.device)

    def chunk_rows(self, q_lens, pad_tokens: int = 0, width: int | None = None):
        """(key, value) [sum(q_lens) + pad_tokens, Hkv, D]: each request's last q_len tokens as the cache holds
        them (the rows a step has just written), then NaN padding rows that belong to no request. With
        width, each is a strided slice of a [T, width, D] buffer, like k and v inside a fused qkv output."""
        hkv, d = self.key_cache.shape[2:]
        slot_t = self.chunk_slots(q_lens)
        total = len(slot_t)
        out = []
        for cache in (self.key_cache, self.value_cache):
            buf = torch.full((total + pad_tokens, width or hkv, d), float("nan"), dtype=cache.dtype,
                             device=cache.device)
            rows = buf[:, 1 : hkv + 1] if width else buf
            rows[:total] = cache.view(-1, hkv, d)[slot_t]
            out.append(rows)
        return tuple(out)

    def compact_float(self):
        """(key_cache, value_cache, block_tables): float32, only the used blocks (a small oracle input)."""
        blocks, rows = [], []
        width = self.block_tables.shape[1]
        for i, length in enumerate(self.seq_lens_list):
            n = cdiv(length, self.block_size)
            rows.append(list(range(len(blocks), len(blocks) + n)) + [0] * (width - n))
            blocks += self.block_tables[i, :n].tolist()
        idx = torch.tensor(blocks or [0], dtype=torch.long, device=self.key_cache.device)
        table = torch.tensor(rows, dtype=torch.int32, device=self.key_cache.device).view(len(rows), width)
        return self.key_cache[idx].float(), self.value_cache[idx].float(), table


def attention_oracle(query: torch.Tensor, kv: PagedKV, query_start_loc: torch.Tensor) -> torch.Tensor:
    """reference.prefill_attention on float32 inputs (the reference twin, upcast), over the compact cache."""
    k, v, table = kv.compact_float()
    scale = query.shape[-1] ** -0.5
    q = query.float()
    max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if query_start_loc.numel() > 1 else 0
    key, value = kv.chunk_rows((query_start_loc[1:] - query_start_loc[:-1]).tolist())
    return reference_impl("prefill_attention")(q, key.float(), value.float(), k, v, table, kv.seq_lens,
                                               query_start_loc, max_q, scale)


def decode_oracle(query: torch.Tensor, kv: PagedKV, max_seq_len: int) -> torch.Tensor:
    """reference.paged_decode_attention on float32 inputs over the compact cache."""
    k, v, table = kv.compact_float()
    scale = query.shape[-1] ** -0.5
    decode = reference_impl("paged_decode_attention")
    return decode(query.float(), k, v, table, kv.seq_lens, max_seq_len, scale)


def compiles_in_a_child(module: str) -> None:
    """Run `python -m module`, which compiles kernels for real GPUs on the CPU and prints "compiled": in a
    child without TRITON_INTERPRET, under which @triton.jit gives interpreted functions that do not compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
