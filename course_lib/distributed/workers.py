"""07: the workers of lecture 07, run on every rank by :class:`course_lib.distributed.ranks.Ranks`.

Their tensors stay on the CPU (gloo): the same numbers anywhere. References: Li et al. 2020,
"PyTorch Distributed"; Rajbhandari et al. 2020, "ZeRO"; Zhao et al. 2023, "PyTorch FSDP".
"""

from __future__ import annotations

import gc
import inspect
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.units import storage_bytes


class _AllReduceCounter:
    """A DDP communication hook that counts the all-reduces (one per bucket) and their bytes."""

    def __init__(self, ddp_model):
        self.calls = self.bytes = 0
        ddp_model.register_comm_hook(self, _AllReduceCounter._hook)

    def reset(self) -> None:
        """Set ``calls`` and ``bytes`` back to 0."""
        self.calls = self.bytes = 0

    @staticmethod
    def _hook(state: _AllReduceCounter, bucket):
        """Count the bucket, then average it as DDP's ``allreduce_hook`` does."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buffer = bucket.buffer()
        state.calls += 1
        state.bytes += buffer.numel() * buffer.element_size()
        return allreduce_hook(None, bucket)


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """All gradients of ``model`` (each parameter must have one) as one flat fp32 copy.
    Args:
        model (torch.nn.Module): the model.
    Returns:
        torch.Tensor: 1-D, in parameter order.
    """
    return torch.cat([p.grad.detach().flatten().float() for p in model.parameters()])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters of ``model`` as one flat fp32 copy, in parameter order.
    Args:
        model (torch.nn.Module): the model.
    Returns:
        torch.Tensor: 1-D.
    """
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def _local_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``(logical, allocated)`` bytes of this rank's part of ``tensors`` (a DTensor's shard)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local), storage_bytes(local)


def _state_row(params: list[torch.Tensor], optimizer_states: Iterable[torch.Tensor], *,
               grads: int | None = None) -> dict:
    """This rank's bytes of parameters, gradients (``grads`` if given) and Adam moments."""
    row, logical = {}, {}
    for part, tensors in (("parameters", params),
                          ("gradients", [p.grad for p in params if p.grad is not None]),
                          ("optimizer_state", list(optimizer_states))):
        logical[part], row[part] = _local_bytes(tensors)
    if grads is not None:
        row["gradients"] = grads
    return dict(row, total=sum(row.values()), logical=logical)


def _moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's per-element states (m and v), without the scalar ``step`` counters."""
    return [v for state in optimizer.state.values() for k, v in state.items()
            if k != "step" and isinstance(v, torch.Tensor)]


def all_reduce_demo(rank: int, world_size: int) -> dict:
    """Each rank holds ``[rank + 1, 10 * (rank + 1)]``: its ``rank``, ``pid``, and the tensor
    ``before`` and ``after`` ``all_reduce`` (the sum over the ranks).
    Args:
        rank, world_size (int): as :class:`~course_lib.distributed.ranks.Ranks` passes them.
    Returns:
        dict: ``rank``, ``pid``, ``before``, ``after``.
    """
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    before = t.clone()
    dist.all_reduce(t)  # ReduceOp.SUM, in place, on every rank
    return {"rank": rank, "pid": os.getpid(), "before": before, "after": t}


