"""calculate_kv_scales: an FP8 KV cache's per-layer scales from a calibration forward at startup.

Each layer's K (after its q/k norm and rotary, as the cache stores it) and V are measured over one forward
of random tokens; k_scale = amax / 200 and v_scale = amax / 100, vLLM's constants (headroom for values
larger than the calibration saw: they saturate at 448 x scale). vLLM measures its first real forward; here
the forward runs before the CUDA graphs are captured, which take the scales as launch constants. Random
tokens stand in for text: on stories260K their K/V amax came within ~25% of eight stories' (README, "FP8
weights").
"""

from __future__ import annotations

import torch

from fastllm.kernels.reference import MIN_AMAX
from fastllm.worker.attn_metadata import forward_context

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
MAX_CALIBRATION_TOKENS = 2048
SEED = 0  # the same tokens on every rank and every start


@torch.inference_mode()
def calculate_kv_scales(model: torch.nn.Module, layers: list, vocab_size: int, num_tokens: int,
                        max_model_len: int, device: torch.device) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per attention layer from a forward of min(num_tokens, MAX_CALIBRATION_TOKENS,
    max_model_len) random tokens, one sequence; the layers record their amax (Attention.kv_amax)."""
    num_tokens = min(num_tokens, MAX_CALIBRATION_TOKENS, max_model_len)
    input_ids = torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(SEED))
    positions = torch.arange(num_tokens)
    for layer in layers:
        layer.kv_amax = torch.zeros(2, dtype=torch.float32, device=device)
    try:
        with forward_context(None, layers):
            model(input_ids.to(device), positions.to(device))
        amax = torch.stack([layer.kv_amax for layer in layers]).tolist()
    finally:
        for layer in layers:
            layer.kv_amax = None
    return [(max(k, MIN_AMAX) / K_SCALE_CONSTANT, max(v, MIN_AMAX) / V_SCALE_CONSTANT) for k, v in amax]
