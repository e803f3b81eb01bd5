"""Each rank's shard of the model is exactly its part of the single-rank model's weights, whatever the
split, for checkpoint and dummy weights; the layer split of pipeline stages; the config errors.

The oracle slices the single-rank model's tensors independently of the loader: q heads and the MLP's
width by rank, KV heads by rank or (fewer heads than ranks) replicated, o/down by input columns, the
vocabulary by rows with zero padding. No processes: loading a shard needs no collective.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.config import EngineConfig
from fastllm.distributed.parallel_state import ParallelRank, stage_layers
from fastllm.models.loader import load_model
from tests.conftest import DRAFT, STORIES
from tests.distributed.conftest import odd_vocab_config

LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2), (8, 1)]


def expected_shard(name: str, full: torch.Tensor, args, rank: ParallelRank) -> torch.Tensor:
    tp, r = rank.tp_size, rank.tp_rank
    hd = args.head_dim
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        q, kv = args.num_heads * hd, args.num_kv_heads * hd
        qs = full[:q].chunk(tp)[r]
        heads_per_rank = max(1, args.num_kv_heads // tp)
        kv_head = r * args.num_kv_heads // tp  # the first KV head this rank holds
        k = full[q:q + kv][kv_head * hd:(kv_head + heads_per_rank) * hd]
        v = full[q + kv:][kv_head * hd:(kv_head + heads_per_rank) * hd]
        return torch.cat([qs, k, v])
    if name.endswith("gate_up_proj.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(tp, dim=1)[r]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = -(-full.shape[0] // tp)
        padded = torch.cat([full, full.new_zeros(rows * tp - full.shape[0], full.shape[1])])
        return padded[r * rows:(r + 1) * rows]
    return full


def shard_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters()]


# (model, tp, pp): tied embeddings (stories260K); KV heads replicated over 8 ranks (llama2xs-279K: 4
# KV heads, width 192); a qkv bias and a vocabulary of 509 that leaves padding on the last rank.
CASES = [("stories260K", 2, 1), ("stories260K", 4, 1), ("stories260K", 1, 2), ("stories260K", 2, 2),
         ("llama2xs-279K", 8, 1), ("llama2xs-279K", 2, 2), ("qwen2-vocab509", 2, 1), ("qwen2-vocab509", 4, 1),
         ("qwen2-vocab509", 2, 3)]
_whole: dict = {}


def whole_model(name: str, tmp_path_factory):
    if name not in _whole:
        if name == "qwen2-vocab509":  # dummy weights: they too must shard like slices of the whole
            path, kwargs = odd_vocab_config(tmp_path_factory), dict(load_format="dummy", seed=7)
        else:
            path, kwargs = (STORIES if name == "stories260K" else DRAFT), {}
        config = EngineConfig.from_kwargs(path, dtype="float32", **kwargs).model
        _whole[name] = config, load_model(config, torch.device("cpu"))
    return _whole[name]


@pytest.mark.parametrize("name,tp,pp", CASES)
def test_every_rank_holds_exactly_its_slice(name, tp, pp, tmp_path_factory):
    config, whole = whole_model(name, tmp_path_factory)
    hf = config.hf_config
    full = dict(whole.named_parameters())
    if "lm_head.weight" not in full:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]  # tied
    covered = set()
    for global_rank in range(tp * pp):
        rank = ParallelRank.of(global_rank, tp, pp)
        shard = load_model(config, torch.device("cpu"), rank)
        layers = stage_layers(hf["num_hidden_layers"], pp, rank.pp_rank)
        assert shard.kv_cache_shape()[0] == len(layers)
        for name, param in shard.named_parameters():
            want = expected_shard(name, full[name], whole.args, rank)
            assert torch.equal(param.detach(), want), f"rank {global_rank}: {name}"
            covered.add(name)
        if rank.is_last_stage and hf.get("tie_word_embeddings"):
            want = expected_shard("lm_head.weight", full["lm_head.weight"], whole.args, rank)
            assert torch.equal(shard.lm_head.weight.detach(), want), f"rank {global_rank}: tied lm_head"
    assert covered | {"lm_head.weight"} >= set(full), "some weights are on no rank"


def test_stage_layers_split_contiguously():
    assert [list(stage_layers(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    for layers in range(1, 12):
        for stages in range(1, layers + 1):
            split = [stage_layers(layers, stages, r) for r in range(stages)]
            assert [i for s in split for i in s] == list(range(layers))
            assert max(map(len, split)) - min(map(len, split)) <= 1


@pytest.mark.parametrize("kwargs,field", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),  # 8 heads
    (dict(tensor_parallel_size=16), "tensor_parallel_size"),  # more ranks than heads
    (dict(tensor_parallel_size=8), "tensor_parallel_size"),  # divides the heads, not the width 172
    (dict(pipeline_parallel_size=6), "pipeline_parallel_size"),  # 5 layers
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(pipeline_parallel_size=2, speculative_model="llama2xs-279K"), "pipeline_parallel_size"),
])
def test_bad_splits_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(None, **kwargs)


def test_more_ranks_than_gpus_is_a_value_error_naming_the_field(monkeypatch):
    from fastllm.worker import executor

    monkeypatch.setattr(executor.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):  # before any process starts
        executor.MultiprocExecutor(EngineConfig.from_kwargs(None, device="cuda", tensor_parallel_size=2))
