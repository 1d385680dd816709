"""07: data parallelism on one machine: launch ranks, accumulate with DDP ``no_sync``, shard states.

:class:`Ranks` starts ``world_size`` processes joined into one
``torch.distributed`` process group with the **gloo** backend, which runs
collectives on CPU tensors, and runs worker functions on them; :func:`launch`
does it once. It is the same code as a multi-GPU job (there the backend is NCCL
and the tensors live on GPUs), but it runs on any laptop, and on a CUDA machine
too: the workers below keep their tensors on the CPU.

Each rank is a fresh Python process that imports the worker by name, as
``torchrun`` or ``torch.multiprocessing.spawn`` workers do, so a worker must be
a function defined at module level in an importable module (such as this one),
never one defined in a notebook cell. Results come back through files; runs
have a time limit, a failing rank's traceback is reported, and closing destroys
the process group and leaves no process behind.

The workers the lecture runs:

* :func:`all_reduce_demo`: what ``all_reduce`` does to one tensor per rank;
* :func:`ddp_accumulation`: gradient accumulation under
  ``DistributedDataParallel``, with and without ``no_sync``, counting the
  all-reduces with a communication hook (:class:`AllReduceCounter`);
* :func:`sharded_states`: the model-state bytes each rank holds under DDP,
  ZeRO stage 1 (``ZeroRedundancyOptimizer``) and FSDP2 (``fully_shard``, ZeRO
  stage 3), to set against :func:`course_lib.memory.training_memory`.

References: Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training" (DDP buckets, ``no_sync``); Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"; Zhao et
al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel".
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import inspect
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from .models import GPT, GPTConfig, random_tokens

BACKEND = "gloo"
MAX_WORLD_SIZE = 16


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it), for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_importable(worker) -> tuple[str, str]:
    if not callable(worker):
        raise ValueError(f"worker must be a function, got {worker!r}")
    module, name = getattr(worker, "__module__", None), getattr(worker, "__qualname__", "")
    if (module in (None, "__main__") or "<" in name
            or getattr(sys.modules.get(module), name, None) is not worker):
        raise ValueError(
            f"worker must be a function defined at module level in an importable module "
            f"(such as course_lib.distributed.ddp_accumulation), got {name or worker!r} from "
            f"{module!r}: each rank is a fresh Python process that imports the worker by name, "
            "so functions defined in a notebook cell or inside another function cannot be used")
    return module, name


#: The longest time limit any call accepts (a day).
MAX_SECONDS = 86_400.0


def _check_seconds(name: str, value) -> float:
    if (not isinstance(value, int | float) or isinstance(value, bool) or not value > 0
            or not value <= MAX_SECONDS):
        raise ValueError(f"{name} must be a positive number of seconds, at most {MAX_SECONDS:g}, "
                         f"got {value!r}")
    return float(value)


def _serve() -> None:
    """Body of each rank's process: join the group, then run the tasks read from stdin."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = Path(os.environ["COURSE_RANKS_DIR"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    def report(name: str, outcome: dict) -> None:
        tmp = out_dir / f"{name}.tmp{rank}"
        with open(tmp, "wb") as f:
            pickle.dump(outcome, f)
        os.replace(tmp, out_dir / f"{name}_rank{rank}.pkl")  # appears complete or not at all

    try:
        timeout = datetime.timedelta(seconds=float(os.environ["COURSE_RANKS_TIMEOUT"]))
        dist.init_process_group(BACKEND, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        report("init", {"ok": False, "error": traceback.format_exc(), "when": time.time()})
        _exit(1)
    while True:
        try:
            task = pickle.load(sys.stdin.buffer)
        except EOFError:
            task = None  # the parent closed the pipe, or died
        if task is None:
            break
        try:
            worker = getattr(importlib.import_module(task["module"]), task["name"])
            outcome = {"ok": True, "result": worker(rank, world_size, **task["kwargs"])}
        except BaseException:
            outcome = {"ok": False, "error": traceback.format_exc(), "when": time.time()}
        try:
            report(f"task{task['number']}", outcome)
        except Exception:  # e.g. a result that cannot be pickled
            outcome = {"ok": False, "error": traceback.format_exc(), "when": time.time()}
            report(f"task{task['number']}", outcome)
        if not outcome["ok"]:
            # The other ranks may be stuck in a collective with this one: leave at once.
            _exit(1)
    dist.destroy_process_group()
    _exit(0)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # results are on disk; skip the slow interpreter teardown


class Ranks:
    """``world_size`` processes, one gloo process group, that run workers on request.

    ``with Ranks(2) as ranks: results = ranks.run(worker, **kwargs)`` runs
    ``worker(rank, world_size, **kwargs)`` on every rank and returns the list of
    their return values, in rank order. Each rank is a fresh Python process
    (``python -c``, like ``torchrun``'s workers) with ``MASTER_ADDR=127.0.0.1``, a
    free ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` set. The processes stay up
    between runs, so the price of starting them (importing torch, the
    rendezvous) is paid once. Tasks go to the ranks through their stdin,
    results come back as pickles in a temporary directory.

    ``timeout`` (seconds) limits each :meth:`run` (the first one includes the
    start-up) and any single collective. A run raises ``RuntimeError`` with the
    traceback (or the last output) of the rank that failed, or ``TimeoutError``;
    either way the processes are stopped and this object is closed.
    :meth:`close` (or leaving the ``with``) destroys the process group and ends
    the processes; none outlives the kernel, as each rank exits when its stdin
    closes.
    """

    def __init__(self, world_size: int = 2, *, timeout: float = 120.0):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or not (
                1 <= world_size <= MAX_WORLD_SIZE):
            raise ValueError(f"world_size must be an int from 1 to {MAX_WORLD_SIZE}, "
                             f"got {world_size!r}")
        self.world_size, self.timeout = world_size, _check_seconds("timeout", timeout)
        self._tmp = tempfile.TemporaryDirectory(prefix="course_ranks_")
        self._dir, self._tasks, self._procs, self._ended = Path(self._tmp.name), 0, [], []
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   COURSE_RANKS_DIR=self._tmp.name, COURSE_RANKS_TIMEOUT=str(self.timeout),
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # what the parent imports
        try:
            for rank in range(world_size):
                with open(self._dir / f"rank{rank}.log", "wb") as log:
                    self._procs.append(subprocess.Popen(
                        [sys.executable, "-c",
                         "from course_lib.distributed import _serve; _serve()"],
                        env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                        stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The process id of each rank."""
        return [p.pid for p in self._procs]

    @property
    def closed(self) -> bool:
        return not self._procs

    def running(self) -> list[int]:
        """Process ids of this object's rank processes that are still running (none once closed)."""
        return [p.pid for p in self._procs + self._ended if p.poll() is None]

    def _first_failure(self, paths: list[Path]) -> str | None:
        """Why the task failed: the earliest error a rank reported, else a dead rank's output."""
        if not all(path.exists() for path in paths):
            time.sleep(0.5)  # a rank died: give the others time to report what they saw
        failures = []
        for path in [*paths, *self._dir.glob("init_rank*.pkl")]:
            if path.exists():
                with open(path, "rb") as f:
                    outcome = pickle.load(f)
                if not outcome["ok"]:
                    rank = int(path.stem.rsplit("rank", 1)[1])
                    failures.append((outcome["when"], rank, outcome["error"]))
        if failures:
            _, rank, error = min(failures)  # the others may only have lost their peer
            return f"rank {rank} of {self.world_size} failed:\n{error}"
        for rank, p in enumerate(self._procs):
            if p.poll() is not None:
                log = self._dir / f"rank{rank}.log"
                tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-20:])
                return (f"rank {rank} of {self.world_size} exited with code {p.poll()} without "
                        f"a result (killed, or crashed outside Python); its last output:\n{tail}")
        return None

    def run(self, worker: Callable, *, timeout: float | None = None, **kwargs) -> list:
        """``[worker(rank, world_size, **kwargs) for each rank]``, computed on the ranks."""
        if self.closed:
            raise ValueError("these ranks are closed (after close() or a failed run); "
                             "start new ones with Ranks(...)")
        module, name = _check_importable(worker)
        limit = self.timeout if timeout is None else _check_seconds("timeout", timeout)
        try:
            task = pickle.dumps({"number": self._tasks + 1, "module": module, "name": name,
                                 "kwargs": kwargs})
        except Exception as exc:
            raise ValueError(f"the keyword arguments of {name} must be picklable: {exc}") from None
        self._tasks += 1
        paths = [self._dir / f"task{self._tasks}_rank{r}.pkl" for r in range(self.world_size)]
        try:
            for p in self._procs:
                with contextlib.suppress(BrokenPipeError):  # a dead rank is reported below
                    p.stdin.write(task)
                    p.stdin.flush()
            deadline = time.monotonic() + limit
            while not all(path.exists() for path in paths):
                if any(p.poll() is not None for p in self._procs):
                    break  # a rank died: its report, or its output, says why
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not finish on all {self.world_size} ranks "
                                       f"within {limit} s; stopped them (pass a larger timeout= "
                                       "if the work is just slow)")
                time.sleep(0.02)
            failure = self._first_failure(paths)
            if failure:
                raise RuntimeError(f"{name}: {failure}")
            outcomes = []
            for path in paths:
                with open(path, "rb") as f:
                    outcomes.append(pickle.load(f))
        except BaseException:  # includes KeyboardInterrupt: never leave ranks behind
            self.close(wait=0)
            raise
        return [o["result"] for o in outcomes]

    def close(self, wait: float = 10.0) -> None:
        """End the ranks: ask them to leave the group and exit; kill any left after ``wait`` s."""
        procs, self._procs = self._procs, []
        self._ended += procs
        for p in procs:
            with contextlib.suppress(OSError, ValueError):
                if p.poll() is None and wait > 0:
                    pickle.dump(None, p.stdin)
                p.stdin.close()
        deadline = time.monotonic() + wait
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
        self._tmp.cleanup()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_procs", None):
            self.close(wait=0)


