"""Rotary position embedding: the cos/sin table (with Llama-3.1 scaling) and the module that holds
it. The rotation itself runs inside the attention op: fused into decode attention on a decode step
(rotary_decode_attention), and with the KV write (rotary_kv_cache_write) on prefill and mixed steps."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf_config: dict) -> tuple[float, dict]:
    """(theta, scaling) from either the classic keys or transformers 5's rope_parameters."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = dict(hf_config.get("rope_scaling") or params)
    theta = hf_config.get("rope_theta") or params.get("rope_theta") or 10000.0
    return float(theta), scaling


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


def cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: dict) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict, is_neox: bool = True):
        super().__init__()
        self.is_neox = is_neox
        self.register_buffer("cos_sin_cache", cos_sin_cache(head_dim, max_positions, theta, scaling), persistent=False)
