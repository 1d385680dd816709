"""Checks for exercises/01_where_the_memory_goes.ipynb, answers written out.

The bytes per parameter follow the ZeRO paper's accounting (Rajbhandari et al. 2020, section
3.1); the formulas live with the grader (``course_tools/hidden.py``), which tries the recipes and
cases left out here, and ``tests/test_grading_truths.py`` measures them on real steps. A card's
capacity is what PyTorch reports (``GPUS[name].total_memory``), never 80 * 10**9 bytes.
"""

from __future__ import annotations

import numbers

from ..device import GPUS
from ..units import GiB
from . import exactly, expect, grader

#: ``(optimizer, precision, bytes per parameter)``: 16-bit or fp32 weights and gradients, an
#: fp32 master copy in the mixed recipes, and the optimizer's state tensors (0, 1 or 2) in the
#: dtype the recipe keeps them in; eleven of the sixteen recipes, written out.
BYTES_CASES = [
    ("sgd", "fp32", 8), ("sgd-momentum", "fp32", 12), ("adam", "fp32", 16),
    ("adamw", "fp32", 16), ("sgd-momentum", "fp16-mixed", 12), ("adamw", "fp16-mixed", 16),
    ("sgd", "bf16-mixed", 8), ("adam", "bf16-mixed", 16), ("sgd", "bf16", 4),
    ("sgd-momentum", "bf16", 6), ("adam", "bf16", 8),
]

#: ``(n_params, zero_stage, world_size, bytes per device)``: mixed-precision Adam under ZeRO,
#: the paper's example (7.5B on 64 GPUs) and smaller models, written out.
ZERO_CASES = [
    (7_500_000_000, 0, 64, 120_000_000_000), (7_500_000_000, 1, 64, 31_406_250_000),
    (7_500_000_000, 2, 64, 16_640_625_000), (7_500_000_000, 3, 64, 1_875_000_000),
    (1_000_000_000, 0, 1, 16_000_000_000), (1_000_000_000, 0, 8, 16_000_000_000),
    (1_000_000_000, 1, 1, 16_000_000_000), (1_000_000_000, 1, 8, 5_500_000_000),
    (1_000_000_000, 2, 1, 16_000_000_000), (1_000_000_000, 2, 8, 3_750_000_000),
    (1_000_000_000, 3, 1, 16_000_000_000), (1_000_000_000, 3, 8, 2_000_000_000),
    (6_000_000, 0, 3, 96_000_000), (6_000_000, 1, 3, 48_000_000),
    (6_000_000, 2, 3, 40_000_000), (6_000_000, 3, 3, 32_000_000),
]

#: ``(n_params, card or capacity in bytes, zero_stage, fewest GPUs or None)``: Llama 2 70B on
#: A100 80GBs, Llama 2 7B on A100 40GBs, Llama 3.2 1B on T4s, 1B on one A100 80GB, and
#: exactly at the ZeRO paper's figures; written out.
GPUS_CASES = [
    (68_976_648_192, "A100 80GB", 0, None), (68_976_648_192, "A100 80GB", 1, None),
    (68_976_648_192, "A100 80GB", 2, None), (68_976_648_192, "A100 80GB", 3, 13),
    (6_738_415_616, "A100 40GB", 0, None), (6_738_415_616, "A100 40GB", 1, 6),
    (6_738_415_616, "A100 40GB", 2, 4), (6_738_415_616, "A100 40GB", 3, 3),
    (1_235_814_400, "T4", 0, None), (1_235_814_400, "T4", 1, 2),
    (1_235_814_400, "T4", 2, 2), (1_235_814_400, "T4", 3, 2),
    (1_000_000_000, "A100 80GB", 0, 1), (1_000_000_000, "A100 80GB", 1, 1),
    (1_000_000_000, "A100 80GB", 2, 1), (1_000_000_000, "A100 80GB", 3, 1),
    (7_500_000_000, 31_406_250_000, 1, 64), (7_500_000_000, 31_406_249_999, 1, 65),
    (7_500_000_000, 1_875_000_000, 3, 64),
]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_answer(name: str, got, args: str) -> None:
    expect(_is_int(got), f"{name}({args}) returned {got!r} of type {type(got).__name__}, "
           "not an int", hint="memory is a whole number of bytes, and a model a whole number of "
           "parameters: use integer arithmetic (// rounds down)")


