"""The boundary between the checks and the learner's code while grading (issue 20).

When the grader runs a check, the check runs in a process where no learner code has run, and the
learner's functions run in a process of their own, called over a socket; only plain values come
back (:mod:`course_tools.ipc`). Here, without a sandbox (the sandboxed runs are in
tests/test_submissions.py and tests/test_hostile_submissions.py):

* the plain encoding: what it takes, what it refuses, what the checker rebuilds;
* every check, through the boundary, accepts the solution, rejects the stub and every typical
  wrong answer of tests/wrong_answers/, as it does in a notebook;
* the cases the grader draws: solutions pass them, a table of the public answers does not;
* attacks that need another notebook than 00: lecture 01's truth helpers, a fake module for a
  course module a check imports lazily (lecture 05), a measure patched in the learner's process
  (lecture 08: the memory the checker reads from outside still counts), and
  ``--grade-unmatched`` with arguments the notebook chose.
"""

import json
import os
import random
import signal
import socket
from unittest import mock

import numpy as np
import pytest
import torch
from notebook_tools import ROOT, SOLUTIONS, check_calls, definitions, read, run_judge
from torch.utils.checkpoint import CheckpointPolicy
from wrong_answers import WRONG

from course_lib import grading
from course_tools import grade, hidden, ipc

CALLS = [(path.name, name, args) for path in SOLUTIONS for name, args in check_calls(path)]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the plain encoding -----------------------------------------------------------------------


def _round_trip(value):
    return ipc.decode(json.loads(json.dumps(ipc.encode(value))))


def test_plain_values_cross_as_themselves():
    value = {"a": [1, 2.5, True, None, "x", (3, 4)], (1, "k"): {5, 6}, "big": 10**40,
             "nan": float("inf"), "bytes": b"\x00\xff", "dtype": torch.bfloat16,
             "policy": CheckpointPolicy.MUST_SAVE, "size": torch.Size([2, 3])}
    back = _round_trip(value)
    assert back == {**value, "size": (2, 3)}
    assert type(back["size"]) is tuple and type(back["a"][0]) is int
    for t in (torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.zeros(0, 4),
              torch.tensor([True, False]), torch.randn(3, dtype=torch.float64)):
        got = _round_trip(t)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    array = np.arange(5, dtype=np.int16)
    assert np.array_equal(_round_trip(array), array)
    assert _round_trip(np.int64(7)) == 7 and type(_round_trip(np.int64(7))) is int
    names = _round_trip([np.str_("bn"), np.bytes_(b"x")])  # what a numpy array's items are
    assert names == ["bn", b"x"] and [type(n) for n in names] == [str, bytes]


