"""Checks for the graded exercises.

A check takes what the learner wrote (a function: an unfinished exercise cell still defines
its name), tries it on cases whose answers are derived independently, prints one line (``✓``
passed, ``✗`` what went wrong and a hint, ``…`` not done yet), returns a bool, and never raises
into the notebook. Each lecture has a module here (``lecture00`` ...) whose ``check_*``
functions are re-exported: ``grading.check_tensor_nbytes(tensor_nbytes)``. A check body seeds the
CPU's generator only (``torch.default_generator.manual_seed``: ``torch.manual_seed`` would also
reseed the GPUs, outside the state :func:`grader` restores).

Writing a check::

    @grader
    def check_tensor_nbytes(fn):
        '''``fn(shape, dtype)``: the bytes of a dense tensor.'''
        expect(exactly(fn((2, 3), torch.float32), 24), "a (2, 3) fp32 tensor has 24 bytes",
               hint="multiply the element count by the bytes per element")
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

#: Every registered check, by name (``check_tensor_nbytes`` -> function).
CHECKS: dict[str, Callable[..., bool]] = {}
#: Names a check cannot take: the other columns of the grader's scores file.
RESERVED = ("submission", "notebook", "total", "max", "seconds", "notes")

PASS, FAIL, TODO = "✓", "✗", "…"


class CheckFailed(Exception):
    """Raised inside a check body; :func:`grader` turns it into a printed ✗ line."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


def expect(condition: bool, message: str, *, hint: str | None = None) -> None:
    """Fail the check with ``message`` (and ``hint``) unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(message, hint)


def _as_number(value):
    """``value`` as a Python int or float if it is one real number (a scalar, or a one-element
    tensor or array: its exact ``.item()``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):  # int.__int__: a subclass's own __eq__ and __int__ play no part
        return int.__int__(value)
    if isinstance(value, float):  # numpy's float64 too
        return float.__float__(value)
    numpy = sys.modules.get("numpy")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
    elif numpy is None or not isinstance(value, numpy.generic | numpy.ndarray) or (
            value.size != 1 or value.dtype.kind not in "iuf"):
        return None
    item = value.item()
    return item if type(item) in (int, float) else None


def exactly(got, truth) -> bool:
    """Whether the learner's answer ``got`` is ``truth``, compared as plain values: a number by its
    exact value (NaN equals nothing), a str as a str, a list or tuple item by item, the rest by
    identity. ``got == truth`` would let an answer choose (a float16 ``inf`` equals every integer
    from 65,520 up; an ``__eq__`` may say yes)."""
    if isinstance(truth, list | tuple):
        return (isinstance(got, list | tuple) and len(got) == len(truth)
                and all(exactly(a, b) for a, b in zip(got, truth)))
    if isinstance(truth, str):
        return isinstance(got, str) and str.__str__(got) == truth
    number = _as_number(truth)
    if number is not None:
        got = _as_number(got)
        return got is not None and got == number
    return got is truth


def observe(measure: Callable, fn: Callable, *args, **kwargs):
    """``measure(fn, *args, **kwargs)``; under the grader, in the learner's process beside ``fn``
    (``measure`` is a module-level function), and only its plain-value result comes back."""
    remote = getattr(type(fn), "__course_remote__", None)
    if remote is not None:
        return remote(fn, measure, *args, **kwargs)
    return measure(fn, *args, **kwargs)


def _reset_peak(pid: int) -> bool:
    """Reset process ``pid``'s peak resident memory (``VmHWM``, Linux); False if not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _memory(pid: int) -> tuple[int, int] | None:
    """``(VmRSS, VmHWM)`` of process ``pid`` in bytes: resident now, peak since the last reset."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    found[line[:5]] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return (found["VmRSS"], found["VmHWM"]) if len(found) == 2 else None


#: The watch of :func:`observe_peak`: seconds between two looks at the learner's process; a gap
#: that may hide a stop of the checker if a SIGCONT ends it; the longest gap a measurement may
#: hold; the calls of the learner's function before it gives up.
PEAK_INTERVAL, PEAK_STOP_GAP, PEAK_GAP, PEAK_TRIES = 0.0005, 0.01, 0.1, 3


class _Watch(threading.Thread):
    """Watches process ``pid``'s memory until finished: the most resident, failed looks, gaps
    longer than :data:`PEAK_STOP_GAP`, and SIGCONTs on ``woken``."""

    def __init__(self, pid: int, hwm: bool, woken: int | None):
        super().__init__(daemon=True)
        self.pid, self.hwm, self.woken = pid, hwm, woken
        self.peak, self.failed, self.gaps, self.resumed = 0, False, [], []
        self.last = time.monotonic()
        self.done = threading.Event()

    def look(self) -> None:
        now = time.monotonic()
        if now - self.last > PEAK_STOP_GAP:
            self.gaps.append((self.last, now))
        self.last = now
        try:
            if self.woken is not None and signal.SIGCONT in os.read(self.woken, 4096):
                self.resumed.append(now)
        except BlockingIOError:
            pass
        memory = _memory(self.pid)
        if memory is None:
            self.failed = True
        else:
            self.peak = max(self.peak, memory[0], memory[1] if self.hwm else 0)

    def run(self) -> None:
        while not self.done.wait(PEAK_INTERVAL):
            self.look()

    def finish(self) -> None:
        self.done.set()
        self.join()
        self.look()

    def missed(self) -> bool:
        """A gap longer than :data:`PEAK_GAP`, or one that ended as a SIGCONT (a stop's end)."""
        return any(end - start > PEAK_GAP or any(
            end - PEAK_STOP_GAP <= t <= end + PEAK_STOP_GAP for t in self.resumed)
            for start, end in self.gaps)


