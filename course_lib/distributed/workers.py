"""07: data parallelism on one machine: accumulate with DDP ``no_sync``, shard the model states.

The workers of lecture 07, run on every rank by :class:`course_lib.distributed.ranks.Ranks`
(which imports them by name in each rank's process, so they live in this
module, never in a notebook cell). They keep their tensors on the CPU, so that
they run on gloo, and give the same numbers, on any machine:

* :func:`all_reduce_demo`: what ``all_reduce`` does to one tensor per rank;
* :func:`ddp_accumulation`: gradient accumulation under
  ``DistributedDataParallel`` through the course's training loop
  (:func:`course_lib.training.loop.train`, with and without ``no_sync``), counting
  the all-reduces with a communication hook (:class:`AllReduceCounter`);
* :func:`record_steps`: runs a learner's own worker (a file the notebook wrote) on the
  ranks and records each optimizer step it takes: the gradient the step used, the
  all-reduces DDP made for it, and the weights after it; for FSDP2, what a rank held during
  the step (PyTorch's ``FSDPMemTracker``);
* :func:`sharded_states`: the model-state bytes each rank holds under DDP,
  ZeRO stage 1 (``ZeroRedundancyOptimizer``) and FSDP2 (``fully_shard``, ZeRO
  stage 3), to set against :func:`course_lib.prediction.formulas.training_memory`.

References: Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training" (DDP buckets, ``no_sync``); Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"; Zhao et
al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel".
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from course_lib.distributed.ranks import MAX_WORLD_SIZE
from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.training.loop import batches_of, train
from course_lib.units import storage_bytes

# --- pieces the workers use -------------------------------------------------------------------


class AllReduceCounter:
    """A DDP communication hook, registered on ``ddp_model``, that counts the all-reduces (one
    per bucket) in ``calls`` and their ``bytes``; it averages as DDP's ``allreduce_hook`` does."""

    def __init__(self, ddp_model):
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp_model, DistributedDataParallel):
            raise ValueError(f"ddp_model must be a DistributedDataParallel, "
                             f"got {type(ddp_model).__name__}")
        self.calls = 0
        self.bytes = 0
        ddp_model.register_comm_hook(self, AllReduceCounter._hook)

    def reset(self) -> None:
        """Set ``calls`` and ``bytes`` back to 0."""
        self.calls = self.bytes = 0

    @staticmethod
    def _hook(state: AllReduceCounter, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buffer = bucket.buffer()
        state.calls += 1
        state.bytes += buffer.numel() * buffer.element_size()
        return allreduce_hook(None, bucket)


def average_gradients(params: Iterable[torch.Tensor], all_reduce_sum: Callable,
                      world_size: int) -> None:
    """Replace each ``p.grad`` by its mean over the ranks: all-reduce the sum, divide by N.

    Parameters without a gradient (frozen, or unused) are skipped. This is what DDP does,
    one bucket of gradients at a time, overlapped with the backward pass.

    Args:
        params (iterable of torch.Tensor): the parameters (``model.parameters()``).
        all_reduce_sum (callable): ``all_reduce_sum(tensor)`` sums ``tensor`` over the ranks in
            place (``torch.distributed.all_reduce``'s default ``ReduceOp.SUM``).
        world_size (int): N, from 1 to :data:`MAX_WORLD_SIZE`.

    Raises:
        ValueError: naming ``world_size``, for a bad value.
    """
    if (not isinstance(world_size, int) or isinstance(world_size, bool)
            or not 1 <= world_size <= MAX_WORLD_SIZE):
        raise ValueError(f"world_size must be an int from 1 to {MAX_WORLD_SIZE}, "
                         f"got {world_size!r}")
    for p in params:
        if p.grad is not None:
            all_reduce_sum(p.grad)
            p.grad.div_(world_size)


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """All gradients of ``model`` as one flat fp32 copy, in parameter order.

    Args:
        model (torch.nn.Module): every parameter must have a gradient.

    Returns:
        torch.Tensor: 1-D, fp32.
    """
    return torch.cat([p.grad.detach().flatten().float() for p in model.parameters()])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters of ``model`` as one flat fp32 tensor (a copy), in parameter order.

    Args:
        model (torch.nn.Module): the model.

    Returns:
        torch.Tensor: 1-D, fp32.
    """
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


class _GradientReader(torch.optim.Optimizer):
    """An optimizer whose ``step()`` leaves the weights alone and keeps the gradient it would
    use in ``grads`` (:func:`flat_grads`); step pre-hooks run before the copy."""

    def __init__(self, model: torch.nn.Module):
        if not isinstance(model, torch.nn.Module) or not any(True for _ in model.parameters()):
            raise ValueError(f"model must be a torch.nn.Module with parameters, got {model!r}")
        super().__init__(model.parameters(), {})
        self.model, self.grads = model, None

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.grads = flat_grads(self.model)


@contextlib.contextmanager
def _gradients_scaled_by(model: torch.nn.Module, factor: float):
    """Multiply every gradient of ``model`` by ``factor`` (as the loss would be) before it reaches
    ``.grad``, hence before DDP's all-reduce."""
    handles = [p.register_hook(lambda g: g * factor) for p in model.parameters()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _local_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``(logical, allocated)`` bytes of this rank's part of ``tensors`` (a ``DTensor``'s local
    shard): elements x size, and the distinct storages, larger where FSDP2 pads a shard."""
    if isinstance(tensors, str | bytes | dict) or not hasattr(tensors, "__iter__"):
        raise ValueError(f"tensors must be an iterable of tensors, got {tensors!r}")
    tensors = list(tensors)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("tensors must be an iterable of tensors, got "
                         f"{sorted({type(t).__name__ for t in tensors})}")
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local), storage_bytes(local)


def _state_row(params: list[torch.Tensor], optimizer_states: Iterable[torch.Tensor], *,
               grads: int | None = None) -> dict:
    """This rank's bytes of parameters, gradients and Adam moments: allocated, and ``logical``.

    ``grads`` overrides the allocated gradient bytes (for DDP: its buckets plus ``.grad``).
    """
    row, logical = {}, {}
    for part, tensors in (("parameters", params),
                          ("gradients", [p.grad for p in params if p.grad is not None]),
                          ("optimizer_state", list(optimizer_states))):
        logical[part], row[part] = _local_bytes(tensors)
    if grads is not None:
        row["gradients"] = grads
    row["total"] = row["parameters"] + row["gradients"] + row["optimizer_state"]
    row["logical"] = logical
    return row


def _moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's per-element states (m and v), without the scalar ``step`` counters."""
    return [v for state in optimizer.state.values() for k, v in state.items()
            if k != "step" and isinstance(v, torch.Tensor)]


# --- the workers ------------------------------------------------------------------------------


def all_reduce_demo(rank: int, world_size: int) -> dict:
    """Each rank holds ``[rank + 1, 10 * (rank + 1)]``: returned before and after ``all_reduce``.

    Args:
        rank (int): this process's rank, from 0 to ``world_size - 1`` (given by
            :class:`course_lib.distributed.ranks.Ranks`).
        world_size (int): the number of ranks N.

    Returns:
        dict: ``rank``, ``pid``, the tensor ``before`` and ``after`` the all-reduce (the sum
        over the ranks).
    """
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    before = t.clone()
    dist.all_reduce(t)  # ReduceOp.SUM, in place, on every rank
    return {"rank": rank, "pid": os.getpid(), "before": before, "after": t}


def ddp_accumulation(rank: int, world_size: int, *, config: GPTConfig, micro_batch: int,
                     accum_steps: int, steps: int = 3, lr: float = 1e-2,
                     bucket_cap_mb: float = 0.1, seed: int = 0) -> dict:
    """Gradient accumulation under DDP through :func:`course_lib.training.loop.train`: per variant
    the flat gradient of one accumulation cycle and the all-reduces (calls, bytes) it made.

    Each rank takes its contiguous slice of a global batch of ``world_size * micro_batch *
    accum_steps`` sequences. Variants: ``"no_sync"`` (loss / K, ``no_sync()`` on all
    micro-batches but the last), ``"sync_every_micro_batch"``, ``"loss_over_K_times_N"`` (the
    mean taken twice), ``"loss_not_divided"`` (``normalize="sum-of-means"``) and ``"manual"`` (no
    DDP, then :func:`average_gradients`; ``grads`` only). Also ``"warmup_all_reduces"`` (before
    DDP rebuilds its buckets), ``"params_after"`` (``steps`` AdamW steps with ``no_sync``) and
    ``"n_params"``. ``bucket_cap_mb`` is small so that this small model fills several buckets.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    K = accum_steps
    per_rank = micro_batch * K

    def my_batch(batch_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        global_batch = random_tokens(config, world_size * per_rank, seed=batch_seed)
        return batches_of(*global_batch, per_rank)[rank]

    torch.manual_seed(seed)
    model = GPT(config)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    counter = AllReduceCounter(ddp)

    def one_cycle(net, batch, accumulation_steps: int = K, **options) -> dict:
        """One optimizer step's accumulation; its gradient and the all-reduces it made."""
        reader = _GradientReader(net)
        counter.reset()
        train(net, reader, [batch], micro_batch_size=micro_batch,
              accumulation_steps=accumulation_steps, **options)
        return {"grads": reader.grads, "all_reduces": counter.calls, "bytes": counter.bytes}

    batch = my_batch(seed)
    # DDP sizes its buckets again after the first backward, in the order the gradients
    # arrived; one warm-up backward makes the counts below those of every later step.
    first_micro_batch = batches_of(*batch, micro_batch)[0]
    out = {"warmup_all_reduces": one_cycle(ddp, first_micro_batch, 1)["all_reduces"]}
    out["no_sync"] = one_cycle(ddp, batch, no_sync=True)
    out["sync_every_micro_batch"] = one_cycle(ddp, batch)
    with _gradients_scaled_by(model, 1 / world_size):  # loss / K, then / N once more
        out["loss_over_K_times_N"] = one_cycle(ddp, batch, no_sync=True)
    out["loss_not_divided"] = one_cycle(ddp, batch, no_sync=True, normalize="sum-of-means")

    torch.manual_seed(seed)
    plain = GPT(config)
    by_hand = _GradientReader(plain)
    # What DDP does, once the micro-batches have accumulated: just before the optimizer steps.
    by_hand.register_step_pre_hook(
        lambda *_: average_gradients(plain.parameters(), dist.all_reduce, world_size))
    train(plain, by_hand, [batch], micro_batch_size=micro_batch, accumulation_steps=K)
    out["manual"] = {"grads": by_hand.grads}

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    train(ddp, optimizer, [my_batch(seed + step) for step in range(steps)],
          micro_batch_size=micro_batch, accumulation_steps=K, no_sync=True)
    out["params_after"] = flat_params(model)
    out["n_params"] = sum(p.numel() for p in model.parameters())
    return out


def sharded_states(rank: int, world_size: int, *, config: GPTConfig, micro_batch: int = 2,
                   lr: float = 1e-3, seed: int = 0) -> dict:
    """Model-state bytes on this rank after one AdamW step, four ways (fp32 throughout).

    * ``"ddp"``: ``DistributedDataParallel`` as constructed by default (ZeRO stage 0);
    * ``"ddp_grad_view"``: DDP with ``gradient_as_bucket_view=True``;
    * ``"zero1"``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer``
      (optimizer states sharded: stage 1);
    * ``"fsdp"``: FSDP2, ``fully_shard`` on each block and on the model
      (parameters, gradients and optimizer states sharded: stage 3).

    Each row holds the allocated bytes (distinct storages, larger than the ``logical`` bytes where FSDP2 pads a shard)
    of ``parameters``, ``gradients`` and ``optimizer_state`` (Adam's m and v, not the
    4-byte step counters), their ``total``, and the same three as ``logical``
    bytes (elements x 4). For the DDP rows ``gradients`` is measured with
    :class:`course_lib.measurement.memory.LiveTensorTracker`: the bytes that DDP's
    construction (its communication buckets, ``"*_bucket_bytes"``) and the
    backward pass (``.grad``) leave allocated. ``"fsdp_rows"``: each parameter's
    full shape and local shard shape on this rank.

    Args:
        rank (int): this process's rank, from 0 to ``world_size - 1`` (given by
            :class:`course_lib.distributed.ranks.Ranks`).
        world_size (int): the number of ranks N.
        config (GPTConfig): the model.
        micro_batch (int): sequences per rank in the step.
        lr (float): AdamW's learning rate.
        seed (int): seeds the model (the same on every rank) and, plus the rank, the data.

    Returns:
        dict: the four rows above, ``"n_params"`` and ``"fsdp_rows"``.
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

    # Every rank builds the same seeded model, so DDP's initial broadcast can be skipped. It
    # must be for the reading: the broadcast's flat copy of the parameters is released by
    # the communication thread a moment after the constructor returns, and was sometimes
    # still alive, counted as a second bucket, when the block ended.
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


# --- watching a learner's worker --------------------------------------------------------------

_watch: dict = {}  # this rank's recording: the steps, the counters, the hook handles


def _is_fsdp(module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


#: Groups of FSDPMemTracker's categories whose largest sum over a step :func:`record_steps`
#: keeps: the whole units gathered, the gradients on their way to the reduce-scatter, and all
#: that the rank holds besides activations, temporaries and inputs.
FSDP_GROUPS = {"gathered": ("Unsharded Param", "All Gather"),
               "unsharded gradients": ("Unsharded Grad", "Reduce Scatter"),
               "held": ("Sharded Param", "Sharded Grad", "OptState", "Buffer", "Unsharded Param",
                        "All Gather", "Unsharded Grad", "Reduce Scatter"),
               "peak": ("Total",)}


def _fsdp_tracker(root, optimizer):
    """PyTorch's ``FSDPMemTracker`` (``torch.distributed._tools``), which sorts every byte of an
    FSDP2 step into categories (sharded and unsharded parameters and gradients, all-gather and
    reduce-scatter buffers, optimizer states, activations, temporaries), keeping ``most``: the
    largest sum of each group of :data:`FSDP_GROUPS` at any moment."""
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
            counters.append(AllReduceCounter(module))
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
        if "tracker" in _watch:  # the second step's forward and backward passes are over
            tracker = _watch.pop("tracker")
            tracker.__exit__(None, None, None)
            steps[-1]["during"] = tracker.most

    def after_step(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps[-1]["params"] = torch.cat([local(p) for p in params])
        steps[-1]["states"] = _state_row(params, _moments(optimizer))
        if len(steps) == 1 and "root" in fsdp:  # watch the next step, AdamW's states made
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
    """Run ``worker`` on ``ranks`` and record every optimizer step it takes, on every rank.

    The worker is the learner's own training code (a module-level function, such as one
    in a file the notebook wrote); nothing in it changes. While it runs, hooks that
    PyTorch offers for every module and optimizer (``register_module_forward_pre_hook``,
    ``register_optimizer_step_pre_hook`` and ``..._post_hook``) watch it: each DDP model
    gets an :class:`AllReduceCounter` before its first forward pass, and each
    ``optimizer.step()`` records the gradient it is about to use, the all-reduces and
    bytes DDP sent since the previous step, and after the step the weights and the
    model-state bytes this rank holds (as in :func:`sharded_states`; a sharded
    ``DTensor`` counts its local shard). For an FSDP2 model (``fully_shard``), PyTorch's
    ``FSDPMemTracker`` watches the second step's forward and backward passes: ``during``,
    the most bytes of each group of :data:`FSDP_GROUPS` this rank held at once (to set
    against :func:`course_lib.prediction.formulas.zero3_memory`).

    Args:
        ranks (course_lib.distributed.ranks.Ranks): running ranks.
        worker (callable): as :meth:`course_lib.distributed.ranks.Ranks.run`.
        **kwargs: passed to ``worker``.

    Returns:
        list: per rank, a list with one dict per optimizer step: ``grads`` and ``params``
        (flat fp32 copies of this rank's part, in the optimizer's parameter order),
        ``all_reduces``, ``bytes`` and ``states`` (a row of :func:`sharded_states`); the
        second step of an FSDP2 model also ``during``.

    Raises:
        TypeError: naming ``ranks``, for anything but a ``Ranks``.
        ValueError: as :meth:`course_lib.distributed.ranks.Ranks.run` (closed ranks, a worker
            that cannot be imported); also its ``RuntimeError`` and ``TimeoutError``.
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
