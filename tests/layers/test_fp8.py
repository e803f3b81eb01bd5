"""FP8 linear weights (layers/fp8.py, layers/linear.py): the engine argument and its refusals, the
checkpoint schemes, quantization at load time (whole tensors, then sliced per tensor-parallel rank) and
FP8 checkpoints written here in the compressed-tensors and "fp8" layouts from stories260K, which load to
the very weights that quantizing stories260K at load time gives.

The engine refuses FP8 on the CPU; these tests lift that refusal (conftest's allow_fp8_on_cpu) to run the
dequantizing reference, which is what the GPU computes up to rounding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastllm import LLM, SamplingParams
from fastllm.entrypoints.cli import build_parser
from fastllm.kernels import reference
from fastllm.layers import fp8
from fastllm.layers.fp8 import FP8, Fp8Scheme, quantize_weight, scheme_for
from fastllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from tests.conftest import PROMPTS, STORIES, cached_llm

GREEDY = SamplingParams(temperature=0, max_tokens=32)
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def fp8_llm(model=STORIES, **kwargs) -> LLM:
    return cached_llm(model, **kwargs)


def linear_layers(llm: LLM):
    model = llm.engine.worker.runner.model
    for i, layer in enumerate(model.model.layers):
        for name in LINEARS:
            owner = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
            yield f"{i}.{name}", getattr(owner, name)


# the engine argument

def test_quantization_values_and_the_cpu_refusal():
    with pytest.raises(ValueError, match="^quantization must be None or one of"):
        LLM(STORIES, quantization="int8", device="cpu")
    with pytest.raises(ValueError, match="^quantization: FP8 weights need a CUDA GPU of compute capability"):
        LLM(STORIES, quantization="fp8", device="cpu")


def test_cli_flag():
    args = build_parser().parse_args(["generate", "--quantization", "fp8-per-tensor", "hi"])
    assert args.quantization == "fp8-per-tensor"
    assert build_parser().parse_args(["generate", "hi"]).quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantization", "int4", "hi"])
    assert build_parser().parse_args(["generate", "--quantization", "fp8", "--quantize-lm-head", "hi"]) \
        .quantize_lm_head is True
    assert build_parser().parse_args(["generate", "hi"]).quantize_lm_head is False


def test_quantize_lm_head_without_fp8_weights_is_refused():
    """An FP8 lm_head beside 16-bit projections would be an argument that does nothing the user asked."""
    with pytest.raises(ValueError, match="^quantize_lm_head puts lm_head in FP8 beside FP8 linear weights"):
        LLM(STORIES, quantize_lm_head=True, device="cpu")


def test_gpus_below_sm89_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(ValueError, match="^quantization: .* NVIDIA A100 is sm_80"):
        fp8.check_device(torch.device("cuda", 0), Fp8Scheme())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 9))
    fp8.check_device(torch.device("cuda", 0), Fp8Scheme())  # Ada: FP8


# checkpoint schemes

DYNAMIC = {"strategy": "token", "dynamic": True}
STATIC = {"strategy": "tensor", "dynamic": False}


def compressed_tensors(weights="channel", inputs: dict | None = DYNAMIC, **extra):  # noqa: B006 (read only)
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": weights,
                                                "dynamic": False, "symmetric": True}}
    if inputs is not None:
        group["input_activations"] = {"num_bits": 8, "type": "float", "symmetric": True, **inputs}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": group}, "ignore": ["lm_head"], **extra}}


def test_schemes():
    assert scheme_for(None, {}) is None
    assert scheme_for("fp8", {}) == Fp8Scheme()
    assert scheme_for("fp8-per-tensor", {}) == Fp8Scheme(per_tensor=True)
    assert scheme_for(None, compressed_tensors()) == Fp8Scheme(checkpoint="compressed-tensors")
    assert scheme_for("fp8", compressed_tensors("tensor", None)) == Fp8Scheme(checkpoint="compressed-tensors")
    assert scheme_for(None, compressed_tensors("tensor", STATIC)) == \
        Fp8Scheme(static_input=True, checkpoint="compressed-tensors")
    fp8_config = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
    assert scheme_for(None, fp8_config) == Fp8Scheme(static_input=True, checkpoint="fp8")


@pytest.mark.parametrize("config,message", [
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "block-wise"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "mx"}}, "activation_scheme"),
    (compressed_tensors("group"), "weights"),
    (compressed_tensors(inputs={"strategy": "token", "dynamic": False}), "input_activations"),
    (compressed_tensors(kv_cache_scheme={"num_bits": 8, "type": "float"}), "KV cache"),
])
def test_unsupported_checkpoints_are_refused(config, message):
    with pytest.raises(ValueError, match=f"^quantization: .*{message}"):
        scheme_for(None, config)


def test_per_tensor_argument_on_an_fp8_checkpoint_is_refused():
    with pytest.raises(ValueError, match="^quantization: 'fp8-per-tensor' .* FP8 already"):
        scheme_for("fp8-per-tensor", compressed_tensors())


# quantizing weights

@pytest.mark.parametrize("per_tensor", [False, True])
def test_quantize_weight(per_tensor):
    w = torch.randn(40, 64) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different sizes
    q, scale = quantize_weight(w, per_tensor)
    assert q.dtype == FP8 and scale.shape == (40,) and scale.dtype == torch.float32
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1)
    assert torch.equal(scale, (amax / 448).expand(40))
    assert torch.equal(q.float().abs().amax(dim=1) == 448, w.abs().amax(dim=1) == amax)  # amax maps to 448
    dq = q.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits (2^-4 relative) down to 2^-6 x scale, then absolute steps of 2^-9 x scale
    assert ((dq - w).abs() <= torch.maximum(w.abs() * 2**-4, scale[:, None] * 2**-10)).all()


def test_tensor_parallel_shards_hold_the_single_rank_weights():
    """Column-parallel: each rank the rows (and their scales) of the single-rank layer; row-parallel: the
    columns, with the single-rank layer's per-row scales whole. Per tensor: q, k, v each their own scale."""
    torch.manual_seed(0)
    for scheme in (Fp8Scheme(), Fp8Scheme(per_tensor=True)):
        q, k, v = torch.randn(64, 32), torch.randn(16, 32) * 3, torch.randn(16, 32) / 3
        whole = ColumnParallelLinear(32, [64, 16, 16], fp8=scheme)
        for shard, t in enumerate((q, k, v)):
            whole.load_shard("weight", shard, t)
        if scheme.per_tensor:
            for t, rows in zip((q, k, v), (slice(0, 64), slice(64, 80), slice(80, 96))):
                assert torch.equal(whole.weight_scale[rows], (t.abs().amax() / 448).expand(t.shape[0]))
        for rank in range(4):  # 4 ranks: 2 KV heads' slices replicated over pairs of ranks
            part = ColumnParallelLinear(32, [64, 16, 16], tp_rank=rank, tp_size=4, partitions=[4, 2, 2],
                                        fp8=scheme)
            part.load_weight("weight", torch.cat([q, k, v]))  # the fused whole tensor (dummy weights' way)
            kv = torch.arange(8 * (rank // 2), 8 * (rank // 2) + 8)
            rows = torch.cat([torch.arange(16 * rank, 16 * rank + 16), 64 + kv, 80 + kv])
            assert torch.equal(part.weight.view(torch.uint8), whole.weight[rows].view(torch.uint8))
            assert torch.equal(part.weight_scale, whole.weight_scale[rows])
        w = torch.randn(24, 64) * torch.logspace(-2, 1, 64)  # columns of very different sizes
        row_whole = RowParallelLinear(64, 24, fp8=scheme)
        row_whole.load_weight("weight", w)
        for rank in range(2):
            part = RowParallelLinear(64, 24, tp_rank=rank, tp_size=2, fp8=scheme)
            part.load_weight("weight", w)
            assert torch.equal(part.weight_scale, row_whole.weight_scale)
            columns = row_whole.weight[:, 32 * rank:32 * rank + 32]
            assert torch.equal(part.weight.view(torch.uint8), columns.view(torch.uint8))


def test_a_layer_runs_the_reference():
    layer = RowParallelLinear(64, 24, bias=True, fp8=Fp8Scheme())
    w, b = torch.randn(24, 64), torch.randn(24)
    layer.load_weight("weight", w)
    layer.load_weight("bias", b)
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), reference.fp8_linear(x, layer.weight, layer.weight_scale, b))