class _Equal(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize("value,why", [
    (_Equal(0), "_Equal"),
    (np.array(mock.ANY, dtype=object), "dtype object"),
    ([np.array([1, mock.ANY], dtype=object)], "dtype object"),
    (torch.return_types.max((_Equal(1), 2)), "_Equal"),
    ([[[[[[[[[[_Equal(3)]]]]]]]]]], "_Equal"),
    (mock.ANY, "_ANY"),
    (lambda: 1, "function"),
    ((1).__add__, "method-wrapper"),
    (torch.empty(2, device="meta"), "meta"),
])
def test_what_is_not_plain_is_refused_at_any_depth(value, why):
    with pytest.raises(ipc.NotPlain, match=why):
        ipc.encode(value)


@pytest.mark.parametrize("data", [
    {"$obj": "x"}, {"$T": ["float32", [2], "AAAA", False]}, {"$dtype": "Tensor"},
    {"$np": ["|O", [1], ""]}, {"$l": [{"$policy": "NOPE"}]}, [1, 2], 1.5,
    {"$d": [[1]]}, {"$int": "1" * 20_000},
])
def test_the_checker_rebuilds_nothing_else(data):
    with pytest.raises(ipc.ProtocolError):
        ipc.decode(data)


# --- every check through the boundary -----------------------------------------------------------


def _serve(namespace: dict):
    """A learner's process (forked) serving ``namespace``; returns (checker, pid)."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            mine.close()
            ipc.Learner(theirs, namespace).serve()
        finally:
            os._exit(0)
    theirs.close()
    return ipc.Checker(mine, pid), pid


def _through(check: str, namespace: dict, args: list[str], drawn: bool = False) -> bool:
    checker, pid = _serve(namespace)
    try:
        values = [checker.function(a) for a in args]
        ok = grading.CHECKS[check](*values, quiet=True)
        if ok and drawn and check.removeprefix("check_") in hidden.CASES:
            for seed in range(3):
                hidden.CASES[check.removeprefix("check_")](*values, random.Random(seed))
        return ok
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        checker.sock.close()


@pytest.mark.slow
@pytest.mark.parametrize("notebook,check,args", CALLS, ids=[f"{n}:{c}" for n, c, _ in CALLS])
def test_every_check_through_the_boundary(notebook, check, args):
    solution = definitions(ROOT / "solutions" / notebook)
    exercise = definitions(ROOT / "exercises" / notebook)
    assert _through(check, solution, args, drawn=True), f"{check} rejects the solution"
    assert not _through(check, exercise, args), f"{check} accepts the unfilled stub"
    for mistake, replaced in WRONG[check]:
        assert not _through(check, {**solution, **replaced}, args), f"{check} accepts: {mistake}"


def test_drawn_cases_refuse_a_table_of_the_public_answers():
    public = {((2, 3), torch.float32): 24, ((1024, 1024), torch.bfloat16): 2097152,
              ((7,), torch.float16): 14, ((3, 5, 2), torch.float64): 240,
              ((4, 4), torch.int8): 16, ((0, 9), torch.float32): 0}
    namespace = {"tensor_nbytes": lambda shape, dtype: public.get((tuple(shape), dtype), 0)}
    checker, pid = _serve(namespace)
    try:
        fn = checker.function("tensor_nbytes")
        assert grading.CHECKS["check_tensor_nbytes"](fn, quiet=True)
        with pytest.raises(grading.CheckFailed, match="a case drawn by the grader"):
            hidden.CASES["tensor_nbytes"](fn, random.Random(0))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _public_table(cases, default):
    """A learner's function that looks the public cases up in a table, ``default`` otherwise."""
    table = {tuple(case[:-1]): case[-1] for case in cases}
    return lambda *args: table.get(args, default)


@pytest.mark.parametrize("check,cases,defaults", [
    ("pick_training_dtype", "DTYPE_CASES", (torch.float32, torch.bfloat16, torch.float16)),
    ("bytes_per_param", "BYTES_CASES", (4, 6, 8, 12, 16)),
])
def test_drawn_cases_refuse_a_table_of_the_few_public_inputs(check, cases, defaults):
    """``pick_training_dtype`` and ``bytes_per_param`` take a few values each: their public
    cases leave some out, and every draw holds those, so a table of the public answers fails
    whatever its default, at every seed; the solution passes."""
    from course_lib.grading import lecture00, lecture01

    public = getattr(lecture00 if check == "pick_training_dtype" else lecture01, cases)
    solution = definitions(ROOT / "solutions" / ("00_setup.ipynb" if check ==
                                                 "pick_training_dtype" else
                                                 "01_where_the_memory_goes.ipynb"))
    namespace = {f"table_{i}": _public_table(public, d) for i, d in enumerate(defaults)}
    checker, pid = _serve({**namespace, check: solution[check]})
    try:
        for seed in range(5):
            hidden.CASES[check](checker.function(check), random.Random(seed))
        for name in namespace:
            fn = checker.function(name)
            assert grading.CHECKS[f"check_{check}"](fn, quiet=True), name
            for seed in range(5):
                with pytest.raises(grading.CheckFailed, match="a case drawn by the grader"):
                    hidden.CASES[check](fn, random.Random(seed))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_drawn_cases_refuse_the_public_models_answers():
    """Lecture 03: names looked up from the public models' layers pass the check, not the models
    the grader draws."""
    def lookup(model, x):
        names = dict(model.named_modules())
        return ["bn", "center"] if "center" in names else ["body.1"]

    checker, pid = _serve({"batch_coupled_modules": lookup})
    try:
        fn = checker.function("batch_coupled_modules")
        assert grading.CHECKS["check_batch_coupled_modules"](fn, quiet=True)
        with pytest.raises(grading.CheckFailed, match="a case drawn by the grader"):
            hidden.CASES["batch_coupled_modules"](fn, random.Random(1))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


# --- attacks on other notebooks, through the grader's judge (no sandbox) -------------------------


def _judge(path, edit=None, *, discover=False):
    """Run the grader's judge (as in the sandbox, minus bubblewrap) on a notebook; return
    ``{check name: (status, detail)}``."""
    nb = read(path)
    if edit is not None:
        edit(nb)
    assignment = grade.load_assignment(ROOT / "solutions" / path.name)
    cells = [{"source": c.source, "full": grade._is_exercise_cell(c, assignment),
              "id": grade._grade_id(c)} for c in nb.cells if c.cell_type == "code"]
    canonical = {c.name: list(c.args) for a in SOLUTIONS
                 for c in grade.load_assignment(a).checks}
    checks = [{"id": c.name, "name": c.name, "args": c.args} for c in assignment.checks]
    messages = run_judge({"cells": cells, "checks": [] if discover else checks,
                          "discover": discover, "canonical": canonical, "cell_timeout": 120,
                          "timeout": 600, "wall_backstop": 3.0, "message_chars": 300})
    return {m["id"].removeprefix("cell-check-"): (m["status"], m["detail"])
            for m in messages if m.get("event") == "check"}


def _set_exercise(nb, name: str, source: str) -> None:
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")
                and f"def {name}(" in c.source)
    cell.source = source


