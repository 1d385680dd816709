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
  copy before anything of the learner's exists in this process, and its checks are kept. Then,
  for each check, a child is forked: it defines the learner's functions (exercise cells in
  full, the other cells' imports, functions, classes and literal constants, as the course's own
  tests do), restores every module the check relies on to the state the judge recorded, calls
  the check, and sends back whether it returned ``True``, over a pipe of its own. The judge
  waits for each child at most ``cell_timeout`` seconds, then kills it, and forwards a verdict
  per check. A child that changed ``course_lib``, ``builtins`` or torch's own functions while
  the check ran fails that check ("tampered").
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


def _literal(node) -> bool:
    import ast

    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _program(cells: list[dict]) -> list[tuple[bool, list]]:
    """``[(full, [code object per statement])]``: what the checks see of the learner's cells."""
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
            if not cell["full"] and not (
                    isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef
                               | ast.AsyncFunctionDef | ast.ClassDef)
                    or (isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
                        and _literal(node.value))):
                continue
            module = ast.Module(body=[node], type_ignores=[])
            keep.append(compile(module, f"<cell {number}>", "exec"))
        program.append((cell["full"], keep))
    return program


def _guarded_modules():
    """The namespaces a check relies on: ``course_lib``, ``builtins``, torch's main functions.

    Returns ``(modules, spaces, classes)``: the ``course_lib`` modules by name (their
    ``sys.modules`` entries are put back too), ``[(name, namespace dict)]`` and
    ``[(name, class)]``.
    """
    import builtins

    import torch
    import torch.utils.checkpoint  # noqa: F401

    modules = {n: m for n, m in sys.modules.items()
               if n == "course_lib" or n.startswith("course_lib.")}
    spaces = [(n, vars(m)) for n, m in sorted(modules.items())]
    spaces.append(("builtins", vars(builtins)))
    for name in ("torch", "torch.nn", "torch.nn.functional", "torch.autograd",
                 "torch.utils.checkpoint", "math"):
        if name in sys.modules:
            spaces.append((name, vars(sys.modules[name])))
    classes = [("torch.Tensor", torch.Tensor), ("torch.nn.Module", torch.nn.Module)]
    return modules, spaces, classes


def _snapshot(spaces, classes) -> dict:
    snap = {("space", name): dict(space) for name, space in spaces}
    snap.update({("class", name): dict(vars(cls)) for name, cls in classes})
    return snap


def _torch_wrapped(new, old) -> bool:
    """torch wraps some of its own functions when a module is first imported (torch._dynamo
    wraps ``torch.manual_seed``): not the learner's doing."""
    return (getattr(new, "__wrapped__", None) is old
            and str(getattr(new, "__module__", "")).startswith("torch"))


def _restore(snap: dict, spaces, classes, modules) -> list[str]:
    """Put back every entry that changed since the snapshot; return the changed names."""
    changed = []
    for name, module in modules.items():
        if sys.modules.get(name) is not module:
            changed.append(f"sys.modules[{name!r}]")
            sys.modules[name] = module
    for name, space in spaces:
        for key, value in snap[("space", name)].items():
            new = space.get(key, _restore)
            if new is not value:
                if not _torch_wrapped(new, value):
                    changed.append(f"{name}.{key}")
                space[key] = value
    for name, cls in classes:
        for key, value in snap[("class", name)].items():
            if vars(cls).get(key, _restore) is not value:
                changed.append(f"{name}.{key}")
                try:
                    setattr(cls, key, value)
                except (AttributeError, TypeError):
                    pass
    return changed


_PLAIN = (int, float, complex, bool, str, bytes, type(None), type(Ellipsis))
_HOMES = {"torch", "numpy", "course_lib", "collections", "fractions", "decimal", "builtins"}


def _foreign(value, depth: int = 0, seen: list | None = None) -> str | None:
    """The name of a class the learner defined, if ``value`` (or what it holds) is one of its
    instances: such an object can answer ``==`` with True whatever it is compared with."""
    seen = [0] if seen is None else seen
    seen[0] += 1
    kind = type(value)
    if kind in _PLAIN or seen[0] > 10_000 or depth > 4:
        return None
    home = sys.modules.get(getattr(kind, "__module__", None) or "")
    found = home
    for part in getattr(kind, "__qualname__", "?").split("."):
        found = getattr(found, part, None)
    if found is not kind or kind.__module__.split(".")[0] not in _HOMES:
        return getattr(kind, "__name__", "?")
    if kind in (tuple, list, set, frozenset):
        items = value
    elif kind is dict:
        items = [*value.keys(), *value.values()]
    else:
        return None
    for item in items:
        name = _foreign(item, depth + 1, seen)
        if name:
            return name
    return None


