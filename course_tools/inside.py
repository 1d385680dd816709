"""The grader's code that runs inside a submission's sandbox (not imported by the grader).

Run as ``python -I inside.py (run|judge) JOB.json FD``. ``JOB.json`` says what to run and the
limits; ``FD`` is the write end of a pipe the grader opened, the only channel back to it: one
JSON object per line. Nothing here trusts the submission. Before any of its code runs, this
process applies the resource limits (inherited by everything it starts), makes itself
non-dumpable (so that the learner's processes, running as the same user, cannot open its
``/proc/PID/fd`` or ``/proc/PID/mem``) and marks the pipe non-inheritable.

* ``run``: execute the learner's notebook in a fresh kernel, cell by cell, with a time limit
  per cell (the kernel is interrupted) and a cap on the output kept per cell and per notebook
  (the rest is dropped and noted). It reports each cell's start and end, then the executed
  notebook. The grader uses this only to tell the learner how their notebook ran; no point
  depends on it.
* ``judge``: the checks' verdicts. ``course_lib.grading`` is imported from the run's pristine
  copy before anything of the learner's exists in this process. The *learner's root process*,
  a child that closes every descriptor but its sockets to the checks, then runs the notebook's
  code cells once, in order, in an IPython shell, as Jupyter does (magics included; a cell that
  raises does not stop the next; outside the exercise cells, statements that call a check are
  left out, their verdicts come from the checkers; cells after the last check's cell do not run).
  Before each check's cell it forks that check's *learner process*, which keeps the names as
  the check cell saw them and answers calls. For each check, a *checker* is forked from this
  process (no learner code has run in it, none ever will); the kernel tells it which process
  greets it on its socket; the check calls the learner's functions over that socket and gets
  plain values back (``ipc.py``); if it passes, the cases the grader draws (``drawn.py`` in the
  job, held open by the judge and removed by the grader before any learner code runs) are tried
  with a seed taken after the learner's process started. Time limits count CPU seconds of this
  process's descendants (it is their subreaper, so detached ones count too), with a wall-clock
  backstop of ``wall_backstop`` times the limit: ``timeout`` for the learner's cells
  (``cell_timeout`` each, interrupted as Jupyter's interrupt does), ``cell_timeout`` per check;
  the checker, and the learner's process with it, are killed at the limit. A verdict per check
  is forwarded.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import sys
import time
import types

COURSE = os.environ.get("COURSE_GRADER_COURSE", "/course")
PASS, FAIL, TODO = "✓", "✗", "…"


def _ipc():
    """``ipc.py``: beside this file in the sandbox (run as a script), else the package's."""
    if __package__:
        from . import ipc
    else:
        import ipc
    return ipc


def _send(fd: int, obj: dict) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _apply_limits(limits: dict) -> None:
    for name, key in (("RLIMIT_AS", "memory_bytes"), ("RLIMIT_NPROC", "processes"),
                      ("RLIMIT_FSIZE", "file_bytes"), ("RLIMIT_CPU", "cpu_seconds")):
        value = limits.get(key)
        if value and hasattr(resource, name):
            resource.setrlimit(getattr(resource, name), (int(value), int(value)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _non_dumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): other processes of this user can no longer read our fds/memory."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except Exception:  # not Linux: the sandbox is what protects us there
        pass


#: keyctl's number per machine (``<asm/unistd.h>``), for the call below.
_KEYCTL = {"x86_64": 250, "aarch64": 219}


def _own_session_keyring() -> None:
    """keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL): this process and all it starts leave the
    grader's session keyring (its keys, readable by the grader's uid) for a new, empty one.
    The sandbox's seccomp filter allows this call and no other key operation."""
    import platform

    if sys.platform != "linux" or platform.machine() not in _KEYCTL:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_KEYCTL[platform.machine()], 1, None) == -1:
        errno = ctypes.get_errno()
        if errno != 38:  # ENOSYS: a kernel without keyrings has none to leave
            raise OSError(errno, "could not leave the grader's session keyring")