def test_lecture01_installed_helpers_answer_nothing():
    """The old package held lecture 01's truth formulas (``_ZERO``, ``_fewest_gpus``): calling
    them answered every case. Only the written-out public answers are left in it, and the
    grader draws cases of its own."""
    path = ROOT / "exercises" / "01_where_the_memory_goes.ipynb"

    def edit(nb):
        _set_exercise(nb, "zero_bytes_per_device", (
            "def zero_bytes_per_device(n_params, zero_stage, world_size):\n"
            "    from course_lib.grading import lecture01\n"
            "    a, b = lecture01._ZERO[zero_stage]\n"
            "    return a * n_params + b * n_params // world_size\n"))
        _set_exercise(nb, "gpus_needed", (
            "def gpus_needed(n_params, capacity_bytes, zero_stage):\n"
            "    from course_lib.device import GPUS\n"
            "    from course_lib.grading import lecture01\n"
            "    for P, card, stage, truth in lecture01.GPUS_CASES:\n"
            "        cap = GPUS[card].total_memory if isinstance(card, str) else card\n"
            "        if (P, cap, stage) == (n_params, capacity_bytes, zero_stage):\n"
            "            return truth\n"
            "    return 1\n"))

    results = _judge(path, edit)
    assert results["zero_bytes_per_device"][0] == "failed"
    assert "_ZERO" in results["zero_bytes_per_device"][1]
    assert results["gpus_needed"][0] == "failed"
    assert "a case drawn by the grader" in results["gpus_needed"][1]
    assert results["bytes_per_param"][0] == results["largest_model"][0] == "not done"


