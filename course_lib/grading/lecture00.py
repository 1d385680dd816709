"""Checks for exercises/00_setup.ipynb: bytes measured on a real tensor; the training dtype's
cases written out (the grader, ``course_tools/hidden.py``, tries the others)."""

from __future__ import annotations

import torch

from . import exactly, expect, grader


@grader
def check_tensor_nbytes(fn):
    """``fn(shape, dtype)`` must return the bytes of a dense tensor of that shape and dtype."""
    cases = [((2, 3), torch.float32), ((1024, 1024), torch.bfloat16), ((7,), torch.float16),
             ((3, 5, 2), torch.float64), ((4, 4), torch.int8), ((0, 9), torch.float32)]
    for shape, dtype in cases:
        truth = torch.empty(shape, dtype=dtype).untyped_storage().nbytes()
        got = fn(shape, dtype)
        expect(exactly(got, truth),
               f"tensor_nbytes({shape}, {dtype}) returned {got!r}, expected {truth}",
               hint="elements = product of the shape; bytes per element depends on the dtype "
                    "(torch.empty((), dtype=dtype).element_size())")


#: ``(device_type, has_native_bf16, dtype)``: the public cases of ``pick_training_dtype``, one
#: per rule; the grader adds cases of its own.
DTYPE_CASES = [("cpu", False, torch.float32), ("cuda", True, torch.bfloat16),
               ("cuda", False, torch.float16), ("mps", True, torch.bfloat16)]


@grader
def check_pick_training_dtype(fn):
    """``fn(device_type, has_native_bf16)`` picks the mixed-precision dtype the course uses."""
    for device_type, bf16, truth in DTYPE_CASES:
        got = fn(device_type, bf16)
        expect(exactly(got, truth), f"pick_training_dtype({device_type!r}, has_native_bf16={bf16}) "
               f"returned {got!r}, expected {truth}",
               hint="bf16 on GPUs that support it natively, fp16 (with GradScaler) on older GPUs "
                    "such as the T4, fp32 on the CPU; a Mac's GPU (mps) follows the GPUs' rule")
