"""Checks for exercises/07_beyond_one_gpu.ipynb.

The plan's and FSDP2's shard sizes are written out (their rules live with the grader,
``course_tools/hidden.py``); ``average_gradients`` runs on simulated ranks, one thread each,
whose ``all_reduce_sum`` meets the others at a barrier as ``dist.all_reduce`` does.
"""

from __future__ import annotations

import math
import threading

import torch

from . import CheckFailed, exactly, expect, grader, observe

_BARRIER_TIMEOUT = 5.0  # seconds a simulated rank waits for the others in all_reduce_sum


#: ``(world_size, micro_batch, accum_steps, n_buckets, use_no_sync, (effective batch,
#: all-reduces))``: each backward that synchronises all-reduces each bucket.
PLAN_CASES = [(2, 2, 4, 4, True, (16, 4)), (2, 2, 4, 4, False, (16, 16)),
              (8, 1, 16, 10, True, (128, 10)), (8, 1, 16, 10, False, (128, 160)),
              (4, 8, 1, 3, True, (32, 3)), (4, 8, 1, 3, False, (32, 3)),
              (3, 5, 2, 1, False, (30, 2))]


@grader
def check_ddp_accumulation_plan(fn):
    """``fn(world_size, micro_batch, accum_steps, n_buckets, use_no_sync)``: ``(effective batch,
    all-reduces per optimizer step on each rank)``."""
    for N, micro, K, buckets, no_sync, truth in PLAN_CASES:
        args = f"{N}, {micro}, {K}, {buckets}, use_no_sync={no_sync}"
        got = fn(N, micro, K, buckets, no_sync)
        expect(isinstance(got, tuple | list) and len(got) == 2,
               f"ddp_accumulation_plan({args}) returned {got!r}, expected a pair "
               "(effective_batch, all_reduces)", hint="return effective_batch, all_reduces")
        expect(exactly(got[0], truth[0]),
               f"ddp_accumulation_plan({args}): effective batch {got[0]!r}, "
               f"expected {truth[0]}",
               hint="one optimizer step sees every rank's micro-batches of every accumulation step")
        expect(exactly(got[1], truth[1]),
               f"ddp_accumulation_plan({args}): {got[1]!r} all-reduce(s) per "
               f"optimizer step, expected {truth[1]}",
               hint="DDP all-reduces once per bucket in every backward that synchronises; "
                    "no_sync() skips all but the last micro-batch's, it does not skip the last")


def _average_run(fn, world_size: int, grads: list[list]) -> list[list]:
    """Run ``fn(params, all_reduce_sum, world_size)`` on one thread per rank (beside the learner's
    code), ``all_reduce_sum`` summing in place over the ranks as ``dist.all_reduce(t)`` does:
    each rank's ``p.grad`` afterwards."""
    barrier = threading.Barrier(world_size, timeout=_BARRIER_TIMEOUT)
    slots: list = [None] * world_size
    params = [[torch.nn.Parameter(torch.zeros(2) if g is None else torch.zeros_like(g))
               for g in rank_grads] for rank_grads in grads]
    for p, g in zip(sum(params, []), sum(grads, [])):
        p.grad = None if g is None else g.clone()
    errors: list = [None] * world_size

    def body(rank: int) -> None:
        def all_reduce_sum(tensor, *args, **kwargs):
            if not isinstance(tensor, torch.Tensor):
                raise CheckFailed(f"all_reduce_sum was given {type(tensor).__name__}, not a "
                                  "tensor", hint="skip the parameters whose p.grad is None")
            if args or kwargs:
                raise CheckFailed("all_reduce_sum was given more than the tensor",
                                  hint="all_reduce_sum(tensor) sums over the ranks, in place; "
                                       "it takes no other argument")
            slots[rank] = tensor
            barrier.wait()  # every rank has put its tensor down
            total = sum(t.detach().clone() for t in slots)
            barrier.wait()  # every rank has read every tensor: now they may change
            tensor.copy_(total)

        try:
            fn(params[rank], all_reduce_sum, world_size)
        except BaseException as exc:  # report it, and free the ranks waiting for this one
            errors[rank] = exc
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * _BARRIER_TIMEOUT)
    expect(not any(t.is_alive() for t in threads),
           f"average_gradients did not return within {3 * _BARRIER_TIMEOUT:.0f} s",
           hint="look for a loop that never ends")
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    expect(not any(errors), "the ranks called all_reduce_sum a different number of times, so "
           "some waited in vain for the others",
           hint="every rank must make the same all_reduce_sum calls, in the same order")
    return [[p.grad for p in rank] for rank in params]