def test_a_fake_lazily_imported_module_does_not_reach_the_check():
    """Lecture 05: a policy that answers right when asked about an op alone but saves nothing
    inside a real model, and a fake ``course_lib.training.policies`` (which the check imports only when
    it runs) whose ``policy_cost`` reports the right recomputations. The check imports its own,
    in its own process, and measures: failed."""
    path = ROOT / "solutions" / "05_selective_checkpointing.ipynb"
    fake = (
        "import sys, types\n"
        "from torch.utils.checkpoint import CheckpointPolicy\n"
        "_fake = types.ModuleType('course_lib.training.policies')\n"
        "class _Cost:\n"
        "    def recomputes(self, op):\n"
        "        return 1 if 'gelu' in str(op) else 0\n"
        "_fake.policy_cost = lambda *args, **kwargs: _Cost()\n"
        "sys.modules['course_lib.training.policies'] = _fake\n"
        "import course_lib\n"
        "course_lib.training.policies = _fake\n")

    def edit(nb):
        _set_exercise(nb, "selective_policy", fake + (
            "def selective_policy(ctx, op, *args, **kwargs):\n"
            "    name = str(op)\n"
            "    if not args and any(k in name for k in ('mm', 'attention')):\n"
            "        return CheckpointPolicy.MUST_SAVE\n"
            "    return CheckpointPolicy.PREFER_RECOMPUTE\n"))

    results = _judge(path, edit)
    assert results["selective_policy"][0] == "failed", results["selective_policy"]
    assert "ran again" in results["selective_policy"][1]
    assert results["choose_every"][0] == results["pareto_front"][0] == "passed"


_FULL_LOGITS = (
    "import torch.nn.functional as F\n"
    "def chunked_loss(hidden, weight, targets, chunk_size):\n"
    "    return F.cross_entropy(hidden @ weight.T, targets)  # the whole logits at once\n")


@pytest.mark.parametrize("attack,notes", [
    ("import course_lib.grading.lecture08 as _L\n"
     "def _fake(fn, hidden, weight, targets, chunk):\n"
     "    return {'loss': fn(hidden, weight, targets, chunk), 'largest': 0}\n"
     "_L._chunked_run = _fake  # the measure the check names, as it runs in this process\n",
     ("the process running your code grew by",)),
    ("import ctypes\n"
     "import course_lib.grading.lecture08 as _L\n"
     "_L._chunked_run = lambda fn, *a: {'loss': fn(*a), 'largest': 0}\n"
     "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # non-dumpable: /proc/PID is root's\n",
     ("could not be read", "grew by")),  # the second where the tests run as root
], ids=["patched measure", "patched measure, unreadable process"])
def test_a_patched_measure_does_not_hide_the_memory_used(attack, notes):
    """Lecture 08: ``chunked_loss`` builds the whole logits and patches the measure that runs in
    its process (``grading.observe``) to report no large tensor. The memory the process grew by
    is read by the checker from outside (``grading.observe_peak``): failed; and a process that
    hides its memory from the checker fails too."""
    path = ROOT / "solutions" / "08_more_levers.ipynb"
    results = _judge(path, lambda nb: _set_exercise(nb, "chunked_loss", attack + _FULL_LOGITS))
    assert results["chunked_loss"][0] == "failed", results["chunked_loss"]
    assert any(note in results["chunked_loss"][1] for note in notes), results["chunked_loss"]
    assert results["fuse_optimizer"][0] == results["rank_levers"][0] == "passed"


_PATCH_MEASURE = ("import course_lib.grading.lecture08 as _L\n"
                  "_L._chunked_run = lambda fn, *a: {'loss': fn(*a), 'largest': 0}\n")


