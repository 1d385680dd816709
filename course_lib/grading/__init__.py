"""Checks for the graded exercises.

A check takes what the learner wrote (always a function: the exercise cells
define functions, so an unfinished one still defines its name), tries it on
cases whose answers are derived independently, and prints one line:

* ``✓ tensor_bytes: passed``
* ``✗ tensor_bytes: <what went wrong>. Hint: <what to look at>``
* ``… tensor_bytes: not done yet (replace the `raise NotImplementedError` ...)``

It returns ``True`` or ``False`` and never raises into the notebook, whatever the
learner's code does. Each lecture has a module here (``lecture00`` ...); its
``check_*`` functions are re-exported so that a notebook only needs
``from course_lib import grading`` and ``grading.check_tensor_bytes(tensor_bytes)``.

Writing a check::

    @grader
    def check_tensor_bytes(fn):
        expect(fn((2, 3), torch.float32) == 24, "a (2, 3) fp32 tensor has 24 bytes",
               hint="multiply the element count by the bytes per element")
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import re
import textwrap
import traceback
from collections.abc import Callable

#: Every registered check, by name (``check_tensor_bytes`` -> function).
CHECKS: dict[str, Callable[..., bool]] = {}
#: Names a check cannot take: the other columns of the grader's scores file.
RESERVED = ("submission", "notebook", "total", "max", "seconds", "notes")

PASS, FAIL, TODO = "✓", "✗", "…"


class CheckFailed(Exception):
    """Raised inside a check body; the wrapper turns it into a printed ✗ line.

    Args:
        message (str): what went wrong, shown after the check's name.
        hint (str, optional): what to look at, shown after "Hint:".
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


def expect(condition: bool, message: str, *, hint: str | None = None) -> None:
    """Fail the check with ``message`` (and ``hint``) unless ``condition`` holds.

    Args:
        condition (bool): taken for its truth (a learner's answer compared may be a numpy or torch
            bool).
        message (str): what went wrong.
        hint (str, optional): what to look at.

    Raises:
        CheckFailed: when ``condition`` is false (the check's wrapper catches it).
        ValueError: naming ``message`` (not a str) or ``hint`` (not a str or None).

    Example::

        expect(fn((2, 3), torch.float32) == 24, "a (2, 3) fp32 tensor has 24 bytes",
               hint="multiply the element count by the bytes per element")
    """
    if not isinstance(message, str):
        raise ValueError(f"message must be a str, got {message!r}")
    if hint is not None and not isinstance(hint, str):
        raise ValueError(f"hint must be a str or None, got {hint!r}")
    if not condition:
        raise CheckFailed(message, hint)


def observe(measure: Callable, fn: Callable, *args, **kwargs):
    """``measure(fn, *args, **kwargs)``: run the learner's ``fn`` the way a check needs to watch it.

    In a notebook this is the plain call. When the course's grader runs the check, ``fn`` lives
    in another process (the learner's), and ``measure`` runs there, next to it: only its result,
    plain values (numbers, bools, str, lists, dicts, tensors), comes back to the check, which
    judges it against truths of its own. ``measure`` must be a module-level function.

    Args:
        measure (callable): ``measure(fn, *args, **kwargs)``, returning plain values.
        fn (callable): the learner's function.

    Returns:
        What ``measure`` returned (as rebuilt from plain values, under the grader).
    """
    remote = getattr(type(fn), "__course_remote__", None)
    if remote is not None:
        return remote(fn, measure, *args, **kwargs)
    return measure(fn, *args, **kwargs)