# engines: dummy weights and FP8 checkpoints

def test_dummy_fp8_weights_are_the_16bit_dummy_weights_quantized(allow_fp8_on_cpu):
    base = fp8_llm(load_format="dummy")
    for scheme, quantization in ((Fp8Scheme(), "fp8"), (Fp8Scheme(per_tensor=True), "fp8-per-tensor")):
        quantized = fp8_llm(load_format="dummy", quantization=quantization)
        for (name, layer), (_, ref) in zip(linear_layers(quantized), linear_layers(base)):
            assert layer.weight.dtype == FP8 and ref.weight.dtype == torch.float32
            want = ref_quantized(ref, scheme.per_tensor)
            assert torch.equal(layer.weight.view(torch.uint8), want[0].view(torch.uint8)), name
            assert torch.equal(layer.weight_scale, want[1]), name
        model = quantized.engine.worker.runner.model
        assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
        assert model.model.norm.weight.dtype == torch.float32


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_fp8_lm_head_of_tied_embeddings_is_the_table_quantized(allow_fp8_on_cpu, load_format):
    """quantize_lm_head with tied embeddings (stories260K): the embedding stays 32-bit, lm_head holds the
    table in e4m3 with a scale per vocabulary row, and its logits are the reference's FP8 product."""
    base = fp8_llm(load_format=load_format, quantization="fp8").engine.worker.runner.model
    model = fp8_llm(load_format=load_format, quantization="fp8", quantize_lm_head=True).engine.worker.runner.model
    assert base.lm_head.weight is base.model.embed_tokens.weight  # shared without the flag
    table = model.model.embed_tokens.weight
    assert model.lm_head.weight is not table and table.dtype == torch.float32
    assert torch.equal(table, base.model.embed_tokens.weight)
    want_weight, want_scale = quantize_weight(table.detach(), per_tensor=False)
    assert torch.equal(model.lm_head.weight.view(torch.uint8), want_weight.view(torch.uint8))
    assert torch.equal(model.lm_head.weight_scale, want_scale)
    hidden = torch.randn(3, table.shape[1])
    assert torch.equal(model.compute_logits(hidden), reference.fp8_linear(hidden, want_weight, want_scale, None))


