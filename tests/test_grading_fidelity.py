"""The grader runs a learner's cells as Jupyter ran them, so a notebook that shows ✓ for every
check in Jupyter scores the same: every statement of every cell (a table built by a loop, a
constant set in an ``if``), magics (``%%time``), a scratch cell that takes seconds (run once,
not once per check), a machine whose CPU is busy elsewhere (limits count CPU time), and the
state each check cell saw (a later cell cannot take a point away).

Each notebook is ``solutions/00_setup.ipynb`` with one honest change. The judge runs as in the
sandbox, minus bubblewrap (tests/test_submissions.py grades in the sandbox).
"""

import contextlib
import json
import os
import shutil

import nbformat
import pytest
from notebook_tools import ROOT, read, run_judge

from course_tools import grade, sandbox

SOLUTION = ROOT / "solutions" / "00_setup.ipynb"
PASSED = {"tensor_nbytes": ("passed", ""), "pick_training_dtype": ("passed", "")}
CELL_TIMEOUT = 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _judge(nb) -> dict:
    """The grader's judge on ``nb`` (graded against solutions/00_setup.ipynb): ``{check:
    (status, detail)}``."""
    assignment = grade.load_assignment(SOLUTION)
    cells = [{"source": c.source, "full": grade._is_exercise_cell(c, assignment),
              "id": grade._grade_id(c)} for c in nb.cells if c.cell_type == "code"]
    messages = run_judge({
        "cells": cells, "discover": False, "canonical": {},
        "checks": [{"id": c.grade_id, "name": c.name, "args": c.args} for c in assignment.checks],
        "cell_timeout": CELL_TIMEOUT, "timeout": 60, "wall_backstop": grade.WALL_BACKSTOP,
        "message_chars": grade.MESSAGE_CHARS})
    names = {c.grade_id: c.name for c in assignment.checks}
    return {names[m["id"]]: (m["status"], m["detail"]) for m in messages
            if m.get("event") == "check"}


def _cell(nb, grade_id):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def _after_imports(nb, source):
    index = next(i for i, c in enumerate(nb.cells) if "from course_lib import grading" in c.source)
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(source))


TABLE_BY_A_LOOP = '''
BYTES_PER_ELEMENT = {}
for _dtype in [getattr(torch, name) for name in dir(torch)]:
    if isinstance(_dtype, torch.dtype):
        BYTES_PER_ELEMENT.update({_dtype: torch.empty((), dtype=_dtype).element_size()})
'''
USES_THE_TABLE = '''def tensor_nbytes(shape, dtype):
    count = 1
    for n in shape:
        count *= n
    return count * BYTES_PER_ELEMENT[dtype]
'''


def test_a_helper_table_built_by_a_loop_is_there():
    nb = read(SOLUTION)
    _after_imports(nb, TABLE_BY_A_LOOP)
    _cell(nb, "solution-c005").source = USES_THE_TABLE
    assert _judge(nb) == PASSED


CONSTANTS = '''
ELEMENT_BYTES = {}
for _dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool):
    ELEMENT_BYTES[_dtype] = torch.empty((), dtype=_dtype).element_size()
ELEMENT_BYTES |= {torch.complex64: 8, torch.complex128: 16}
if hasattr(torch, "bfloat16"):
    HALF_WITH_BF16 = torch.bfloat16
else:
    HALF_WITH_BF16 = torch.float16
'''


def test_helper_constants_set_by_any_statement_are_there():
    """A correct helper constant costs no point, whatever statement sets it (an augmented
    assignment, an ``if``, a loop)."""
    nb = read(SOLUTION)
    _after_imports(nb, CONSTANTS)
    _cell(nb, "solution-c005").source = USES_THE_TABLE.replace("BYTES_PER_ELEMENT",
                                                               "ELEMENT_BYTES")
    _cell(nb, "solution-c008").source = (
        "def pick_training_dtype(device_type, has_native_bf16):\n"
        "    if device_type == 'cpu':\n"
        "        return torch.float32\n"
        "    return HALF_WITH_BF16 if has_native_bf16 else torch.float16\n")
    assert _judge(nb) == PASSED


def test_magics_run_and_a_failing_cell_does_not_stop_the_next():
    nb = read(SOLUTION)
    _after_imports(nb, "%matplotlib inline\nprint(undefined_name)")
    for grade_id in ("solution-c005", "solution-c008"):
        cell = _cell(nb, grade_id)
        cell.source = "%%time\n" + cell.source
    assert _judge(nb) == PASSED