def _subreaper() -> None:
    """prctl(PR_SET_CHILD_SUBREAPER, 1): processes the learner's code detaches stay below the
    judge, whose limits count their CPU time."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except Exception:  # not Linux: wall-clock limits there
        pass


def _dumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 1): the learner's process (forked from the non-dumpable judge)
    lets the checker, the same user, reset and read its ``/proc/PID/clear_refs`` and ``status``;
    it holds nothing of the grader's. Should its code undo this, the checks that measure its
    memory fail."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)
    except Exception:
        pass


# --- run: the learner's notebook in a kernel ------------------------------------------------


#: Run in the kernel before the learner's cells, within the start-up allowance: cut what a cell
#: prints beyond the caps, in the kernel itself, so that a cell printing without end does not
#: flood the runner (the learner can undo it; the runner's own cap, twice as large, still
#: holds), and import torch and the checks, so that the notebook's first cell does not spend its
#: time limit importing them.
KERNEL_CAP = """
def _course_grader_cap(cell_cap, total_cap, note):
    import sys
    state = {"cell": 0, "total": 0, "cut": False}

    def reset(*args, **kwargs):
        state["cell"], state["cut"] = 0, False

    get_ipython().events.register("pre_run_cell", reset)
    for stream in (sys.stdout, sys.stderr):
        def capped(text, _write=stream.write):
            size = len(text)
            if state["cell"] + size > cell_cap or state["total"] + size > total_cap:
                if not state["cut"]:
                    state["cut"] = True
                    _write(note)
                return size
            state["cell"] += size
            state["total"] += size
            return _write(text)
        stream.write = capped


_course_grader_cap(CELL_CAP, TOTAL_CAP, NOTE)
del _course_grader_cap
try:  # warm up: the notebook's first import should not eat its cell's time limit
    import torch as _torch
    import course_lib.grading as _grading
    del _torch, _grading
except Exception:
    pass
"""


def run_notebook(job: dict, fd: int) -> None:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    cell_cap, notebook_cap = job["cell_output_bytes"], job["notebook_output_bytes"]
    cell_timeout = job["cell_timeout"]
    state = {"cell": None, "cell_bytes": 0, "total": 0, "cut": set()}
    note = (f"\n[output cut by the grader: at most {cell_cap:,} characters per cell and "
            f"{notebook_cap:,} per notebook are kept]\n")

    class CappedClient(NotebookClient):
        """Keeps at most twice the caps of output (the kernel itself cuts at the caps)."""

        def process_message(self, msg, cell, cell_index):
            kind = msg.get("msg_type", "")
            if kind in ("status", "execute_input"):
                return super().process_message(msg, cell, cell_index)
            if state["cell"] != cell_index:
                state.update(cell=cell_index, cell_bytes=0)
            content = msg.get("content", {})
            text = content.get("text") if kind == "stream" else None
            size = len(text) if isinstance(text, str) else len(json.dumps(content, default=str))
            if (state["cell_bytes"] + size > 2 * cell_cap
                    or state["total"] + size > 2 * notebook_cap):
                if cell_index not in state["cut"]:
                    state["cut"].add(cell_index)
                    cell.outputs.append(nbformat.v4.new_output("stream", name="stderr",
                                                               text=note))
                return None
            state["cell_bytes"] += size
            state["total"] += size
            return super().process_message(msg, cell, cell_index)

    nb = nbformat.read(job["notebook"], as_version=4)
    workdir = os.environ.get("HOME", "/tmp")
    client = CappedClient(nb, timeout=cell_timeout, interrupt_on_timeout=True, allow_errors=True,
                          kernel_name="python3", record_timing=False, startup_timeout=120,
                          resources={"metadata": {"path": workdir}})
    client.reset_execution_trackers()
    count = 0
    with client.setup_kernel(stdout=open(os.devnull, "wb"), stderr=open(os.devnull, "wb")):
        code = KERNEL_CAP.replace("CELL_CAP", str(cell_cap)).replace(
            "TOTAL_CAP", str(notebook_cap)).replace("NOTE", repr(note))
        setup = client.kc.execute(code, silent=True, store_history=False)
        client.wait_for_reply(setup)
        _send(fd, {"event": "ready"})
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            count += 1
            _send(fd, {"event": "cell", "index": index})
            start = time.monotonic()
            try:
                client.execute_cell(cell, index, execution_count=count)
            except DeadKernelError:
                _send(fd, {"event": "dead", "index": index})
                break
            if any(note.strip() in str(o.get("text", "")) for o in cell.outputs):
                state["cut"].add(index)
            _send(fd, {"event": "cell_done", "index": index,
                       "timed_out": time.monotonic() - start >= cell_timeout,
                       "cut": index in state["cut"]})
    text = nbformat.writes(nb)
    if len(text) <= job["notebook_bytes"]:
        _send(fd, {"event": "notebook", "text": text})
    _send(fd, {"event": "end", "cut": sorted(state["cut"])})


# --- judge: the checks' verdicts -------------------------------------------------------------


def _calls_check(node) -> bool:
    """Whether a statement calls a check (``grading.check_NAME(...)``); a definition does not."""
    import ast

    return not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and n.func.attr.startswith("check_") for n in ast.walk(node))


def _shell():
    """An IPython shell, as a Jupyter kernel runs cells (magics, ``get_ipython()``, the display
    hook, ``In`` and ``Out``), writing no history file; with an AST transformer that, while
    ``.skip_checks`` is set, leaves out the statements that call a check (their verdicts come
    from the checkers)."""
    import ast

    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    class Shell(InteractiveShell):
        def enable_gui(self, gui=None):  # %matplotlib inline: figures drawn for no one
            pass

        def ask_exit(self):  # exit() in a cell restarts a kernel; the cells go on here
            pass

    class WithoutCheckCalls(ast.NodeTransformer):
        def visit_Module(self, node):
            if shell.skip_checks:
                node.body = [s for s in node.body if not _calls_check(s)]
            return node

    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "nocolor"
    shell = Shell.instance(config=config)
    shell.skip_checks = False
    shell.ast_transformers.append(WithoutCheckCalls())
    return shell


def _interrupt(signum, frame):
    raise KeyboardInterrupt("the cell ran past the cell time limit")


def _run_cell(shell, source: str, seconds: float, backstop: float):
    """Run one cell as Jupyter does, interrupted (``KeyboardInterrupt``) after ``seconds`` of
    this process's CPU time or ``backstop`` times that in wall-clock time; its error or None."""
    try:
        try:
            signal.setitimer(signal.ITIMER_PROF, seconds)
            signal.setitimer(signal.ITIMER_REAL, seconds * backstop)
            result = shell.run_cell(source, store_history=True)  # In, Out, _ as in Jupyter
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as exc:  # an interrupt that landed outside the cell's own code
        return exc
    return result.error_before_exec or result.error_in_exec


