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
  copy before anything of the learner's exists in this process. For each check, a *checker* is
  forked (no learner code has run in it, none ever will); it starts the *learner's process*, a
  child that closes every descriptor but its socket, defines the learner's names (exercise
  cells in full; the other cells' imports, functions, classes and assignments) and answers
  calls. The check calls the learner's functions over that socket and gets plain values back
  (``ipc.py``); if it passes, the cases the grader draws (``drawn.py`` in the job, held open by
  the judge and removed by the grader before any learner code runs) are tried with a seed taken
  after the learner's process started. The judge waits for each checker at most
  ``cell_timeout`` seconds, then kills it (and the learner's process with it), and forwards a
  verdict per check.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
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


def _program(cells: list[dict]) -> list[tuple[bool, list]]:
    """``[(full, [code object per statement])]``: what the learner's process runs of the cells.

    Exercise cells run in full. Of the other cells, the imports, definitions (functions,
    classes) and assignments run (a helper table in a cell of its own is there, as in the
    notebook); other statements (demos, training loops, prints, the check calls) do not.
    """
    import ast

    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    program = []
    for number, cell in enumerate(cells):
        try:
            tree = ast.parse(transform(cell["source"]))
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            program.append((cell["full"], None))
            continue
        keep = []
        for node in tree.body:
            if not cell["full"] and not isinstance(
                    node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef
                    | ast.ClassDef | ast.Assign | ast.AnnAssign):
                continue
            if not cell["full"] and any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr.startswith("check_") for n in ast.walk(node)):
                continue
            module = ast.Module(body=[node], type_ignores=[])
            keep.append(compile(module, f"<cell {number}>", "exec"))
        program.append((cell["full"], keep))
    return program


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


def _learner(sock, cells: list[dict]) -> None:
    """The learner's process (a child of the checker): every descriptor but its socket closed
    before any of the learner's code runs; defines the learner's names, then answers calls."""
    import builtins

    ipc = _ipc()

    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)
    _dumpable()  # the checker reads and resets this process's peak memory (/proc/PID)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    first_error = ""
    try:
        program = _program(cells)
        for full, codes in program:
            if codes is None:
                first_error = first_error or "an exercise cell is not valid Python"
                continue
            for code in codes:
                try:
                    exec(code, namespace)
                except BaseException as exc:  # the learner's code may raise anything
                    if full and not first_error:
                        first_error = ipc._error_reply(exc)
                        first_error = (f"your exercise cell raised {first_error['type']}: "
                                       f"{first_error['message']}")
        ipc.Learner(sock, namespace, first_error).serve()
    finally:
        os._exit(0)


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


def _run_check(check, name: str, args: list[str], cells, fd: int, limits: dict,
               drawn_fd: int = -1) -> None:
    """In the forked checker (no learner code has run in it, none ever will): start the
    learner's process, call the check with the learner's functions as proxies, report, exit."""
    import socket
    import traceback

    ipc = _ipc()

    learner = 0
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(null, target)
        keep = sorted({fd, drawn_fd} - {-1})
        start = 3
        for number in keep:
            os.closerange(start, number)
            start = number + 1
        os.closerange(start, 65536)
        cpu = int(limits["cell_timeout"]) + 2
        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if hard == resource.RLIM_INFINITY or hard > cpu:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        mine, theirs = socket.socketpair()
        os.set_inheritable(fd, False)
        learner = os.fork()
        if learner == 0:
            mine.close()
            _learner(theirs, cells)
        theirs.close()
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
            _, status = os.waitpid(learner, 0)
            learner = 0
            why = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exit status {os.waitstatus_to_exitcode(status)}")
            status, detail = "crashed", f"the process running your code died ({why})"
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
            os.waitpid(learner, 0)
        except OSError:
            pass
    os._exit(0)


def _wait_child(pid: int, read_fd: int, timeout: float, limit: int) -> dict:
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            result = {"status": "timeout", "detail": "stopped at the cell time limit"}
            break
        ready, _, _ = select.select([read_fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(read_fd, 65536)
        if chunk:
            data += chunk
            if b"\n" in data or len(data) > limit:
                try:
                    result = json.loads(data.split(b"\n", 1)[0][:limit])
                    if not isinstance(result, dict):
                        raise ValueError
                except ValueError:
                    result = {"status": "error", "detail": "the check's process sent garbage"}
                break
            continue
        _, status = os.waitpid(pid, 0)
        pid = 0
        why = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit status {os.waitstatus_to_exitcode(status)}")
        result = {"status": "crashed", "detail": f"the check's process died ({why})"}
        break
    if pid:
        for target in (-pid, pid):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        os.waitpid(pid, 0)
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
    for item in job["checks"]:
        check = checks.get(f"check_{item['name']}")
        if check is None:
            result = {"status": "error", "detail": "no such check in course_lib.grading"}
        elif not all(isinstance(a, str) and a.isidentifier() for a in item["args"]):
            result = {"status": "error", "detail": "a check is given the notebook's functions "
                                                   "by name only"}
        else:
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)
                os.close(read_fd)
                _run_check(check, item["name"], item["args"], job["cells"], write_fd, job,
                           drawn_fd)
            os.close(write_fd)
            result = _wait_child(pid, read_fd, job["cell_timeout"], job["message_chars"] * 4)
        status = result.get("status") if isinstance(result.get("status"), str) else "error"
        detail = result.get("detail") if isinstance(result.get("detail"), str) else ""
        _send(fd, {"event": "check", "id": item["id"], "status": status,
                   "detail": detail[: job["message_chars"]]})
    _send(fd, {"event": "end"})


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