def test_fp8_lm_head_of_an_untied_checkpoint(allow_fp8_on_cpu, tmp_path_factory):
    from tests.models.test_llama_vs_hf import make_tiny_model

    path = make_tiny_model(tmp_path_factory, "llama3.1")  # untied
    base = fp8_llm(path, quantization="fp8").engine.worker.runner.model
    model = fp8_llm(path, quantization="fp8", quantize_lm_head=True).engine.worker.runner.model
    want_weight, want_scale = quantize_weight(base.lm_head.weight.detach(), per_tensor=False)
    assert torch.equal(model.lm_head.weight.view(torch.uint8), want_weight.view(torch.uint8))
    assert torch.equal(model.lm_head.weight_scale, want_scale)
    assert "lm_head in e4m3 too" in model.args.fp8.describe()


def test_fp8_lm_head_splits_by_vocabulary_rows():
    """Tensor parallelism: each rank's rows and their scales are the one-rank head's (a scale per row)."""
    from fastllm.layers.embedding import ParallelLMHead

    table = torch.randn(11, 32)
    whole = ParallelLMHead(11, 32, fp8=True)
    whole.load_weight("weight", table)
    ranks = [ParallelLMHead(11, 32, rank, 2, fp8=True) for rank in range(2)]
    for head in ranks:
        head.load_weight("weight", table)
    assert ranks[1].num_real == 5  # 6 rows a rank, the last one padding
    assert torch.equal(torch.cat([ranks[0].weight, ranks[1].weight[:5]]).view(torch.uint8),
                       whole.weight.view(torch.uint8))
    assert torch.equal(torch.cat([ranks[0].weight_scale, ranks[1].weight_scale[:5]]), whole.weight_scale)
    assert ranks[1].weight_scale[5] == 1.0 and not ranks[1].weight[5].float().any()
    with pytest.raises(ValueError, match="stored in FP8"):
        whole.load_weight("weight", table.to(FP8))