def _checkpoint(cells: list[dict], item: dict) -> int:
    """The cell before which a check reads the learner's names, as its check cell did in
    Jupyter: the check cell (by its nbgrader id, else the last cell other than an exercise cell
    that calls the check), or the end of the notebook if there is none."""
    import re

    for index, cell in enumerate(cells):
        if cell.get("id") is not None and cell.get("id") == item["id"] and not cell["full"]:
            return index
    call = re.compile(rf"\.check_{re.escape(item['name'])}\s*\(")
    found = [i for i, c in enumerate(cells) if not c["full"] and call.search(c["source"])]
    return found[-1] if found else len(cells)


class _CappedText:
    """A text stream that keeps the last ``limit`` characters written to it (the check's own
    verdict line comes last)."""

    def __init__(self, limit: int):
        self.limit, self.text = limit, ""

    def write(self, text) -> int:
        text = str(text)
        self.text = (self.text + text[-self.limit:])[-self.limit:]
        return len(text)

    def flush(self) -> None:
        pass

    def getvalue(self) -> str:
        return self.text


def _learner_root(ends: list, points: list[int], job: dict) -> None:
    """The learner's root process (a child of the judge): every descriptor but its sockets to
    the checks closed before any of the learner's code runs; runs the notebook's code cells once,
    in order, in an IPython shell, as Jupyter does (a cell that raises does not stop the next;
    each is interrupted at the cell time limit); and before check ``k``'s cell (``points[k]``),
    forks that check's learner process, which keeps the names defined so far and answers its
    calls on ``ends[k]``. Cells after the last check's cell do not run: no check saw them."""
    ipc = _ipc()

    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    start = 3
    for number in sorted(s.fileno() for s in ends):
        os.closerange(start, number)
        start = number + 1
    os.closerange(start, 65536)
    _dumpable()  # the checker reads and resets its learner process's peak memory (/proc/PID)
    cpu = int(job["timeout"]) + 2
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard == resource.RLIM_INFINITY or hard > cpu:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    cells, first_error = job["cells"], ""
    try:
        for number in (signal.SIGPROF, signal.SIGALRM):
            signal.signal(number, _interrupt)
        shell = _shell()
        last = max(points, default=0)
        for index in range(last + 1):
            for k, point in enumerate(points):
                if point == index:
                    _fork_learner(ends, k, shell.user_ns, first_error)
            if index == last:
                break
            shell.skip_checks = not cells[index]["full"]
            error = _run_cell(shell, cells[index]["source"], job["cell_timeout"],
                              job["wall_backstop"])
            if error is not None and cells[index]["full"] and not first_error:
                reply = ipc._error_reply(error)
                first_error = f"your exercise cell raised {reply['type']}: {reply['message']}"
    finally:
        os._exit(0)


