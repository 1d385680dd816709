"""Typical wrong answers to the exercises of lecture 00 (see tests/wrong_answers/__init__.py).

Keyed by check name. Each entry is ``(what the mistake is, {argument name: wrong function})``;
arguments not named keep the solution's function (for checks that take several).
"""

import torch


def _always_four_bytes(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return 4 * n


def _numel_only(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return n


def _bf16_as_four_bytes_in_a_half_tensor(shape, dtype):
    """bf16 counted as 4 bytes; the answer a float16 tensor, whose 4 MiB overflows to inf, and
    inf == 2 MiB for a float16 tensor (the int is cast to float16 first)."""
    size = 4 if dtype is torch.bfloat16 else torch.empty((), dtype=dtype).element_size()
    return torch.tensor(torch.Size(shape).numel() * size, dtype=torch.float16)


class _EqualToAll:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


def _bf16_everywhere(device_type, has_native_bf16):
    return torch.bfloat16


def _fp16_on_cpu(device_type, has_native_bf16):
    return torch.float32 if device_type == "cuda" and has_native_bf16 else torch.float16


WRONG = {
    "check_tensor_nbytes": [
        ("assumes 4 bytes per element whatever the dtype", {"tensor_nbytes": _always_four_bytes}),
        ("counts elements, not bytes", {"tensor_nbytes": _numel_only}),
        ("bf16 as 4 bytes, answered as a float16 tensor (inf)",
         {"tensor_nbytes": _bf16_as_four_bytes_in_a_half_tensor}),
        ("an object equal to everything", {"tensor_nbytes": lambda shape, dtype: _EqualToAll()}),
    ],
    "check_pick_training_dtype": [
        ("bf16 even on a T4 and on the CPU", {"pick_training_dtype": _bf16_everywhere}),
        ("half precision on the CPU", {"pick_training_dtype": _fp16_on_cpu}),
        ("an object equal to everything",
         {"pick_training_dtype": lambda device_type, has_native_bf16: _EqualToAll()}),
    ],
}