def launch(worker: Callable, world_size: int = 2, *, timeout: float = 120.0, **kwargs) -> list:
    """Start ``world_size`` ranks, run ``worker(rank, world_size, **kwargs)`` on them, end them.

    ``Ranks(world_size, timeout=timeout).run(worker, **kwargs)`` in one call:
    the list of each rank's return value, in rank order. Errors as :class:`Ranks`.
    """
    _check_importable(worker)
    with Ranks(world_size, timeout=timeout) as ranks:
        return ranks.run(worker, **kwargs)


# --- pieces the workers use -------------------------------------------------------------------


class AllReduceCounter:
    """A DDP communication hook that counts the all-reduces (one per bucket) and their bytes.

    ``AllReduceCounter(ddp_model)`` registers itself; each call averages the
    bucket exactly as DDP's default does (``allreduce_hook``: divide by the
    world size, all-reduce the sum), so the training is unchanged.
    """

    def __init__(self, ddp_model):
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp_model, DistributedDataParallel):
            raise ValueError(f"ddp_model must be a DistributedDataParallel, "
                             f"got {type(ddp_model).__name__}")
        self.calls = 0
        self.bytes = 0
        ddp_model.register_comm_hook(self, AllReduceCounter._hook)

    def reset(self) -> None:
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

    ``all_reduce_sum(tensor)`` sums ``tensor`` over the ranks in place
    (``torch.distributed.all_reduce``'s default ``ReduceOp.SUM``). Parameters
    without a gradient (frozen, or unused) are skipped. This is what DDP does,
    one bucket of gradients at a time, overlapped with the backward pass.
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
    """All gradients of ``model`` (every parameter must have one) as one flat fp32 copy."""
    return torch.cat([p.grad.detach().flatten().float() for p in model.parameters()])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters of ``model`` as one flat fp32 tensor (a copy), in parameter order."""
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def local_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``(logical, allocated)`` bytes of this rank's part of ``tensors``.

    A sharded ``DTensor`` (FSDP2) counts its local shard. ``logical`` is
    elements times element size; ``allocated`` sums the distinct storages the
    local tensors live in, which is larger when the shards are padded (FSDP2
    pads each parameter's dim-0 chunk to the size of the largest one) or share
    a bigger buffer.
    """
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

    logical, storages = 0, {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        logical += local.numel() * local.element_size()
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return logical, sum(storages.values())


def _state_row(model: torch.nn.Module, optimizer_states: Iterable[torch.Tensor], *,
               grads: int | None = None) -> dict:
    """This rank's bytes of parameters, gradients and Adam moments: allocated, and ``logical``.

    ``grads`` overrides the allocated gradient bytes (for DDP: its buckets plus ``.grad``).
    """
    params = list(model.parameters())
    row, logical = {}, {}
    for part, tensors in (("params", params),
                          ("grads", [p.grad for p in params if p.grad is not None]),
                          ("optimizer_states", list(optimizer_states))):
        logical[part], row[part] = local_bytes(tensors)
    if grads is not None:
        row["grads"] = grads
    row["total"] = row["params"] + row["grads"] + row["optimizer_states"]
    row["logical"] = logical
    return row


def _moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's per-element states (m and v), without the scalar ``step`` counters."""
    return [v for state in optimizer.state.values() for k, v in state.items()
            if k != "step" and isinstance(v, torch.Tensor)]


def _micro_batches(config: GPTConfig, rank: int, world_size: int, micro_batch: int,
                   accum_steps: int, seed: int) -> list:
    """This rank's ``accum_steps`` micro-batches: its contiguous slice of one global batch."""
    per_rank = micro_batch * accum_steps
    x, y = random_tokens(config, world_size * per_rank, seed=seed)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return list(zip(x[mine].split(micro_batch), y[mine].split(micro_batch)))


# --- the workers ------------------------------------------------------------------------------


def all_reduce_demo(rank: int, world_size: int) -> dict:
    """Each rank holds ``[rank + 1, 10 * (rank + 1)]``: returned before and after ``all_reduce``."""
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    before = t.clone()
    dist.all_reduce(t)  # ReduceOp.SUM, in place, on every rank
    return {"rank": rank, "pid": os.getpid(), "before": before, "after": t}


def ddp_accumulation(rank: int, world_size: int, *, config: GPTConfig, micro_batch: int,
                     accum_steps: int, steps: int = 3, lr: float = 1e-2,
                     bucket_cap_mb: float = 0.1, seed: int = 0) -> dict:
    """Gradient accumulation under DDP: gradients, all-reduce counts, weights after training.

    ``config`` is a :class:`GPTConfig`. The global batch of ``world_size *
    micro_batch * accum_steps`` sequences (``random_tokens(config, ..., seed=seed)``)
    is cut into one contiguous slice per rank, each run as ``accum_steps``
    micro-batches. Returns, per variant, the flat gradient after one
    accumulation cycle and the all-reduces (calls and bytes) it made:

    * ``"no_sync"``: loss / K, all micro-batches but the last under ``no_sync()``;
    * ``"sync_every_micro_batch"``: loss / K, no ``no_sync``;
    * ``"loss_over_K_times_N"``: loss / (K * N), the mistake of averaging twice;
    * ``"loss_not_divided"``: loss / 1, the divide-by-K bug;
    * ``"manual"``: no DDP; local accumulation, then :func:`average_gradients`.

    ``"warmup_all_reduces"``: the all-reduces of a first backward, before DDP
    rebuilds its buckets. Then ``steps`` AdamW steps with ``no_sync``
    accumulation (batch ``seed + step``); ``"params_after"`` are the weights.
    ``bucket_cap_mb`` is small so that this small model is split into several
    buckets, as a large one is with the default 25 MB.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    K = accum_steps
    torch.manual_seed(seed)
    model = GPT(config)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    counter = AllReduceCounter(ddp)

    def accumulate(batches, use_no_sync: bool = True, divisor: float = K) -> None:
        for k, (x, y) in enumerate(batches):
            skip_sync = use_no_sync and k < len(batches) - 1
            with ddp.no_sync() if skip_sync else contextlib.nullcontext():
                _, loss = ddp(x, y)
                (loss / divisor).backward()

    batches = _micro_batches(config, rank, world_size, micro_batch, K, seed)
    # DDP sizes its buckets again after the first backward, in the order the gradients
    # arrived; one warm-up backward makes the counts below those of every later step.
    ddp(*batches[0])[1].backward()
    out = {"warmup_all_reduces": counter.calls}
    for name, use_no_sync, divisor in (("no_sync", True, K), ("sync_every_micro_batch", False, K),
                                       ("loss_over_K_times_N", True, K * world_size),
                                       ("loss_not_divided", True, 1)):
        ddp.zero_grad(set_to_none=True)
        counter.reset()
        accumulate(batches, use_no_sync, divisor)
        out[name] = {"grads": flat_grads(model), "all_reduces": counter.calls,
                     "bytes": counter.bytes}

    torch.manual_seed(seed)
    plain = GPT(config)
    for x, y in batches:
        (plain(x, y)[1] / K).backward()
    average_gradients(plain.parameters(), dist.all_reduce, world_size)
    out["manual"] = {"grads": flat_grads(plain)}

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        accumulate(_micro_batches(config, rank, world_size, micro_batch, K, seed + step))
        optimizer.step()
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

    Each row holds the allocated bytes (distinct storages, see :func:`local_bytes`)
    of ``params``, ``grads`` and ``optimizer_states`` (Adam's m and v, not the
    4-byte step counters), their ``total``, and the same three as ``logical``
    bytes (elements x 4). For the DDP rows ``grads`` is measured with
    :class:`course_lib.measure.LiveTensorTracker`: the bytes that DDP's
    construction (its communication buckets, ``"*_bucket_bytes"``) and the
    backward pass (``.grad``) leave allocated. ``"fsdp_rows"``: each parameter's
    full shape and local shard shape on this rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.optim import ZeroRedundancyOptimizer
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 keeps FSDP2 under _composable
        from torch.distributed._composable.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .measure import LiveTensorTracker

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
        out[name] = _state_row(model, _moments(optimizer), grads=buckets.live + backward.live)
        out[f"{name}_bucket_bytes"] = buckets.live

    model = fresh_model()
    ddp = DDP(model, gradient_as_bucket_view=True)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    one_step(ddp, zero)
    out["zero1"] = _state_row(model, _moments(zero.optim))  # .optim: this rank's local optimizer

    model = fresh_model()
    mesh = init_device_mesh("cpu", (world_size,))  # CPU tensors and gloo, also on a GPU machine
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    one_step(model, optimizer)
    out["fsdp"] = _state_row(model, _moments(optimizer))
    out["fsdp_rows"] = {n: (tuple(p.shape), tuple(p.to_local().shape))
                        for n, p in model.named_parameters()}
    return out