def _vetted(fn):
    """``fn``, whose results must be made of the course's, torch's or Python's own types."""
    import functools

    @functools.wraps(fn)
    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        name = _foreign(result)
        if name:
            raise TypeError(f"{fn.__name__} returned an object of a class defined in the notebook "
                            f"({name}); return plain values (numbers, str, tuples, tensors)")
        return result

    return call


class _CappedText:
    """A text stream that keeps the last ``limit`` characters written to it (the check's own
    verdict line comes last, after whatever the learner's function printed)."""

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


def _run_check(check, name: str, args: list[str], program, guard, fd: int, limits: dict) -> None:
    """In the forked child: define the learner's names, call the check, report, exit."""
    import builtins
    import traceback

    modules, spaces, classes, snap = guard
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(null, target)
        os.closerange(3, fd)
        os.closerange(fd + 1, 65536)
        cpu = int(limits["cell_timeout"]) + 2
        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if hard == resource.RLIM_INFINITY or hard > cpu:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        out = _CappedText(1 << 16)
        sys.stdout = sys.stderr = out
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        first_error = ""
        for full, codes in program:
            if codes is None:
                first_error = first_error or "an exercise cell is not valid Python"
                continue
            for code in codes:
                try:
                    exec(code, namespace)
                except BaseException as exc:  # the learner's code may raise anything
                    if full and not first_error:
                        first_error = f"your exercise cell raised {type(exc).__name__}: {exc}"
        _restore(snap, spaces, classes, modules)
        sys.settrace(None)
        sys.setprofile(None)
        sys.stdout = sys.stderr = out
        try:
            values = [eval(source, namespace) for source in args]
            values = [_vetted(v) if isinstance(v, types.FunctionType)
                      and getattr(v, "__module__", None) == "__main__" else v for v in values]
        except NameError as exc:
            detail = f"{exc}" + (f" ({first_error})" if first_error else "")
            _send(fd, {"status": "error", "detail": detail})
            os._exit(0)
        result = check(*values)
        tampered = _restore(snap, spaces, classes, modules)
        text = out.getvalue()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        lines = [line.strip() for line in text.splitlines()]
        mine = [line for line in lines if line.split(":", 1)[0] in
                (f"{mark} {name}" for mark in (PASS, FAIL, TODO))]
        if tampered:
            status = "tampered"
            detail = "changed " + ", ".join(sorted(set(tampered))[:3]) + " during the check"
        elif result is True:
            status, detail = "passed", ""
        elif any(line.startswith(TODO) for line in mine):
            status, detail = "not done", ""
        else:
            status = "failed"
            detail = next((line.split(":", 1)[1].strip() for line in mine
                           if line.startswith(FAIL)), "")
        _send(fd, {"status": status, "detail": detail})
    except BaseException as exc:
        try:
            where = traceback.format_exception_only(type(exc), exc)[-1].strip()
            _send(fd, {"status": "error", "detail": where})
        except BaseException:
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


def _discover(cells: list[dict], checks: dict) -> list[dict]:
    """The checks the learner's own check cells call (for a notebook solutions/ cannot match)."""
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
                seen.add(node.func.attr)
                name = node.func.attr.removeprefix("check_")
                found.append({"id": f"cell-check-{name}", "name": name,
                              "args": [ast.unparse(a) for a in node.args]})
    return found


def judge(job: dict, fd: int) -> None:
    from course_lib import grading

    checks = dict(grading.CHECKS)
    program = _program(job["cells"])
    modules, spaces, classes = _guarded_modules()
    guard = (modules, spaces, classes, _snapshot(spaces, classes))
    _send(fd, {"event": "ready"})
    if job.get("discover"):
        job["checks"] = _discover(job["cells"], checks)
        _send(fd, {"event": "checks", "checks": job["checks"]})
    for item in job["checks"]:
        check = checks.get(f"check_{item['name']}")
        if check is None:
            result = {"status": "error", "detail": "no such check in course_lib.grading"}
        else:
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)
                os.close(read_fd)
                _run_check(check, item["name"], item["args"], program, guard, write_fd,
                           job)
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
    _non_dumpable()
    with open(job_path) as f:
        job = json.load(f)
    _apply_limits(job["limits"])
    sys.path.insert(0, COURSE)
    try:
        (run_notebook if command == "run" else judge)(job, fd)
    except BaseException as exc:  # tell the grader why, then fail
        try:
            _send(fd, {"event": "failed", "detail": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            raise


if __name__ == "__main__":
    main(sys.argv)