def _fork_learner(ends: list, k: int, namespace: dict, first_error: str) -> None:
    """Check ``k``'s learner process: a fork of the root's state now, greeting its checker
    (which learns its process id from the kernel), then answering calls."""
    ipc = _ipc()

    if os.fork() == 0:
        try:
            for other, sock in enumerate(ends):
                if other != k and sock is not None:
                    sock.close()
            ipc.greet(ends[k])
            ipc.Learner(ends[k], namespace, first_error).serve()
        finally:
            os._exit(0)
    ends[k].close()
    ends[k] = None


def _load_drawn(drawn_fd: int):
    """The grader's drawn cases (``hidden.py``), read from a descriptor the learner's process
    never had: the file itself is removed before any learner code runs."""
    if drawn_fd < 0:
        return None
    parts, offset = [], 0
    while True:
        chunk = os.pread(drawn_fd, 1 << 20, offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
    module = types.ModuleType("course_grader_drawn")
    exec(compile(b"".join(parts), "<the grader's drawn cases>", "exec"), vars(module))
    return module


def _drawn_verdict(draw, values, checker) -> tuple[str, str]:
    """Try the learner's function on cases drawn now, from a seed the learner's process cannot
    know (it was started before the seed existed)."""
    import random

    ipc = _ipc()

    from course_lib import grading

    rng = random.Random(int.from_bytes(os.urandom(16), "big"))
    try:
        draw(*values, rng)
    except grading.CheckFailed as exc:
        return "failed", exc.message + (f". Hint: {exc.hint}" if exc.hint else "")
    except ipc.LearnerProcessEnded:
        return "crashed", "the process running your code died"
    except BaseException as exc:  # the learner's code may raise anything
        if checker.ended:
            return "crashed", "the process running your code died"
        return "failed", f"your code raised {grading._describe(exc)} on a case drawn by the grader"
    return "passed", ""


def _run_check(check, name: str, args: list[str], mine, fd: int, limits: dict,
               drawn_fd: int, missing: dict) -> None:
    """In the forked checker (no learner code has run in it, none ever will): greet the
    check's learner process, call the check with the learner's functions as proxies, report,
    exit. ``missing`` is the verdict where that process was never started (the notebook's run
    ended before the check's cell)."""
    import traceback

    ipc = _ipc()

    learner = None
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(null, target)
        keep = sorted({fd, drawn_fd, mine.fileno()} - {-1})
        start = 3
        for number in keep:
            os.closerange(start, number)
            start = number + 1
        os.closerange(start, 65536)
        cpu = int(limits["cell_timeout"]) + 2
        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if hard == resource.RLIM_INFINITY or hard > cpu:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        try:
            learner = ipc.greeted(mine)
        except ipc.LearnerProcessEnded:
            _send(fd, missing)
            os._exit(0)
        _send(fd, {"learner": learner})
        checker = ipc.Checker(mine, learner)
        values = [checker.function(source) for source in args]
        out = _CappedText(1 << 16)
        sys.stdout = sys.stderr = out
        result = check(*values)
        text = out.getvalue()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        lines = [line.strip() for line in text.splitlines()]
        mine_lines = [line for line in lines if line.split(":", 1)[0] in
                      (f"{mark} {name}" for mark in (PASS, FAIL, TODO))]
        if checker.ended:
            why = _ended(learner)
            status, detail = "crashed", "the process running your code died" + (
                f" ({why})" if why else "")
        elif result is True:
            drawn = _load_drawn(drawn_fd)
            draw = drawn.CASES.get(name) if drawn is not None else None
            status, detail = "passed", ""
            if draw is not None:
                status, detail = _drawn_verdict(draw, values, checker)
        elif any(line.startswith(TODO) for line in mine_lines):
            status, detail = "not done", ""
        else:
            status = "failed"
            detail = next((line.split(":", 1)[1].strip() for line in mine_lines
                           if line.startswith(FAIL)), "")
        _send(fd, {"status": status, "detail": detail})
    except BaseException as exc:
        try:
            where = traceback.format_exception_only(type(exc), exc)[-1].strip()
            _send(fd, {"status": "error", "detail": where})
        except BaseException:
            pass
    if learner:
        try:
            os.kill(learner, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)


# Time: what the judge's descendants used, from /proc (Linux), so that a loaded machine does not
# count against a learner; the sandbox's cgroup, read by the grader, bounds the whole.

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields from the third (the state) on."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2:].split()


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def _descendants(root: int) -> list[int]:
    found, stack = [], [root]
    while stack:
        try:
            children = _children(stack.pop())
        except (OSError, ValueError):
            continue
        found += children
        stack += children
    return found


def _tree_cpu(root: int) -> float | None:
    """CPU seconds of ``root``'s descendants (a subreaper: orphans stay below it), alive or
    reaped; None where /proc does not say."""
    try:
        total = sum(int(x) for x in _stat(root)[13:15])  # what it reaped
        _children(root)
    except (OSError, ValueError, IndexError):
        return None
    for pid in _descendants(root):
        try:
            total += sum(int(x) for x in _stat(pid)[11:15])  # its own, and what it reaped
        except (OSError, ValueError, IndexError):
            pass  # it ended and was reaped meanwhile: counted with its parent
    return total / _TICKS


def _ended(pid) -> str:
    """Why process ``pid`` (not this process's child) ended, read from its zombie's status."""
    for _ in range(50):
        try:
            fields = _stat(pid)
            if fields[0] == "Z":
                status = int(fields[49])
                return (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                        else f"exit status {os.waitstatus_to_exitcode(status)}")
        except (OSError, ValueError, IndexError, TypeError):
            return ""
        time.sleep(0.01)
    return ""


class _Clock:
    """A time limit: CPU seconds of the judge's descendants where /proc tells them, with a
    wall-clock backstop of ``backstop`` times the limit (for code that sleeps); wall-clock
    seconds where it does not."""

    def __init__(self, seconds: float, backstop: float):
        self.seconds, self.start = seconds, _tree_cpu(os.getpid())
        self.wall = time.monotonic() + seconds * (backstop if self.start is not None else 1)

    def expired(self) -> bool:
        if time.monotonic() >= self.wall:
            return True
        return self.start is not None and (
            (_tree_cpu(os.getpid()) or self.start) - self.start >= self.seconds)


def _kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and its descendants, if it is one of this process's descendants."""
    if pid not in _descendants(os.getpid()):
        return
    for target in [pid, *_descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass


def _wait_check(pid: int, read_fd: int, job: dict) -> dict:
    """The checker's verdict; it and its learner's process are killed once it is in, or at the
    check's time limit (``cell_timeout`` CPU seconds, see :class:`_Clock`)."""
    clock, limit = _Clock(job["cell_timeout"], job["wall_backstop"]), job["message_chars"] * 4
    data, learner, result = b"", None, None
    while result is None:
        if clock.expired():
            result = {"status": "timeout", "detail": "stopped at the cell time limit"}
            break
        ready, _, _ = select.select([read_fd], [], [], 0.1)
        if not ready:
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:
            _, status = os.waitpid(pid, 0)
            pid = 0
            why = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exit status {os.waitstatus_to_exitcode(status)}")
            result = {"status": "crashed", "detail": f"the check's process died ({why})"}
            break
        data += chunk
        while b"\n" in data and result is None:
            line, data = data.split(b"\n", 1)
            try:
                message = json.loads(line[:limit])
                if not isinstance(message, dict):
                    raise ValueError
            except ValueError:
                message = {"status": "error", "detail": "the check's process sent garbage"}
            if isinstance(message.get("learner"), int) and "status" not in message:
                learner = message["learner"]
            else:
                result = message
        if result is None and len(data) > limit:
            result = {"status": "error", "detail": "the check's process sent garbage"}
    if pid:
        for target in (-pid, pid):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        os.waitpid(pid, 0)
    if learner is not None:
        _kill_tree(learner)
    os.close(read_fd)
    return result


def _discover(cells: list[dict], checks: dict, canonical: dict) -> list[dict]:
    """The checks the learner's own check cells call (for a notebook solutions/ cannot match),
    each with the arguments solutions/ gives it (never the notebook's own)."""
    import ast

    from IPython.core.inputtransformer2 import TransformerManager

    found, seen = [], set()
    for cell in cells:
        try:
            tree = ast.parse(TransformerManager().transform_cell(cell["source"]))
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in checks and node.func.attr not in seen):
                name = node.func.attr.removeprefix("check_")
                if name not in canonical:
                    continue
                seen.add(node.func.attr)
                found.append({"id": f"cell-check-{name}", "name": name,
                              "args": list(canonical[name])})
    return found


def judge(job: dict, fd: int) -> None:
    from course_lib import grading

    ipc = _ipc()
    _subreaper()
    checks = dict(grading.CHECKS)
    drawn_fd = -1
    drawn = os.path.join(job.get("job_dir", ""), "drawn.py")
    if job.get("job_dir") and os.path.exists(drawn):
        drawn_fd = os.open(drawn, os.O_RDONLY)  # the grader removes the file once we are ready
        os.set_inheritable(drawn_fd, False)
    _send(fd, {"event": "ready"})
    if drawn_fd >= 0:  # no learner code runs before the grader has removed the file
        deadline = time.monotonic() + 60
        while os.path.exists(drawn):
            if time.monotonic() > deadline:
                raise RuntimeError("the grader did not remove the drawn cases from the job")
            time.sleep(0.01)
    if job.get("discover"):
        job["checks"] = _discover(job["cells"], checks, job.get("canonical", {}))
        _send(fd, {"event": "checks", "checks": job["checks"]})
    plan = []  # (item, its check or None, the verdict where it cannot run)
    for item in job["checks"]:
        check = checks.get(f"check_{item['name']}")
        if check is None:
            plan.append((item, None, {"status": "error",
                                      "detail": "no such check in course_lib.grading"}))
        elif not all(isinstance(a, str) and a.isidentifier() for a in item["args"]):
            plan.append((item, None, {"status": "error", "detail": "a check is given the "
                                      "notebook's functions by name only"}))
        else:
            plan.append((item, check, None))
    pairs = {i: socket.socketpair() for i, (_, check, _) in enumerate(plan) if check is not None}
    for mine, _ in pairs.values():
        ipc.passcred(mine)  # the kernel names the process that greets the checker
    missing = _run_program(job, fd, [(pairs[i], plan[i][0]) for i in sorted(pairs)])
    for i, (item, check, result) in enumerate(plan):
        if check is not None:
            mine = pairs[i][0]
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)
                os.close(read_fd)
                _run_check(check, item["name"], item["args"], mine, write_fd, job, drawn_fd,
                           missing)
            os.close(write_fd)
            mine.close()
            result = _wait_check(pid, read_fd, job)
        status = result.get("status") if isinstance(result.get("status"), str) else "error"
        detail = result.get("detail") if isinstance(result.get("detail"), str) else ""
        _send(fd, {"event": "check", "id": item["id"], "status": status,
                   "detail": detail[: job["message_chars"]]})
    _send(fd, {"event": "end"})