def ref_quantized(layer, per_tensor: bool):
    """The single-rank layer's 16/32-bit weight quantized block by block (q/k/v, gate/up apart)."""
    sizes = getattr(layer, "full_sizes", [layer.weight.shape[0]])
    parts = [quantize_weight(block, per_tensor) for block in layer.weight.split(sizes)]
    return torch.cat([p[0].view(torch.uint8) for p in parts]).view(FP8), torch.cat([p[1] for p in parts])


def write_fp8_checkpoint(path: Path, layout: str, per_tensor: bool, static_input: bool) -> Path:
    """stories260K with its linear weights in e4m3 (each checkpoint tensor as quantize_weight gives it),
    weight_scale a scalar (per tensor) or [N, 1] (per channel), and input_scale where static."""
    shutil.copytree(STORIES, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w, scale = quantize_weight(tensors[name].float(), per_tensor)
        tensors[name] = w
        tensors[name + "_scale"] = scale[:1].reshape(()) if per_tensor else scale[:, None]
        if static_input:
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor(0.02 + len(name) * 1e-3)
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    if layout == "compressed-tensors":
        inputs = STATIC if static_input else DYNAMIC
        config.update(compressed_tensors("tensor" if per_tensor else "channel", inputs))
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if static_input
                                         else "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("layout,per_tensor", [("compressed-tensors", False), ("compressed-tensors", True),
                                               ("fp8", True)])
def test_fp8_checkpoints_load_the_weights_quantizing_at_load_time_gives(tmp_path, allow_fp8_on_cpu, layout,
                                                                        per_tensor):
    path = write_fp8_checkpoint(tmp_path / "ckpt", layout, per_tensor, static_input=False)
    loaded = fp8_llm(str(path))  # quantization=None: the checkpoint says FP8
    online = fp8_llm(quantization="fp8-per-tensor" if per_tensor else "fp8")
    for (name, layer), (_, ref) in zip(linear_layers(loaded), linear_layers(online)):
        assert layer.fp8 == Fp8Scheme(checkpoint=layout)
        assert torch.equal(layer.weight.view(torch.uint8), ref.weight.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, ref.weight_scale), name
    want = [o.outputs[0].token_ids for o in online.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in loaded.generate(PROMPTS, GREEDY, use_tqdm=False)] == want


def test_static_input_scales(tmp_path, allow_fp8_on_cpu):
    """q/k/v (and gate/up) each carry an input_scale of the same input: the fused layer takes the largest."""
    path = write_fp8_checkpoint(tmp_path / "ckpt", "compressed-tensors", False, static_input=True)
    llm = fp8_llm(str(path))
    tensors = load_file(str(path / "model.safetensors"))
    for name, layer in linear_layers(llm):
        i, proj = name.split(".")
        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        parts = fused.get(proj, (proj,))
        owner = "self_attn" if proj in ("qkv_proj", "o_proj") else "mlp"
        want = max(tensors[f"model.layers.{i}.{owner}.{p}.input_scale"] for p in parts)
        assert layer.input_scale == want, name
    # each projection quantizes its own input with its scale: no kernel before it quantizes for it
    assert not any(getattr(m, "quantize_output", False) for m in llm.engine.worker.runner.model.modules())
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # runs, on the static scales
    assert all(len(o.outputs[0].token_ids) > 0 for o in outputs)


