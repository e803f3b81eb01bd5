"""Triton kernels, one per file, each with a plain-PyTorch twin in reference.py (the CPU path and
the test oracle). `dispatch` picks between them by device; see dispatch.py."""

from fastllm.kernels.dispatch import KERNEL_NAMES, reference_impl, triton_impl

__all__ = ["KERNEL_NAMES", "reference_impl", "triton_impl"]