def sharded_states(rank: int, world_size: int, *, config: GPTConfig, micro_batch: int = 2,
                   lr: float = 1e-3, seed: int = 0) -> dict:
    """Model-state bytes on this rank after one fp32 AdamW step: ``"ddp"`` (ZeRO stage 0),
    ``"ddp_grad_view"``, ``"zero1"`` (``ZeroRedundancyOptimizer``), ``"fsdp"`` (FSDP2, stage 3).

    Each row: allocated ``parameters``, ``gradients`` (for DDP, its buckets, ``"*_bucket_bytes"``,
    and ``.grad``), ``optimizer_state`` (Adam's m and v), their ``total``, and the three as
    ``logical`` bytes (no FSDP2 padding). ``"fsdp_rows"``: each parameter's full and shard shape.
    Args:
        rank, world_size (int): as :class:`~course_lib.distributed.ranks.Ranks` passes them.
        config (GPTConfig): the model.
        micro_batch, seed (int): sequences per step; the model's seed (the data's: seed + rank).
        lr (float): AdamW's learning rate.
    Returns:
        dict: a row per setting, ``"n_params"``, the bucket bytes and ``"fsdp_rows"``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.optim import ZeroRedundancyOptimizer
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 keeps FSDP2 under _composable
        from torch.distributed._composable.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.measurement.memory import LiveTensorTracker

    x, y = random_tokens(config, micro_batch, seed=seed + rank)  # each rank its own data

    def fresh_model() -> GPT:
        torch.manual_seed(seed)
        return GPT(config)

    def one_step(model, optimizer) -> None:
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()

    # Every rank builds the same seeded model, so DDP's initial broadcast can be skipped. It must
    # be: its flat copy of the parameters, freed by the communication thread a moment after the
    # constructor returns, was sometimes still alive and counted as a second bucket.
    no_init_sync = ({"init_sync": False}
                    if "init_sync" in inspect.signature(DDP.__init__).parameters else {})

    out = {"n_params": sum(p.numel() for p in fresh_model().parameters())}
    for name, as_view in (("ddp", False), ("ddp_grad_view", True)):
        model = fresh_model()
        with LiveTensorTracker() as buckets:
            ddp = DDP(model, gradient_as_bucket_view=as_view, **no_init_sync)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        with LiveTensorTracker() as backward:
            ddp(x, y)[1].backward()  # keeps nothing of the forward pass alive
            # What the pass left in reference cycles would otherwise go whenever Python's
            # collector runs, and a gradient-sized buffer was sometimes still counted.
            gc.collect()
        optimizer.step()
        out[name] = _state_row(list(model.parameters()), _moments(optimizer),
                               grads=buckets.live + backward.live)
        out[f"{name}_bucket_bytes"] = buckets.live

    model = fresh_model()
    ddp = DDP(model, gradient_as_bucket_view=True)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    one_step(ddp, zero)
    out["zero1"] = _state_row(list(model.parameters()), _moments(zero.optim))  # .optim: this rank's local optimizer

    model = fresh_model()
    mesh = init_device_mesh("cpu", (world_size,))  # CPU tensors and gloo, also on a GPU machine
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    one_step(model, optimizer)
    out["fsdp"] = _state_row(list(model.parameters()), _moments(optimizer))
    out["fsdp_rows"] = {n: (tuple(p.shape), tuple(p.to_local().shape))
                        for n, p in model.named_parameters()}
    return out


_watch: dict = {}  # this rank's recording: the steps, the counters, the hook handles


def _is_fsdp(module) -> bool:
    """Whether ``module`` is an FSDP2 module (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


#: Groups of FSDPMemTracker's categories whose largest sum over a step :func:`record_steps`
#: keeps: all that the rank holds besides activations, temporaries and inputs, and parts of it.
FSDP_GROUPS = {"gathered": ("Unsharded Param", "All Gather"),
               "unsharded gradients": ("Unsharded Grad", "Reduce Scatter"),
               "held": ("Sharded Param", "Sharded Grad", "OptState", "Buffer", "Unsharded Param",
                        "All Gather", "Unsharded Grad", "Reduce Scatter"),
               "peak": ("Total",)}


def _fsdp_tracker(root, optimizer):
    """PyTorch's ``FSDPMemTracker``, keeping the largest sum of each group of :data:`FSDP_GROUPS`."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Tracker(FSDPMemTracker):
        most = dict.fromkeys(FSDP_GROUPS, 0)

        def _update_snap(self, *args, **kwargs):  # at every allocation and free
            super()._update_snap(*args, **kwargs)
            snap: dict = {}  # every device's categories (the ranks run on gloo: the CPU)
            for per_device in self._curr_mem_snap.values():
                for k, v in per_device.items():
                    snap[getattr(k, "value", k)] = snap.get(getattr(k, "value", k), 0) + v
            self.most = {group: max(self.most[group], sum(snap.get(c, 0) for c in categories))
                         for group, categories in FSDP_GROUPS.items()}

    return Tracker(root, optimizer)


def _start_watching(rank: int, world_size: int) -> None:
    """On this rank, record every optimizer step from now on (see :func:`record_steps`)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    counters, steps, seen, fsdp = [], [], set(), {}

    def count_all_reduces(module, args):
        # Before a DDP model's first forward pass, hence before any backward pass.
        if isinstance(module, DDP) and id(module) not in seen:
            seen.add(id(module))
            counters.append(_AllReduceCounter(module))
        if "root" not in fsdp and _is_fsdp(module):  # the root's forward is the first to run
            fsdp["root"] = module

    def local(t):  # a sharded DTensor (FSDP2): this rank's shard
        return (t.to_local() if hasattr(t, "to_local") else t).detach().flatten().float()

    def before_step(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps.append({"grads": torch.cat([local(p.grad) for p in params]),
                      "all_reduces": sum(c.calls for c in counters),
                      "bytes": sum(c.bytes for c in counters)})
        for c in counters:
            c.reset()
        if "tracker" in _watch:  # this step's forward and backward passes are over
            tracker = _watch.pop("tracker")
            tracker.__exit__(None, None, None)
            steps[-1]["during"] = tracker.most

    def after_step(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps[-1]["params"] = torch.cat([local(p) for p in params])
        steps[-1]["states"] = _state_row(params, _moments(optimizer))
        if "root" in fsdp:  # watch the next step: AdamW's states exist from now on
            _watch["tracker"] = _fsdp_tracker(fsdp["root"], optimizer).__enter__()

    _watch.update(steps=steps, handles=[
        torch.nn.modules.module.register_module_forward_pre_hook(count_all_reduces),
        register_optimizer_step_pre_hook(before_step),
        register_optimizer_step_post_hook(after_step)])


def _stop_watching(rank: int, world_size: int) -> list[dict]:
    """Remove the hooks of :func:`_start_watching`; the steps it recorded on this rank."""
    if "tracker" in _watch:  # the worker stopped before a second step
        _watch.pop("tracker").__exit__(None, None, None)
    for handle in _watch.pop("handles", []):
        handle.remove()
    return _watch.pop("steps", [])


def record_steps(ranks, worker: Callable, **kwargs) -> list[list[dict]]:
    """Run ``worker`` (the learner's own code, left as it is) on ``ranks``; record every
    ``optimizer.step()`` on every rank through PyTorch's global module and optimizer hooks.

    Per rank, one dict per step: ``grads`` used, ``all_reduces`` and ``bytes`` DDP sent since the
    last step, ``params`` after it (flat fp32, this rank's shard), ``states`` (a row of
    :func:`sharded_states`); for FSDP2, from the second step on, ``during``: the most bytes of
    each group of :data:`FSDP_GROUPS` held at once (to set against ``formulas.zero3_memory``).
    Take the least over steps: gloo may free an all-gather buffer from its own thread after the
    next unit is gathered, and that step then counts a unit twice.
    Args:
        ranks (Ranks): the ranks to run on.
        worker (Callable): as :meth:`~course_lib.distributed.ranks.Ranks.run` takes it.
        **kwargs: passed to ``worker``.
    Returns:
        list[list[dict]]: per rank, one dict per step.
    """
    from course_lib.distributed.ranks import Ranks

    if not isinstance(ranks, Ranks):
        raise TypeError(f"ranks must be a course_lib.distributed.ranks.Ranks, got {ranks!r}")
    ranks.run(_start_watching)
    try:
        ranks.run(worker, **kwargs)
    finally:
        if not ranks.closed:
            steps = ranks.run(_stop_watching)
    return steps