def test_a_slow_scratch_cell_runs_once():
    """A demo that takes longer than a check's limit (in wall-clock time) before the
    exercises: it runs once, as in Jupyter, not again inside each check's limit."""
    nb = read(SOLUTION)
    _after_imports(nb, "import time\n\ndemo = time.sleep(CELL_TIMEOUT + 1)".replace(
        "CELL_TIMEOUT", str(CELL_TIMEOUT)))
    assert _judge(nb) == PASSED


def test_a_loaded_machine_does_not_time_out_an_honest_check():
    """A check limit counts CPU time: the learner's function waits longer than the limit on
    its first call (as it would on a machine busy with other work), using no CPU; it passes
    within the wall-clock backstop."""
    nb = read(SOLUTION)
    cell = _cell(nb, "solution-c005")
    cell.source = cell.source.replace(
        "    elements = 1\n",
        f"    import time\n    if not getattr(time, 'waited', False):\n"
        f"        time.waited = time.sleep({CELL_TIMEOUT + 1}) or True\n    elements = 1\n")
    assert "time.waited" in cell.source
    assert _judge(nb) == PASSED


def test_each_check_sees_the_names_its_check_cell_saw():
    """A scratch cell after a check cell rebinds the exercise's name: the check, ✓ where it
    ran in the notebook, still passes."""
    nb = read(SOLUTION)
    index = nb.cells.index(_cell(nb, "check-c006"))
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell("tensor_nbytes = None"))
    assert _judge(nb) == PASSED


needs_sandbox = pytest.mark.skipif(
    sandbox.find_bwrap() is None and not os.environ.get("COURSE_REQUIRE_SANDBOX"),
    reason="bubblewrap (bwrap) is not installed: the grader refuses to run without it "
           "(apt-get install bubblewrap)")


@needs_sandbox
def test_in_the_sandbox_an_honest_notebook_scores_what_jupyter_showed(tmp_path):
    nb = read(SOLUTION)
    _after_imports(nb, TABLE_BY_A_LOOP + "\nimport time\n\ndemo = time.sleep(4)")
    _cell(nb, "solution-c005").source = "%%time\n" + USES_THE_TABLE
    nbformat.write(nb, tmp_path / "00_setup.ipynb")
    [result] = grade.grade(tmp_path, course=ROOT, timeout=60, cell_timeout=CELL_TIMEOUT)
    assert [(c.name, c.status, c.points) for c in result.checks] == [
        ("tensor_nbytes", "passed", 1.0), ("pick_training_dtype", "passed", 1.0)], result.notes


def _quota_cgroup():
    """A cpu cgroup below this process's own with a quota of a quarter of a CPU (cgroup v1, as
    root), or None where none can be made."""
    from course_tools.sandbox import Cgroups

    cgroups = Cgroups()
    if cgroups.version != "v1":
        return None
    folder = cgroups.bases["cpu"] / f"course-fidelity-{os.getpid()}"
    try:
        folder.mkdir()
        (folder / "cpu.cfs_period_us").write_text("100000")
        (folder / "cpu.cfs_quota_us").write_text("25000")
    except OSError:
        with contextlib.suppress(OSError):
            folder.rmdir()
        return None
    return folder


@needs_sandbox
def test_under_a_cpu_quota_an_honest_notebook_scores_full_marks(tmp_path):
    """The grader given a quarter of a CPU (a cgroup quota, as a loaded machine would): lecture
    03's solution, its checks limited to 3 s, scores full marks, as the limits count CPU time."""
    folder = _quota_cgroup()
    if folder is None:
        pytest.skip("needs a writable cgroup v1 cpu controller (root)")
    shutil.copy(ROOT / "solutions" / "03_gradient_accumulation.ipynb", tmp_path)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, in the cgroup with its sandboxes
        try:
            os.close(read_fd)
            (folder / "cgroup.procs").write_text(str(os.getpid()))
            [result] = grade.grade(tmp_path, course=ROOT, timeout=60, cell_timeout=CELL_TIMEOUT)
            os.write(write_fd, json.dumps([result.total, result.max_points,
                                           result.notes]).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    data = b""
    while chunk := os.read(read_fd, 1 << 16):
        data += chunk
    os.close(read_fd)
    os.waitpid(pid, 0)
    with contextlib.suppress(OSError):  # its sandboxes' cgroups are gone with them
        folder.rmdir()
    total, most, notes = json.loads(data)
    assert total == most == 4, notes