def _reset_peak(pid: int) -> int | None:
    """Reset the peak resident memory (``VmHWM``) of process ``pid`` to its current resident
    memory (Linux: ``5`` written to ``/proc/PID/clear_refs``); that peak, or None when the
    process's files cannot be written (another OS, or a process that made itself unreadable)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _read_peak(pid)


def _read_peak(pid: int) -> int | None:
    """The peak resident memory of process ``pid`` since its last reset, in bytes (None if
    unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_supported() -> bool:
    """Whether this OS reports a process's peak resident memory and lets it be reset (Linux).

    Returns:
        bool: True where ``/proc/self/clear_refs`` exists.
    """
    return os.path.exists("/proc/self/clear_refs")


def observe_peak(measure: Callable, fn: Callable, *args, **kwargs):
    """:func:`observe`, and how much the peak resident memory of the process running ``fn`` grew
    while it ran, measured from outside that process under the grader.

    Memory is the one effect of the learner's code that the operating system counts for it:
    under the grader, the check's process resets the learner's process's peak resident memory
    and reads it back after the call (``/proc/PID/clear_refs`` and ``VmHWM``, Linux), so code
    in the learner's process cannot report a smaller figure (it could only start other
    processes, whose memory is not counted). In a notebook it is this process's own.

    Args:
        measure (callable): as for :func:`observe`.
        fn (callable): the learner's function.

    Returns:
        tuple: ``(what measure returned, growth in bytes)``; the growth is None where it could
        not be measured (another OS than Linux, or a process that made itself unreadable).
    """
    if getattr(type(fn), "__course_remote__", None) is not None:
        pid = getattr(fn, "__course_pid__", None)
    else:
        pid = os.getpid()
    start = _reset_peak(pid) if isinstance(pid, int) else None
    result = observe(measure, fn, *args, **kwargs)
    end = _read_peak(pid) if start is not None else None
    return result, (None if end is None else max(0, end - start))


def _describe(exc: BaseException) -> str:
    """``Type: message (line N of f)`` for an exception from a learner's code, whatever its
    ``__str__`` does (raises, returns a non-str, holds text a terminal cannot print)."""
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


def _is_todo(exc: BaseException) -> bool:
    # The generated stubs raise NotImplementedError; a learner's helper that
    # forgot a return is a different failure and gets a different message.
    return isinstance(exc, NotImplementedError)


def grader(body: Callable[..., None]) -> Callable[..., bool]:
    """Turn a check body that raises :class:`CheckFailed` into a check that prints and returns a bool.

    Args:
        body (callable): a function named ``check_NAME`` that calls :func:`expect`.

    Returns:
        The check, registered in :data:`CHECKS`; its docstring is ``body``'s with the ``quiet``
        switch and what every check returns added (:data:`CHECK_DOC`).

    Raises:
        ValueError: if ``body`` is not named ``check_NAME``, or NAME is one of :data:`RESERVED`
            (a column of the scores file).
    """
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
            body(*args, **kwargs)
        except CheckFailed as exc:
            hint = f" Hint: {exc.hint}" if exc.hint else ""
            say(f"{FAIL} {name}: {exc.message}.{hint}")
            return False
        except KeyboardInterrupt:  # the learner stopping the cell, not an answer
            raise
        except BaseException as exc:  # noqa: BLE001 - the learner's code may raise anything,
            # exit() (SystemExit) included: a check reports it and never lets it out
            if _is_todo(exc):
                say(f"{TODO} {name}: not done yet (replace the `raise NotImplementedError` "
                    "in the exercise cell with your code, run it, then run this cell).")
                return False
            say(f"{FAIL} {name}: your code raised {_describe(exc)}.")
            return False
        say(f"{PASS} {name}: passed.")
        return True

    check.__doc__ = _with_check_doc(body.__doc__)
    check.is_check = True
    CHECKS[body.__name__] = check
    return check


#: What every check adds to its body's docstring: the grader's switch and the return value.
CHECK_DOC = """\
Keyword Args:
    quiet (bool): print nothing (the grader's switch).

Returns:
    bool: True when every case passed. One line is printed (✓, ✗ with a hint, or … not done
    yet); nothing is raised into the notebook.
"""


def _with_check_doc(doc: str | None) -> str | None:
    """``doc`` with :data:`CHECK_DOC` appended, indented as its ``Args:`` line."""
    if doc is None:  # python -OO
        return None
    args = re.search(r"^( *)Args:$", doc, re.M)
    indent = args.group(1) if args else ""
    return f"{doc.rstrip()}\n\n{textwrap.indent(CHECK_DOC, indent)}{indent}"


def _load_lecture_checks() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("lecture"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            for attr in dir(module):
                if attr.startswith("check_"):
                    globals()[attr] = getattr(module, attr)


_load_lecture_checks()