@grader
def check_average_gradients(fn):
    """``fn(params, all_reduce_sum, world_size)`` leaves the ranks' mean in every ``p.grad``."""
    g = torch.Generator().manual_seed(7)
    for world_size in (2, 3):
        shapes = [(4, 3), (5,), None, (2, 2, 2)]  # None: a frozen parameter without a gradient
        grads = [[None if s is None else torch.randn(s, generator=g) for s in shapes]
                 for _ in range(world_size)]
        after = observe(_average_run, fn, world_size, grads)
        expect(isinstance(after, list) and len(after) == world_size
               and all(isinstance(r, list) and len(r) == len(shapes) for r in after),
               "the ranks' parameters came back in another shape",
               hint="change p.grad only; keep every parameter")
        for i, shape in enumerate(shapes):
            if shape is None:
                expect(all(after[r][i] is None for r in range(world_size)),
                       "a parameter without a gradient got one", hint="skip p.grad is None")
                continue
            truth = sum(grads[r][i] for r in range(world_size)) / world_size
            for rank in range(world_size):
                got = after[rank][i]
                expect(isinstance(got, torch.Tensor), f"with {world_size} ranks, rank {rank}'s gradient of "
                       f"parameter {i} is None", hint="leave the mean in p.grad")
                summed = " (it is their sum)" if torch.allclose(got, truth * world_size) else ""
                expect(torch.allclose(got, truth, atol=1e-6),
                       f"with {world_size} ranks, rank {rank}'s gradient of parameter {i} is not "
                       f"the mean of the ranks' gradients{summed}",
                       hint="all_reduce_sum(p.grad) sums in place over the ranks; then divide by "
                            "world_size, in place (p.grad.div_) or by assigning p.grad")


#: ``(shape, world_size, elements per rank)``: ``torch.chunk`` along dim 0, as FSDP2 cuts.
NUMEL_CASES = [((257, 64), 2, [8256, 8192]), ((64,), 2, [32, 32]), ((10,), 3, [4, 4, 2]),
               ((5, 3), 4, [6, 6, 3, 0]), ((3,), 4, [1, 1, 1, 0]), ((1, 8), 2, [8, 0]),
               ((50257, 768), 8, [4825344] * 7 + [4819968]), ((7, 2, 2), 3, [12, 12, 4])]


@grader
def check_fsdp_local_numel(fn):
    """``fn(shape, world_size)`` -> the elements of that parameter on each rank under FSDP2."""
    for shape, N, truth in NUMEL_CASES:
        got = fn(shape, N)
        expect(isinstance(got, list | tuple) and len(got) == N,
               f"fsdp_local_numel({shape}, {N}) returned {got!r}, expected a list of {N} ints "
               "(one per rank)", hint="one entry per rank, ranks past the last row hold 0")
        expect(exactly(got, truth), f"fsdp_local_numel({shape}, {N}) returned {list(got)}, "
               f"expected {truth}",
               hint=f"each rank takes ceil(rows / world_size) = {math.ceil(shape[0] / N)} whole "
                    "rows of dim 0 in turn (torch.chunk); the last ranks get what is left, "
                    "possibly nothing; a row holds prod(shape[1:]) elements")