@grader
def check_bytes_per_param(fn):
    """``fn(optimizer, precision)``: bytes of model states per parameter, unsharded."""
    for optimizer, precision, truth in BYTES_CASES:
        got = fn(optimizer, precision)
        args = f"{optimizer!r}, {precision!r}"
        _int_answer("bytes_per_param", got, args)
        hint = ("the mixed recipes keep 16-bit weights and gradients (2 + 2), an fp32 master "
                "copy (4) and fp32 optimizer state (4 per state tensor)"
                if precision.endswith("mixed") else
                "pure bf16 keeps everything in 2 bytes and has no master copy"
                if precision == "bf16" else "fp32 keeps everything in 4 bytes")
        expect(exactly(got, truth), f"bytes_per_param({args}) returned {got}, expected {truth}",
               hint=hint + "; SGD keeps no state, SGD with momentum one buffer, Adam two (m, v)")


@grader
def check_zero_bytes_per_device(fn):
    """``fn(n_params, zero_stage, world_size)``: mixed-precision Adam, ZeRO paper formulas."""
    for P, stage, N, truth in ZERO_CASES:
        got = fn(P, stage, N)
        args = f"{P}, zero_stage={stage}, world_size={N}"
        _int_answer("zero_bytes_per_device", got, args)
        expect(exactly(got, truth),
               f"zero_bytes_per_device({args}) returned {got}, expected {truth} "
               f"(= {truth / GiB:.2f} GiB)",
               hint="16 bytes/param = 2 (16-bit weights) + 2 (16-bit grads) + K = 12 (fp32 master, "
                    "m, v); stage 1 shards the K bytes, stage 2 also the grads, stage 3 also the "
                    "weights; stage 0 shards nothing")


#: ``(card or capacity in bytes, optimizer, precision, most parameters)``: cards at what
#: PyTorch reports for them, and byte counts as such; written out.
LARGEST_CASES = [
    ("T4", "adamw", "bf16-mixed", 978452480), ("A100 80GB", "adamw", "bf16-mixed", 5311692800),
    ("H100 80GB", "adamw", "fp32", 5308284928), ("T4", "sgd-momentum", "fp16-mixed", 1304603306),
    ("H200", "adam", "bf16", 18763743232), ("L4", "sgd", "bf16", 5914755072),
    (80_000_000_007, "adamw", "fp32", 5000000000),
    (40_000_000_009, "sgd-momentum", "fp16-mixed", 3333333334),
    (24_000_000_005, "sgd", "bf16", 6000000001), (40_000_000_005, "sgd", "fp32", 5000000000),
]


@grader
def check_largest_model(fn):
    """``fn(capacity_bytes, optimizer, precision)``: the most parameters whose states fit."""
    for card, optimizer, precision, truth in LARGEST_CASES:
        capacity = GPUS[card].total_memory if isinstance(card, str) else card
        got = fn(capacity, optimizer, precision)
        args = f"{capacity}, {optimizer!r}, {precision!r}"
        _int_answer("largest_model", got, args)
        expect(got <= truth,
               f"largest_model({args}) returned {got:,}, but the model states of that many "
               f"parameters do not fit in {capacity:,} bytes",
               hint="round the number of parameters down, and count every byte per parameter "
                    "(weights, gradients, optimizer state, master weights)")
        expect(got >= truth,
               f"largest_model({args}) returned {got:,}, but {got + 1:,} parameters still fit",
               hint="find the largest count: capacity // bytes per parameter")


@grader
def check_gpus_needed(fn):
    """``fn(n_params, capacity_bytes, zero_stage)``: fewest ranks whose per-device states fit."""
    for P, card, stage, truth in GPUS_CASES:
        capacity = GPUS[card].total_memory if isinstance(card, str) else card
        got = fn(P, capacity, stage)
        args = f"{P:,}, {capacity:,}, zero_stage={stage}"
        if truth is None:
            expect(got is None, f"gpus_needed({args}) returned {got!r}, expected None: the part "
                   "that this stage does not shard alone exceeds the capacity",
                   hint="stage 0 shards nothing, stage 1 keeps 4 bytes/param on every GPU, stage "
                        "2 keeps 2; no number of GPUs makes those smaller")
            continue
        expect(_is_int(got), f"gpus_needed({args}) returned {got!r}, expected the int {truth}",
               hint="return a whole number of GPUs, or None when no number is enough")
        expect(exactly(got, truth), f"gpus_needed({args}) returned {got}, expected {truth}",
               hint="the smallest N with a*P + b*P/N <= capacity: round up, and a model that "
                    "fits exactly fits; per device: stage 0 16P, stage 1 4P + 12P/N, "
                    "stage 2 2P + 14P/N, stage 3 16P/N")
