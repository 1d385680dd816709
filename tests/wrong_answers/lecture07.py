"""Typical wrong answers to the exercises of lecture 07 (see tests/wrong_answers/__init__.py)."""

import math


def _plan_forgets_world(world_size, micro_batch, accum_steps, n_buckets, use_no_sync):
    return micro_batch * accum_steps, n_buckets * (1 if use_no_sync else accum_steps)


def _plan_no_sync_means_no_communication(world_size, micro_batch, accum_steps, n_buckets,
                                         use_no_sync):
    return world_size * micro_batch * accum_steps, 0 if use_no_sync else n_buckets * accum_steps


def _plan_one_all_reduce_per_backward(world_size, micro_batch, accum_steps, n_buckets,
                                      use_no_sync):
    return world_size * micro_batch * accum_steps, 1 if use_no_sync else accum_steps


def _plan_ignores_no_sync(world_size, micro_batch, accum_steps, n_buckets, use_no_sync):
    return world_size * micro_batch * accum_steps, n_buckets * accum_steps


def _average_sums_only(params, all_reduce_sum, world_size):
    for p in params:
        if p.grad is not None:
            all_reduce_sum(p.grad)


def _average_rebinds_a_local_name(params, all_reduce_sum, world_size):
    for p in params:
        if p.grad is not None:
            g = p.grad
            all_reduce_sum(g)
            g = g / world_size  # a new tensor; p.grad still holds the sum


def _average_divides_by_param_count(params, all_reduce_sum, world_size):
    params = list(params)
    for p in params:
        if p.grad is not None:
            all_reduce_sum(p.grad)
            p.grad.div_(len(params))


def _average_without_reducing(params, all_reduce_sum, world_size):
    for p in params:
        if p.grad is not None:
            p.grad.div_(world_size)  # the local gradient over N: not the mean of the ranks


def _average_forgets_none(params, all_reduce_sum, world_size):
    for p in params:
        all_reduce_sum(p.grad)
        p.grad.div_(world_size)


def _numel_even_split(shape, world_size):
    return [math.prod(shape) // world_size] * world_size


def _numel_array_split(shape, world_size):
    # numpy.array_split: the first rows % N ranks get one extra row. FSDP uses torch.chunk.
    rows, per_row = shape[0], math.prod(shape[1:])
    base, extra = divmod(rows, world_size)
    return [(base + (r < extra)) * per_row for r in range(world_size)]


def _numel_padded(shape, world_size):
    return [math.ceil(shape[0] / world_size) * math.prod(shape[1:])] * world_size


WRONG = {
    "check_ddp_accumulation_plan": [
        ("effective batch forgets the world size", {"ddp_accumulation_plan": _plan_forgets_world}),
        ("no_sync taken to mean no communication at all",
         {"ddp_accumulation_plan": _plan_no_sync_means_no_communication}),
        ("one all-reduce per backward, whatever the buckets",
         {"ddp_accumulation_plan": _plan_one_all_reduce_per_backward}),
        ("no_sync ignored", {"ddp_accumulation_plan": _plan_ignores_no_sync}),
    ],
    "check_average_gradients": [
        ("sums without dividing by the world size", {"average_gradients": _average_sums_only}),
        ("divides a new tensor bound to a local name", {"average_gradients":
                                                        _average_rebinds_a_local_name}),
        ("divides by the number of parameters", {"average_gradients":
                                                 _average_divides_by_param_count}),
        ("divides the local gradient without all-reducing", {"average_gradients":
                                                             _average_without_reducing}),
        ("all-reduces a missing gradient", {"average_gradients": _average_forgets_none}),
    ],
    "check_fsdp_local_numel": [
        ("splits the elements evenly", {"fsdp_local_numel": _numel_even_split}),
        ("splits rows like numpy.array_split", {"fsdp_local_numel": _numel_array_split}),
        ("counts the padded chunk on every rank", {"fsdp_local_numel": _numel_padded}),
    ],
}
