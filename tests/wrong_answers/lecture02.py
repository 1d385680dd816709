"""Typical wrong answers to the exercises of lecture 02 (see tests/wrong_answers/__init__.py)."""

import math

import torch

from course_lib.measurement.memory import saved_tensors
from course_lib.prediction.predict import Step, predict


def _e(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _one_per_layer(b, s, h, dtype, p):        # the two Linear inputs only
    return (b * s * h + b * s * 4 * h) * _e(dtype)


def _forgets_gelu_input(b, s, h, dtype, p):
    return (5 * b * s * h + (b * s * h if p > 0 else 0)) * _e(dtype)


def _one_byte_masks(b, s, h, dtype, p):       # right on CUDA, not on the CPU
    return 9 * b * s * h * _e(dtype) + (b * s * h if p > 0 else 0)


def _ignores_dropout(b, s, h, dtype, p):
    return 9 * b * s * h * _e(dtype)


def _always_fp32(b, s, h, dtype, p):
    return (9 + (p > 0)) * b * s * h * 4


def _sum_of_rows(output, params):
    return sum(r.nbytes for r in saved_tensors(output, params) if not r.is_parameter)


def _with_parameters(output, params):
    storages = {r.storage_id: r.nbytes for r in saved_tensors(output, params)}
    return sum(storages.values())


def _shape_bytes(output, params):             # the view's shape, not the storage it keeps alive
    storages = {r.storage_id: math.prod(r.shape) * _e(r.dtype)
                for r in saved_tensors(output, params) if not r.is_parameter}
    return sum(storages.values())


def _numel(output, params):
    storages = {r.storage_id: r.nbytes // _e(r.dtype)
                for r in saved_tensors(output, params) if not r.is_parameter}
    return sum(storages.values())


def _need(config, b, s, precision, gpu, part="total"):
    return getattr(predict(Step(config, b, seq_len=s, precision=precision, gpu=gpu)).peak, part)


def _largest(config, s, capacity, precision, gpu, **kw):
    b = 0
    while _need(config, b + 1, s, precision, gpu, **kw) <= capacity:
        b += 1
    return b


def _ignores_model_states(config, s, capacity, precision, gpu):
    return _largest(config, s, capacity, precision, gpu, part="step_peak")


def _ignores_the_gpu(config, s, capacity, precision, gpu):  # the CPU's kernels everywhere
    return _largest(config, s, capacity, precision, None)


def _first_that_does_not_fit(config, s, capacity, precision, gpu):
    return _largest(config, s, capacity, precision, gpu) + 1


def _strictly_less(config, s, capacity, precision, gpu):
    b = 0
    while _need(config, b + 1, s, precision, gpu) < capacity:
        b += 1
    return b


def _at_least_one(config, s, capacity, precision, gpu):
    return max(1, _largest(config, s, capacity, precision, gpu))


WRONG = {
    "check_mlp_saved_bytes": [
        ("one activation per layer (the Linear inputs only)", {"mlp_saved_bytes": _one_per_layer}),
        ("forgets that GELU keeps its input", {"mlp_saved_bytes": _forgets_gelu_input}),
        ("1-byte dropout masks on the CPU", {"mlp_saved_bytes": _one_byte_masks}),
        ("forgets the dropout mask", {"mlp_saved_bytes": _ignores_dropout}),
        ("4 bytes per value whatever the dtype", {"mlp_saved_bytes": _always_fp32}),
    ],
    "check_distinct_saved_bytes": [
        ("sums every row (shared storages counted twice)", {"distinct_saved_bytes": _sum_of_rows}),
        ("counts the parameters", {"distinct_saved_bytes": _with_parameters}),
        ("counts the shape of a view instead of its storage", {"distinct_saved_bytes": _shape_bytes}),
        ("counts elements, not bytes", {"distinct_saved_bytes": _numel}),
    ],
    "check_largest_batch": [
        ("forgets the model states", {"largest_batch": _ignores_model_states}),
        ("predicts with the CPU's kernels for every GPU", {"largest_batch": _ignores_the_gpu}),
        ("returns the first batch that does not fit", {"largest_batch": _first_that_does_not_fit}),
        ("needs strictly less than the capacity", {"largest_batch": _strictly_less}),
        ("never answers 0", {"largest_batch": _at_least_one}),
    ],
}
