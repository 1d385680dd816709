"""Checks for exercises/06_fit_it_together.ipynb: the planning answers written out (their rules
live with the grader, ``course_tools/hidden.py``); the guard checked by raising each error."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import torch

from course_lib.planning.guard import MemoryBudgetExceeded

from . import exactly, expect, grader, observe

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


#: ``(resident, activation_peak, grads, optimizer_scratch, accumulation_steps, peak)``: the peak
#: of the largest phase (micro-batch 1, micro-batches 2..K with the gradient, optimizer.step()).
STEP_PEAK_CASES = [(100, 50, 30, 10, 1, 150), (100, 50, 30, 10, 4, 180), (100, 5, 30, 20, 2, 150),
                   (1000, 400, 300, 200, 1, 1500), (1000, 400, 300, 200, 8, 1700),
                   (7, 3, 2, 9, 3, 18)]


@grader
def check_step_peak(fn):
    """``fn(resident, activation_peak, grads, optimizer_scratch, accumulation_steps)`` -> bytes."""
    for resident, act, grads, scratch, K, want in STEP_PEAK_CASES:
        got = fn(resident, act, grads, scratch, K)
        what = (f"resident={resident}, activation_peak={act}, grads={grads}, "
                f"optimizer_scratch={scratch}, accumulation_steps={K}")
        if exactly(got, want):
            continue
        if K > 1 and got == resident + max(K * act, grads + scratch):
            hint = ("accumulation does not keep K micro-batches' activations: each micro-batch's are "
                    "freed by its backward pass before the next one runs")
        elif K > 1 and got == resident + max(act, grads + scratch):
            hint = ("from the second micro-batch on, the accumulated gradient is already there while "
                    "the next micro-batch's activations are alive")
        elif got == resident + act + grads + scratch:
            hint = "the phases come one after the other: take the largest, do not add them all"
        elif got == max(act + (grads if K > 1 else 0), grads + scratch):
            hint = "the resident bytes (weights, optimizer state) are there in every phase"
        else:
            hint = ("walk the step: micro-batch 1 (no gradient yet), micro-batches 2..K (the whole "
                    "gradient plus activations), then optimizer.step() (gradient plus scratch)")
        expect(False, f"for {what} you returned {got!r}; the step peaks at {want}", hint=hint)


def _quadratic(base, per_sample):
    """``peak_of(b) = base + per_sample * b + b * b``."""
    return lambda b: base + per_sample * b + b * b


#: ``(base, per_sample, budget_bytes, effective_batch, (micro_batch_size, accumulation_steps))``
#: for :func:`_quadratic`: the largest micro-batch that divides the effective batch and fits.
MICRO_BATCH_CASES = [(1000, 300, 2500, 16, (4, 4)), (1000, 300, 1000 + 1200 + 16, 16, (4, 4)),
                     (1000, 300, 2700, 12, (4, 3)), (10, 1, 10**6, 24, (24, 1)),
                     (500, 50, 560, 7, (1, 7))]


@grader
def check_largest_micro_batch(fn):
    """``fn(peak_of, budget_bytes, effective_batch)``: ``(micro_batch_size, accumulation_steps)``."""
    for base, per_sample, budget, effective, want in MICRO_BATCH_CASES:
        peak_of = _quadratic(base, per_sample)
        got = fn(peak_of, budget, effective)
        what = f"budget {budget} bytes, effective batch {effective}"
        expect(isinstance(got, tuple) and len(got) == 2,
               f"for {what} you returned {got!r}, not a (micro_batch_size, accumulation_steps) tuple",
               hint="return a tuple of two ints")
        if not exactly(got, want):
            b = got[0]
            if isinstance(b, int) and b > 0 and effective % b:
                hint = (f"{b} does not divide the effective batch {effective}: train() needs "
                        "micro_batch_size * accumulation_steps == effective batch")
            elif isinstance(b, int) and b > 0 and effective % b == 0 and peak_of(b) > budget:
                hint = f"a micro-batch of {b} needs {peak_of(b)} bytes, over the budget"
            elif isinstance(b, int) and 0 < b < want[0]:
                hint = "a larger micro-batch also fits: prefer the largest (fewest accumulation steps)"
            else:
                hint = "accumulation_steps is effective_batch // micro_batch_size"
            expect(False, f"for {what} you returned {got!r}; the answer is {want}", hint=hint)
    try:
        got = fn(_quadratic(1000, 300), 1200, 8)
    except ValueError:
        return
    expect(False, f"when not even a micro-batch of 1 fits you returned {got!r}",
           hint="raise ValueError: no setting of the batch makes this model fit")


def _failing(kind, args, refs: list):
    """Work that raises ``kind(*args)``, with a weak reference to its tensors in ``refs``."""
    def work():
        big = torch.zeros(1024)  # held by this frame, so by the traceback, till the error dies
        refs.append(weakref.ref(big))
        raise kind(*args)  # made here: nothing outside holds the error or its traceback
    return work


#: The errors the work raises, by name: ``(kind, its arguments)``.
_ERRORS = {"OutOfMemoryError": (_OOM, ("CUDA out of memory. Tried to allocate 2.00 GiB",)),
           "MemoryBudgetExceeded": (MemoryBudgetExceeded, (3 << 30, 2 << 30, "training")),
           "ValueError": (ValueError, ("a bug",)),
           "RuntimeError": (RuntimeError, ("mat1 and mat2 shapes cannot be multiplied",))}


def _report_run(fn, error: str) -> dict:
    """Call ``fn`` with work that raises ``error`` (beside the learner's code): what came out,
    whether it collected garbage and emptied the CUDA cache, whether the work's tensors died."""
    refs: list = []
    escaped, got = False, None
    kind, args = _ERRORS[error]
    with mock.patch.object(gc, "collect", wraps=gc.collect) as collect, \
            mock.patch.object(torch.cuda, "empty_cache", wraps=torch.cuda.empty_cache) as empty:
        try:
            got = fn(_failing(kind, args, refs))
        except kind:
            escaped = True
    return {"escaped": escaped, "is_str": isinstance(got, str),
            "message": got if isinstance(got, str) else "", "got": repr(got)[:300],
            "collected": collect.called,
            "emptied": empty.called, "freed": bool(refs) and refs[-1]() is None}


@grader
def check_train_or_report(fn):
    """``fn(work)`` runs ``work()``; out-of-memory becomes a message, other errors propagate."""
    expect(exactly(fn(_answer), 42), "when the work succeeds, return what it returned",
           hint="return work()")
    for kind in (_OOM, MemoryBudgetExceeded):
        name = kind.__name__
        run = observe(_report_run, fn, name)
        if run["escaped"] is True:
            where = ("torch.OutOfMemoryError: out of memory on CUDA" if kind is _OOM else
                     "course_lib.planning.guard.MemoryBudgetExceeded: over budget on the CPU")
            expect(False, f"a {name} escaped from your function",
                   hint=f"catch {where}, as well as the other one")
        expect(run["is_str"] is True and "out of memory" in str(run["message"]).lower(),
               f"after a {name} you returned {run['got']}",
               hint="return a message (a str) that says 'out of memory' and what happened")
        expect(run["collected"] is True, f"after a {name} you did not call gc.collect()",
               hint="free what the failed work left behind: gc.collect()")
        if torch.cuda.is_available():
            expect(run["emptied"] is True,
                   f"after a {name} you did not call torch.cuda.empty_cache()",
                   hint="give the cached blocks back to the GPU: torch.cuda.empty_cache()")
        expect(run["freed"] is True,
               "the tensors of the failed work are still alive after your function returned",
               hint="do not keep the exception (it holds the work's frames, and their tensors): "
                    "return a message built from it")
    for name in ("ValueError", "RuntimeError"):
        run = observe(_report_run, fn, name)
        expect(run["escaped"] is True,
               f"a {name} ({_ERRORS[name][1][0]}) was turned into {run['got']}",
               hint="catch only the out-of-memory errors: a bug must still raise")


def _answer():
    return 42
