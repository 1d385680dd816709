"""07: start N ranks on gloo (CPU tensors: any laptop) and collect their results.

Each rank is a fresh Python process that imports the worker by name, as ``torchrun``'s do
(``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``, the ``env://`` rendezvous of ``init_process_group``).
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

from course_lib.validation import function, number, positive_int

#: The process group's backend (CPU ranks talk over gloo), and the most ranks launched.
BACKEND = "gloo"
MAX_WORLD_SIZE = 16
#: The longest time limit any call accepts (a day).
MAX_SECONDS = 86_400.0


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it), for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_importable(worker) -> tuple[str, str]:
    """``(module, name)`` of a module-level function the ranks can import by name."""
    function("worker", worker)
    module, name = getattr(worker, "__module__", None), getattr(worker, "__qualname__", "")
    if (module in (None, "__main__") or "<" in name
            or getattr(sys.modules.get(module), name, None) is not worker):
        raise ValueError(
            f"worker must be a function defined at module level in an importable module "
            f"(such as course_lib.distributed.workers.all_reduce_demo), got {name or worker!r} from "
            f"{module!r}: each rank is a fresh Python process that imports the worker by name, "
            "so functions defined in a notebook cell or inside another function cannot be used; "
            "write the worker to a file (%%writefile my_worker.py) and import it")
    return module, name


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
    """Exit at once, the output flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # results are on disk; skip the slow interpreter teardown


class Ranks:
    """``world_size`` processes, one gloo process group, that run workers on request.

    ``ranks.run(worker, **kwargs)`` returns ``[worker(rank, world_size, **kwargs) for each
    rank]``. The processes stay up between runs, so starting them (importing torch, the
    rendezvous) is paid once; a rank imports a module again when its file has changed. A run
    raises ``RuntimeError`` with the failing rank's traceback, or ``TimeoutError`` after
    ``timeout`` seconds (which also limits any single collective); either way the ranks are
    closed. :meth:`close` (or leaving the ``with``) ends them; none outlives the kernel.
    Args:
        world_size (int): the ranks to start.
        timeout (float): the seconds a run (and any collective) may take.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """

    def __init__(self, world_size: int = 2, *, timeout: float = 120.0):
        self.world_size = world_size = positive_int("world_size", world_size,
                                                    maximum=MAX_WORLD_SIZE)
        self.timeout = number("timeout", timeout, above=0.0, maximum=MAX_SECONDS)
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
        """Process ids of this object's rank processes that are still running.
        Returns:
            list[int]: the process ids.
        """
        return [p.pid for p in self._procs + self._ended if p.poll() is None]

    def _first_failure(self, paths: list[Path]) -> str | None:
        """Why the task failed: the earliest error a rank reported, else a dead rank's output."""
        if not all(path.exists() for path in paths):
            time.sleep(0.5)  # a rank died: give the others time to report what they saw
        failures = []
        for path in [*paths, *self._dir.glob("init_rank*.pkl")]:
            if path.exists():
                outcome = pickle.loads(path.read_bytes())
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
        """``[worker(rank, world_size, **kwargs) for each rank]``: ``worker`` a module-level
        function of an importable module, ``kwargs`` picklable, ``timeout`` None: the object's.
        Args:
            worker (Callable): a module-level function of an importable module.
            timeout (float, optional): seconds (None: the object's).
            **kwargs: passed to every rank's ``worker``; picklable.
        Returns:
            list: each rank's result, by rank.
        Raises:
            ValueError: if the ranks are closed, or for a bad argument.
        """
        if self.closed:
            raise ValueError("these ranks are closed (after close() or a failed run); "
                             "start new ones with Ranks(...)")
        module, name = _check_importable(worker)
        limit = self.timeout if timeout is None else number("timeout", timeout, above=0.0,
                                                             maximum=MAX_SECONDS)
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
            outcomes = [pickle.loads(path.read_bytes()) for path in paths]
        except BaseException:  # includes KeyboardInterrupt: never leave ranks behind
            self.close(wait=0)
            raise
        return [o["result"] for o in outcomes]

    def close(self, wait: float = 10.0) -> None:
        """End the ranks: ask them to leave the group and exit; kill any left after ``wait`` s.
        Args:
            wait (float): the seconds to wait before killing.
        Raises:
            ValueError: naming the parameter, for a bad value.
        """
        number("wait", wait, minimum=0.0, maximum=MAX_SECONDS)  # before anything is forgotten
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