def test_broken_fp8_checkpoints(tmp_path, allow_fp8_on_cpu):
    path = write_fp8_checkpoint(tmp_path / "missing", "compressed-tensors", False, static_input=False)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight_scale"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 FP8 scales, e.g. \['model.layers.2.mlp.gate_up_proj"):
        LLM(str(path), device="cpu", dtype="float32", cpu_kv_cache_gib=0.01)
    tensors["model.layers.2.mlp.up_proj.weight_scale"] = torch.ones(3, 1)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="neither per tensor nor per output channel"):
        LLM(str(path), device="cpu", dtype="float32", cpu_kv_cache_gib=0.01)
    tensors["model.layers.2.mlp.up_proj.weight_scale"] = torch.ones(())
    tensors["model.layers.2.mlp.up_proj.input_scale"] = torch.ones(())
    save_file(tensors, str(path / "model.safetensors"))
    # static scales where quantization_config says the activations are dynamic
    with pytest.raises(ValueError, match="'model.layers.2.mlp.gate_up_proj.input_scale' has no matching"):
        LLM(str(path), device="cpu", dtype="float32", cpu_kv_cache_gib=0.01)


def test_roofline_counts_fp8_projections_at_one_byte():
    from fastllm.bench.roofline import ModelShape

    cfg = json.loads((Path(STORIES).parent / "configs" / "Llama-3.1-8B" / "config.json").read_text())
    bf16 = ModelShape.from_hf_config(cfg, "bfloat16")
    quantized = ModelShape.from_hf_config(cfg, "bfloat16", Fp8Scheme())
    projections = bf16.num_layers * bf16.layer_matmul_params
    assert bf16.weight_bytes == 2 * bf16.num_params
    assert quantized.weight_bytes == bf16.weight_bytes - projections
    assert quantized.decode_weight_bytes(8) == bf16.decode_weight_bytes(8) - projections
    assert 8.4 < quantized.weight_bytes / 2**30 < 8.5
    assert ModelShape.from_model("llama-3.1-8b", "bfloat16", "fp8").weight_bytes == quantized.weight_bytes
    # quantize_lm_head: lm_head at one byte too; with tied embeddings an e4m3 copy beside the 16-bit table
    head = bf16.vocab_size * bf16.hidden_size
    with_head = ModelShape.from_hf_config(cfg, "bfloat16", Fp8Scheme(lm_head=True))
    assert with_head.weight_bytes == quantized.weight_bytes - head
    assert with_head.decode_weight_bytes(8) == quantized.decode_weight_bytes(8) - head
    tied = json.loads((Path(STORIES).parent / "configs" / "Qwen3-0.6B" / "config.json").read_text())
    tied_fp8 = ModelShape.from_hf_config(tied, "bfloat16", Fp8Scheme())
    tied_head = ModelShape.from_hf_config(tied, "bfloat16", Fp8Scheme(lm_head=True))
    table = tied_fp8.vocab_size * tied_fp8.hidden_size
    assert tied_head.weight_bytes == tied_fp8.weight_bytes + table
    # a step reads the e4m3 copy (1 byte a weight) in place of the 16-bit table, and the 8 gathered rows
    gathered = 8 * tied_fp8.hidden_size * 2
    assert tied_head.decode_weight_bytes(8) == tied_fp8.decode_weight_bytes(8) - 2 * table + table + gathered
    with pytest.raises(ValueError, match="^quantize_lm_head puts lm_head in FP8 beside FP8 linear weights"):
        ModelShape.from_model("llama-3.1-8b", "bfloat16", None, quantize_lm_head=True)


@pytest.mark.parametrize("quantize_lm_head", [False, True])
def test_the_gpu_tests_count_the_fp8_modules(allow_fp8_on_cpu, quantize_lm_head):
    """test_gpu_fp8.fp8_layers: llama2xs's 4 x 5 projections, and lm_head only when it runs in FP8 too (its
    flag is False otherwise: the GPU test once counted 21 modules)."""
    from tests.conftest import DRAFT
    from tests.engine.test_gpu_fp8 import fp8_layers

    llm = cached_llm(DRAFT, quantization="fp8", quantize_lm_head=quantize_lm_head)
    layers = fp8_layers(llm)
    head = llm.engine.worker.runner.model.lm_head
    assert len(layers) == 4 * 5 + quantize_lm_head and (head in layers) == quantize_lm_head
    assert all(m.weight.dtype == FP8 for m in layers)
