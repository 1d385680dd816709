"""Typical wrong answers to the exercises of lecture 06 (see tests/wrong_answers/__init__.py)."""

import gc

import torch

from course_lib.planning.guard import MemoryBudgetExceeded

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _k_times_activations(resident, activation_peak, grads, optimizer_scratch, accumulation_steps):
    return resident + max(accumulation_steps * activation_peak, grads + optimizer_scratch)


def _no_gradient_during_accumulation(resident, activation_peak, grads, optimizer_scratch,
                                     accumulation_steps):
    return resident + max(activation_peak, grads + optimizer_scratch)


def _adds_every_phase(resident, activation_peak, grads, optimizer_scratch, accumulation_steps):
    return resident + activation_peak + grads + optimizer_scratch


def _activations_divided_by_k(resident, activation_peak, grads, optimizer_scratch,
                              accumulation_steps):
    K = accumulation_steps
    return resident + max(activation_peak / K + (grads if K > 1 else 0), grads + optimizer_scratch)


def _forgets_resident(resident, activation_peak, grads, optimizer_scratch, accumulation_steps):
    extra = grads if accumulation_steps > 1 else 0
    return max(activation_peak + extra, grads + optimizer_scratch)


def _ignores_divisibility(peak_of, budget_bytes, effective_batch):
    b = max(b for b in range(1, effective_batch + 1) if peak_of(b) <= budget_bytes)
    return b, effective_batch // b


def _strictly_below(peak_of, budget_bytes, effective_batch):
    fitting = [b for b in range(1, effective_batch + 1)
               if effective_batch % b == 0 and peak_of(b) < budget_bytes]
    if not fitting:
        raise ValueError("nothing fits")
    return max(fitting), effective_batch // max(fitting)


def _smallest(peak_of, budget_bytes, effective_batch):
    if peak_of(1) > budget_bytes:
        raise ValueError("nothing fits")
    return 1, effective_batch


def _first_that_does_not_fit(peak_of, budget_bytes, effective_batch):
    divisors = [b for b in range(1, effective_batch + 1) if effective_batch % b == 0]
    for b in divisors:
        if peak_of(b) > budget_bytes:
            return b, effective_batch // b
    return divisors[-1], 1


def _returns_zero(peak_of, budget_bytes, effective_batch):
    fitting = [b for b in range(1, effective_batch + 1)
               if effective_batch % b == 0 and peak_of(b) <= budget_bytes]
    b = max(fitting, default=0)
    return b, (effective_batch // b if b else 0)


def _catches_everything(work):
    try:
        return work()
    except Exception as exc:
        gc.collect()
        torch.cuda.empty_cache()
        return f"out of memory: {exc}"


def _catches_runtime_error(work):
    try:
        return work()
    except RuntimeError as exc:
        gc.collect()
        torch.cuda.empty_cache()
        return f"out of memory: {exc}"


def _only_cuda_oom(work):
    try:
        return work()
    except _OOM as exc:
        gc.collect()
        torch.cuda.empty_cache()
        return f"out of memory: {exc}"


def _no_gc(work):
    try:
        return work()
    except (_OOM, MemoryBudgetExceeded) as exc:
        return f"out of memory: {exc}"


_KEPT = []


def _keeps_the_exception(work):
    try:
        return work()
    except (_OOM, MemoryBudgetExceeded) as exc:
        _KEPT.append(exc)  # e.g. to show it later: keeps the failed work's frames alive
        gc.collect()
        torch.cuda.empty_cache()
        return f"out of memory: {exc}"


WRONG = {
    "check_step_peak": [
        ("K micro-batches' activations at once", {"step_peak": _k_times_activations}),
        ("no gradient while later micro-batches run", {"step_peak": _no_gradient_during_accumulation}),
        ("adds every phase instead of the largest", {"step_peak": _adds_every_phase}),
        ("activations divided by K", {"step_peak": _activations_divided_by_k}),
        ("forgets the resident model states", {"step_peak": _forgets_resident}),
    ],
    "check_largest_micro_batch": [
        ("a micro-batch that does not divide the effective batch",
         {"largest_micro_batch": _ignores_divisibility}),
        ("peak strictly below the budget", {"largest_micro_batch": _strictly_below}),
        ("the smallest micro-batch", {"largest_micro_batch": _smallest}),
        ("the first micro-batch that does not fit", {"largest_micro_batch": _first_that_does_not_fit}),
        ("returns (0, 0) when nothing fits", {"largest_micro_batch": _returns_zero}),
    ],
    "check_train_or_report": [
        ("catches every exception", {"train_or_report": _catches_everything}),
        ("catches RuntimeError", {"train_or_report": _catches_runtime_error}),
        ("catches only torch.OutOfMemoryError", {"train_or_report": _only_cuda_oom}),
        ("never calls gc.collect()", {"train_or_report": _no_gc}),
        ("keeps the exception alive", {"train_or_report": _keeps_the_exception}),
    ],
}