@pytest.mark.parametrize("attack", [
    "def chunked_loss(hidden, weight, targets, chunk_size):\n"
    "    loss = F.cross_entropy(hidden @ weight.T, targets)\n"
    "    with open('/proc/self/clear_refs', 'w') as f:\n"
    "        f.write('5')  # the peak resident memory is reset to what is resident now\n"
    "    return loss\n",
    "import os, signal, socket, struct\n"
    "def _children(pid):\n"
    "    found = []\n"
    "    for task in os.listdir(f'/proc/{pid}/task'):\n"
    "        with open(f'/proc/{pid}/task/{task}/children') as f:\n"
    "            found += [int(p) for p in f.read().split()]\n"
    "    return found\n"
    "def _grader():  # the checker: the parent, or a child of the socket pair's maker\n"
    "    found = [os.getppid()] if os.getppid() > 1 else []\n"
    "    for fd in range(3, 64):\n"
    "        try:\n"
    "            with socket.socket(fileno=os.dup(fd)) as sock:\n"
    "                maker = struct.unpack('3i', sock.getsockopt(\n"
    "                    socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]\n"
    "        except OSError:\n"
    "            continue\n"
    "        found += [pid for pid in _children(maker) if pid != os.getpid()]\n"
    "    return found\n"
    "def chunked_loss(hidden, weight, targets, chunk_size):\n"
    "    stopped = _grader()\n"
    "    for pid in stopped:\n"
    "        os.kill(pid, signal.SIGSTOP)  # while the logits are built\n"
    "    try:\n"
    "        loss = F.cross_entropy(hidden @ weight.T, targets)\n"
    "        with open('/proc/self/clear_refs', 'w') as f:\n"
    "            f.write('5')\n"
    "    finally:\n"
    "        for pid in stopped:\n"
    "            os.kill(pid, signal.SIGCONT)\n"
    "    return loss\n",
], ids=["peak reset", "checker stopped, peak reset"])
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads /proc/PID (Linux)")
def test_a_process_that_resets_its_peak_still_shows_the_memory_it_held(attack):
    """Lecture 08: ``chunked_loss`` builds the whole logits, patches the dispatch mode's count
    and resets its own peak resident memory before returning, with the checker stopped
    meanwhile or not: the checker watched the memory while the call ran, or knows it could not
    (a stopped process is resumed by SIGCONT, which it notices)."""
    path = ROOT / "solutions" / "08_more_levers.ipynb"
    code = _PATCH_MEASURE + "import torch.nn.functional as F\n" + attack
    results = _judge(path, lambda nb: _set_exercise(nb, "chunked_loss", code))
    assert results["chunked_loss"][0] == "failed", results["chunked_loss"]
    assert ("grew by" in results["chunked_loss"][1]
            or "could not be watched" in results["chunked_loss"][1]), results["chunked_loss"]


def test_grade_unmatched_uses_the_solutions_arguments():
    """An unmatched notebook whose check cells pass the check a function of their own (here one
    that reads the check's truth from its frame): the grader calls the check with the names
    solutions/ gives it, so the stubs stay "not done"."""
    path = ROOT / "exercises" / "00_setup.ipynb"

    def edit(nb):
        nb.cells.append(nb.cells[0].copy())
        nb.cells[-1].source = (
            "def _answer(*args):\n"
            "    return 0\n"
            "grading.check_tensor_nbytes(lambda *a: _answer(*a))\n"
            "grading.check_pick_training_dtype(_answer)\n")

    results = _judge(path, edit, discover=True)
    assert results == {"tensor_nbytes": ("not done", ""), "pick_training_dtype": ("not done", "")}


def test_the_drawn_cases_are_gone_before_learner_code_runs():
    """The learner's code looks for the grader's drawn cases: the job's folder (found in its
    own memory) no longer holds them, and their descriptor was never its own."""
    path = ROOT / "exercises" / "00_setup.ipynb"
    probe = (
        "import gc, os\n"
        "def _found():\n"
        "    for obj in gc.get_objects():\n"
        "        if isinstance(obj, dict) and isinstance(obj.get('job_dir'), str):\n"
        "            return os.path.exists(os.path.join(obj['job_dir'], 'drawn.py'))\n"
        "    return None\n"
        "FOUND = _found()\n"
        "def tensor_nbytes(shape, dtype):\n"
        "    raise ValueError(f'drawn cases found: {FOUND}')\n")
    results = _judge(path, lambda nb: _set_exercise(nb, "tensor_nbytes", probe))
    assert results["tensor_nbytes"][0] == "failed"
    assert "drawn cases found: False" in results["tensor_nbytes"][1], results