def _run_program(job: dict, fd: int, checks: list) -> dict:
    """Run the learner's cells once, in the learner's root process (``checks``: ``[((the
    checker's socket, the learner's), item)]``), within the notebook time limit (``timeout``
    CPU seconds, see :class:`_Clock`). Returns the verdict of a check whose cell the run never
    reached."""
    if not checks:
        return {}
    points = [_checkpoint(job["cells"], item) for _, item in checks]
    _send(fd, {"event": "program"})
    pid = os.fork()
    if pid == 0:
        for (mine, _), _ in checks:
            mine.detach()  # the checkers' ends: closed below with every other descriptor
        _learner_root([theirs for (_, theirs), _ in checks], points, job)
    for (_, theirs), _ in checks:
        theirs.close()
    clock = _Clock(job["timeout"], job["wall_backstop"])
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            why = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exit status {os.waitstatus_to_exitcode(status)}")
            missing = {"status": "crashed", "detail": f"the process running your notebook "
                                                      f"ended ({why}) before this check's cell"}
            break
        if clock.expired():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            missing = {"status": "timeout", "detail": "your notebook's cells ran past the "
                       "notebook time limit before this check's cell"}
            break
        time.sleep(0.05)
    _send(fd, {"event": "program_done"})
    return missing


def main(argv: list[str]) -> None:
    command, job_path, fd = argv[1], argv[2], int(argv[3])
    os.set_inheritable(fd, False)
    _own_session_keyring()
    _non_dumpable()
    with open(job_path) as f:
        job = json.load(f)
    job["job_dir"] = os.path.dirname(os.path.abspath(job_path))
    _apply_limits(job["limits"])
    sys.path.insert(0, COURSE)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ipc.py, beside this file
    try:
        (run_notebook if command == "run" else judge)(job, fd)
    except BaseException as exc:  # tell the grader why, then fail
        try:
            _send(fd, {"event": "failed", "detail": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            raise


if __name__ == "__main__":
    main(sys.argv)
