"""07: start N ranks on gloo and collect their results.

:class:`Ranks` starts ``world_size`` processes joined into one
``torch.distributed`` process group with the **gloo** backend, which runs
collectives on CPU tensors, and runs worker functions on them. It is the same code as a multi-GPU job (there the backend is NCCL
and the tensors live on GPUs), but it runs on any laptop, and on a CUDA machine
too when the workers keep their tensors on the CPU (lecture 07's, in
:mod:`course_lib.distributed.workers`, do).

Each rank is a fresh Python process that imports the worker by name, as
``torchrun`` or ``torch.multiprocessing.spawn`` workers do, so a worker must be
a function defined at module level in an importable module (such as
:mod:`course_lib.distributed.workers`, or a file the notebook writes to its folder with
``%%writefile ddp_worker.py``: the ranks start in the notebook's working folder), never one
defined in a notebook cell. A rank imports a
module again when its file has changed since, so an edited worker runs as edited. Results
come back through files; runs have a time limit, a failing rank's traceback is
reported, and closing destroys the process group and leaves no process behind.

References: PyTorch's ``torchrun`` documentation (the ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` variables it sets)
and ``torch.distributed.init_process_group`` (the ``env://`` rendezvous).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

#: The process group's backend (CPU ranks talk over gloo), and the most ranks launched.
BACKEND = "gloo"
MAX_WORLD_SIZE = 16


def _free_port() -> int:
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
            f"(such as course_lib.distributed.workers.ddp_accumulation), got {name or worker!r} from "
            f"{module!r}: each rank is a fresh Python process that imports the worker by name, "
            "so functions defined in a notebook cell or inside another function cannot be used; "
            "write the worker to a file (%%writefile my_worker.py) and import it")
    return module, name


#: The longest time limit any call accepts (a day).
MAX_SECONDS = 86_400.0


def _check_seconds(name: str, value) -> float:
    if (not isinstance(value, int | float) or isinstance(value, bool) or not value > 0
            or not value <= MAX_SECONDS):
        raise ValueError(f"{name} must be a positive number of seconds, at most {MAX_SECONDS:g}, "
                         f"got {value!r}")
    return float(value)


def _current(module, stamps: dict):
    """``module``, imported again if its file has changed since this rank last imported it."""
    path = getattr(module, "__file__", None)
    if not path or not os.path.exists(path):
        return module
    stat = os.stat(path)
    stamp = (stat.st_mtime_ns, stat.st_size)
    if stamps.setdefault(module.__name__, stamp) != stamp:
        # The cached bytecode records the source's time in whole seconds only: an edit
        # within the same second would otherwise bring back the old code.
        with contextlib.suppress(OSError):
            os.remove(importlib.util.cache_from_source(path))
        module = importlib.reload(module)
        stamps[module.__name__] = stamp
    return module


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
    stamps = {}  # module name -> (mtime, size) of its file when this rank imported it
    while True:
        try:
            task = pickle.load(sys.stdin.buffer)
        except EOFError:
            task = None  # the parent closed the pipe, or died
        if task is None:
            break
        try:
            module = _current(importlib.import_module(task["module"]), stamps)
            worker = getattr(module, task["name"])
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

    A run raises ``RuntimeError`` with the traceback (or the last output) of the rank that
    failed, or ``TimeoutError``; either way the processes are stopped and this object is
    closed. :meth:`close` (or leaving the ``with``) destroys the process group and ends
    the processes; none outlives the kernel, as each rank exits when its stdin
    closes.

    Args:
        world_size (int): the number of ranks, from 1 to :data:`MAX_WORLD_SIZE`.
        timeout (float): seconds that limit each :meth:`run` (the first one includes the
            start-up) and any single collective; a positive number up to :data:`MAX_SECONDS`.

    Raises:
        ValueError: naming ``world_size`` or ``timeout``, for a bad value.

    Example:
        >>> from course_lib.distributed.workers import all_reduce_demo
        >>> with Ranks(2) as ranks:  # two processes: a few seconds to start
        ...     results = ranks.run(all_reduce_demo)
        >>> [r["after"].tolist() for r in results]  # each rank holds the sum of both ranks'
        [[3.0, 30.0], [3.0, 30.0]]
    """

    def __init__(self, world_size: int = 2, *, timeout: float = 120.0):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or not (
                1 <= world_size <= MAX_WORLD_SIZE):
            raise ValueError(f"world_size must be an int from 1 to {MAX_WORLD_SIZE}, "
                             f"got {world_size!r}")
        self.world_size, self.timeout = world_size, _check_seconds("timeout", timeout)
        self._tmp = tempfile.TemporaryDirectory(prefix="course_ranks_")
        self._dir, self._tasks, self._procs, self._ended = Path(self._tmp.name), 0, [], []
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   COURSE_RANKS_DIR=self._tmp.name, COURSE_RANKS_TIMEOUT=str(self.timeout),
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # what the parent imports
        try:
            for rank in range(world_size):
                with open(self._dir / f"rank{rank}.log", "wb") as log:
                    self._procs.append(subprocess.Popen(
                        [sys.executable, "-c",
                         "from course_lib.distributed.ranks import _serve; _serve()"],
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
        """True once the ranks have been ended (:meth:`close`, or a failed run)."""
        return not self._procs

    def running(self) -> list[int]:
        """Process ids of this object's rank processes that are still running (none once closed).

        Returns:
            list of int: the pids.
        """
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
        """``[worker(rank, world_size, **kwargs) for each rank]``, computed on the ranks.

        Args:
            worker (callable): a function defined at module level in an importable module (the
                ranks import it by name), called as ``worker(rank, world_size, **kwargs)``.
            timeout (float, optional): seconds for this run (None: the object's ``timeout``).
            **kwargs: passed to ``worker``; they must be picklable.

        Returns:
            list: each rank's return value, in rank order.

        Raises:
            ValueError: when the ranks are closed, ``worker`` is not an importable module-level
                function, ``timeout`` is bad or ``kwargs`` are not picklable.
            RuntimeError: with the failing rank's traceback or last output.
            TimeoutError: when the ranks do not finish within the timeout.
        """
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
        """End the ranks: ask them to leave the group and exit; kill any left after ``wait`` s.

        Args:
            wait (float): seconds to wait for the ranks to exit before killing them (0: kill at
                once), at most :data:`MAX_SECONDS`.

        Raises:
            ValueError: naming ``wait``, for a bad value (the ranks are left running, and
                reachable: close them again).
        """
        if (not isinstance(wait, int | float) or isinstance(wait, bool)
                or not 0 <= wait <= MAX_SECONDS):  # checked before anything is forgotten
            raise ValueError(f"wait must be a number of seconds from 0 to {MAX_SECONDS:g}, got "
                             f"{wait!r}")
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