def _watched(measure: Callable, fn: Callable, pid: int, *args, **kwargs):
    """One call under a :class:`_Watch` of ``pid``: ``(result, bytes grown or None, missed)``."""
    start = _memory(pid)
    if start is None:
        return observe(measure, fn, *args, **kwargs), None, False
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    try:  # the signal's C handler writes its number to ``write`` at once, in whatever thread
        previous = signal.signal(signal.SIGCONT, lambda *_: None)
        wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread (never so in the grader's checker)
        previous = wakeup = None
    watch = _Watch(pid, _reset_peak(pid), None if previous is None else read)
    watch.start()
    try:
        result = observe(measure, fn, *args, **kwargs)
    finally:
        watch.finish()
        if previous is not None:
            signal.set_wakeup_fd(wakeup)
            signal.signal(signal.SIGCONT, previous)
        os.close(read)
        os.close(write)
    grown = None if watch.failed else max(0, watch.peak - start[0])
    return result, grown, watch.missed()


def observe_peak(measure: Callable, fn: Callable, *args, **kwargs):
    """:func:`observe`, and the bytes the resident memory of ``fn``'s process grew by meanwhile
    (None where it cannot be read).

    In a notebook: this process's ``VmHWM`` since a reset (Linux). Under the grader a thread of
    the checker reads the learner's process from outside (it could reset its own peak), and a
    call the watch may have missed part of is made again, up to :data:`PEAK_TRIES` times.
    """
    if getattr(type(fn), "__course_remote__", None) is None:
        pid = os.getpid()
        reset = _reset_peak(pid)
        start = _memory(pid)
        result = observe(measure, fn, *args, **kwargs)
        end = _memory(pid) if reset and start is not None else None
        return result, (None if end is None else max(0, end[1] - start[0]))
    pid = getattr(fn, "__course_pid__", None)
    if not isinstance(pid, int):
        return observe(measure, fn, *args, **kwargs), None
    for _ in range(PEAK_TRIES):
        result, grown, missed = _watched(measure, fn, pid, *args, **kwargs)
        if not missed:
            return result, grown
    return result, None


def _describe(exc: BaseException) -> str:
    """``Type: message (line N of f)`` for a learner's exception, whatever its ``__str__`` does."""
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001 - a hostile __str__
        message = "<its message could not be read>"
    if not isinstance(message, str):
        message = "<its message is not text>"
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")[:500]
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    try:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        text += f" (line {where.lineno} of {where.name})"
    except (IndexError, TypeError, AttributeError):
        pass
    return text


def grader(body: Callable[..., None]) -> Callable[..., bool]:
    """Turn a body ``check_NAME(fn)`` (NAME not in :data:`RESERVED`) that raises
    :class:`CheckFailed` into a check: registered in :data:`CHECKS`, its docstring completed,
    the CPU's random state restored, one line printed."""
    name = getattr(body, "__name__", "")
    if not name.startswith("check_") or not name[6:].isidentifier():
        raise ValueError(f"body must be a function named check_NAME, got {name!r}")
    name = name.removeprefix("check_")
    if name in RESERVED:
        raise ValueError(f"body must not be named check_{name}: {name!r} is a column of the "
                         f"scores file (reserved: {', '.join(RESERVED)})")

    @functools.wraps(body)
    def check(*args, quiet: bool = False, **kwargs) -> bool:
        if not isinstance(quiet, bool):  # the instructor's switch, not the learner's answer
            raise ValueError(f"quiet must be True or False, got {quiet!r}")

        def say(line: str) -> None:
            if not quiet:
                print(line)

        try:
            with torch.random.fork_rng(devices=[]):  # the notebook's random state stays its own
                body(*args, **kwargs)
        except CheckFailed as exc:
            hint = f" Hint: {exc.hint}" if exc.hint else ""
            say(f"{FAIL} {name}: {exc.message}.{hint}")
            return False
        except KeyboardInterrupt:  # the learner stopping the cell, not an answer
            raise
        except BaseException as exc:  # noqa: BLE001 - the learner's code may raise anything,
            # exit() (SystemExit) included: a check reports it and never lets it out
            if isinstance(exc, NotImplementedError):  # the stubs' raise, not a missing return
                say(f"{TODO} {name}: not done yet (replace the `raise NotImplementedError` "
                    "in the exercise cell with your code, run it, then run this cell).")
                return False
            say(f"{FAIL} {name}: your code raised {_describe(exc)}.")
            return False
        say(f"{PASS} {name}: passed.")
        return True

    if body.__doc__ is not None:  # python -OO drops docstrings
        fn = next(iter(inspect.signature(body).parameters))
        check.__doc__ = f"{inspect.cleandoc(body.__doc__)}\n\n{CHECK_DOC.format(fn=fn)}"
    check.is_check = True
    CHECKS[body.__name__] = check
    return check


#: What :func:`grader` adds to a body's one-line docstring.
CHECK_DOC = """\
Args:
    {fn} (callable): the learner's function, called as above.

Keyword Args:
    quiet (bool): print nothing (the grader's switch).

Returns:
    bool: True when every case passed. One line is printed (✓, ✗ with a hint, or … not done
    yet); nothing is raised into the notebook.
"""


def _load_lecture_checks() -> None:
    """Re-export every lecture module's ``check_*`` here."""
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("lecture"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            for attr in dir(module):
                if attr.startswith("check_"):
                    globals()[attr] = getattr(module, attr)


_load_lecture_checks()
