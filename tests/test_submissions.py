"""The grading command: scores per check, untouched submissions, time limits that hold.

Submissions are built from exercises/00_setup.ipynb (two checks): solved, unfilled, one whose
first exercise loops, one whose first exercise loops and ignores the interrupt, one that kills
its kernel, one that fakes "✓" lines. They are graded together by one command, as an
instructor would.
"""

import csv
import hashlib
import os
import time

import pytest
from notebook_tools import ROOT, read

from course_lib import authoring, submissions

EXERCISE = ROOT / "exercises" / "00_setup.ipynb"
SOLUTION = ROOT / "solutions" / "00_setup.ipynb"
CELL_TIMEOUT, TIMEOUT = 10, 120
CHECKS = ["tensor_nbytes", "pick_training_dtype"]


def _exercise_cells(nb):
    return [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]


def _solved(nb):
    answers = {c.metadata["nbgrader"]["grade_id"]: c.source
               for c in _exercise_cells(read(SOLUTION))}
    for cell in _exercise_cells(nb):
        cell.source = answers[cell.metadata["nbgrader"]["grade_id"]]


def _first_exercise(nb, body):
    """Solve both exercises, then replace the first one's body."""
    _solved(nb)
    _exercise_cells(nb)[0].source = "def tensor_nbytes(shape, dtype):\n" + "".join(
        f"    {line}\n" for line in body.splitlines())


def _loops(nb):
    _first_exercise(nb, "while True:\n    pass")


def _ignores_interrupt(nb):
    _first_exercise(nb, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                        "while True:\n    pass")


def _crashes(nb):
    _first_exercise(nb, "import os\nos._exit(1)")


def _fakes(nb):
    """Print "✓" three ways: from the exercise, from an edited check cell, from a fake grading."""
    _first_exercise(nb, 'print("✓ tensor_nbytes: passed.")\nreturn 0')
    check = [c for c in nb.cells if authoring.cell_kind(c) == "check"][1]
    check.source = 'print("✓ pick_training_dtype: passed.")'
    index = next(i for i, c in enumerate(nb.cells) if "from course_lib import grading" in c.source)
    nb.cells.insert(index + 1, authoring.nbformat.v4.new_code_cell(
        "class _Fake:\n"
        "    def __getattr__(self, name):\n"
        "        return lambda *a, **k: print(f\"✓ {name[6:]}: passed.\") or True\n"
        "\n"
        "\n"
        "grading = _Fake()"))


SUBMISSIONS = {
    "solved": (_solved, {"tensor_nbytes": "passed", "pick_training_dtype": "passed"}),
    "unfilled": (lambda nb: None, {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}),
    "loops": (_loops, {"tensor_nbytes": "timeout", "pick_training_dtype": "passed"}),
    "ignores_interrupt": (_ignores_interrupt, {"tensor_nbytes": "timeout",
                                               "pick_training_dtype": "passed"}),
    "crashes": (_crashes, {"tensor_nbytes": "crashed", "pick_training_dtype": "passed"}),
    "fakes": (_fakes, {"tensor_nbytes": "failed", "pick_training_dtype": "edited"}),
}


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submitted")
    for name, (edit, _) in SUBMISSIONS.items():
        nb = read(EXERCISE)
        edit(nb)
        (folder / name).mkdir()
        authoring.nbformat.write(nb, folder / name / "00_setup.ipynb")
    (folder / "broken").mkdir()
    (folder / "broken" / "00_setup.ipynb").write_text("{ not a notebook")
    before = {p: _sha(p) for p in folder.rglob("*") if p.is_file()}
    out = tmp_path_factory.mktemp("scores") / "scores.csv"
    start = time.monotonic()
    code = submissions.main([str(folder), "--out", str(out), "--timeout", str(TIMEOUT),
                             "--cell-timeout", str(CELL_TIMEOUT), "--jobs", "2"])
    elapsed = time.monotonic() - start
    rows = {row["submission"].split(os.sep)[0]: row for row in csv.DictReader(open(out))}
    after = {p: _sha(p) for p in folder.rglob("*") if p.is_file()}
    return {"code": code, "rows": rows, "before": before, "after": after, "elapsed": elapsed,
            "folder": folder}


def test_command_succeeds_and_writes_a_row_per_submission(graded):
    assert graded["code"] == 0
    assert set(graded["rows"]) == {*SUBMISSIONS, "broken"}
    header = list(next(iter(graded["rows"].values())))
    assert header == ["submission", "notebook", *CHECKS, "total", "max", "seconds", "notes"]


@pytest.mark.parametrize("name", list(SUBMISSIONS))
def test_scores_per_check(graded, name):
    row = graded["rows"][name]
    expected = SUBMISSIONS[name][1]
    for check, status in expected.items():
        assert row[check] == ("1" if status == "passed" else "0"), (check, row["notes"])
        if status != "passed":
            assert f"{check}: {status}" in row["notes"], row["notes"]
    assert row["total"] == str(sum(s == "passed" for s in expected.values()))
    assert row["max"] == "2" and row["notebook"] == "00_setup.ipynb"


def test_submissions_are_never_modified(graded):
    assert graded["before"] == graded["after"]
    assert sorted(p.name for p in graded["folder"].rglob("*") if p.is_file()) == [
        "00_setup.ipynb"] * (len(SUBMISSIONS) + 1)


def test_an_unreadable_notebook_scores_zero_and_says_why(graded):
    row = graded["rows"]["broken"]
    assert row["total"] == "0" and row["notes"].startswith("unreadable notebook")


def test_time_limits_hold(graded):
    # Without the limits the looping notebooks would never finish; with them each costs about
    # one cell limit (plus the interrupt grace and a rerun for the one that ignores it).
    for name in ("loops", "ignores_interrupt"):
        assert float(graded["rows"][name]["seconds"]) < TIMEOUT
    assert "ignored the interrupt" in graded["rows"]["ignores_interrupt"]["notes"]
    assert "interrupted at the cell time limit" in graded["rows"]["loops"]["notes"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_no_kernel_or_runner_is_left_behind(graded):
    # Runners and kernels work in a "course_grade_*" temporary directory: none may remain.
    left = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry.name}/cwd")
            except OSError:
                continue
            if "course_grade_" in cwd:
                left.append((entry.name, cwd))
    assert left == []


def test_without_solutions_the_checks_are_read_from_the_notebook():
    expected = submissions._expected_from_submission(read(EXERCISE))
    assert [e.name for e in expected] == CHECKS
    assert all(e.grade_id.startswith("check-") and e.points == 1 for e in expected)
    assert not any(authoring.BEGIN_HIDDEN in e.source for e in expected)


def test_hidden_tests_are_put_back_into_the_check_cells():
    nb = read(EXERCISE)
    expected = submissions._expected_from_solution(read(SOLUTION), SOLUTION.name)
    graded, where, verdict = submissions._graded_copy(nb, expected)
    assert verdict == {} and len(where) == 2
    for e in expected:
        source = graded.cells[where[e.grade_id]].source
        assert authoring.BEGIN_HIDDEN in source and f"assert grading.check_{e.name}(" in source
        assert source.startswith(submissions.REIMPORT)
    assert read(EXERCISE) == nb  # the submission's notebook object is left as it was


def test_check_cells_are_found_when_an_editor_dropped_their_metadata():
    nb = read(EXERCISE)
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
    expected = submissions._expected_from_solution(read(SOLUTION), SOLUTION.name)
    _, where, verdict = submissions._graded_copy(nb, expected)
    assert verdict == {} and len(where) == 2
    del nb.cells[max(where.values())]
    _, where, verdict = submissions._graded_copy(nb, expected)
    assert list(verdict.values()) == ["missing"]


@pytest.mark.parametrize("kwargs,name", [
    ({"timeout": 0}, "timeout"), ({"cell_timeout": -1}, "cell_timeout"), ({"jobs": 0}, "jobs"),
    ({"solutions": "/nonexistent"}, "solutions")])
def test_bad_arguments_raise_value_error_naming_them(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        submissions.grade(tmp_path, **kwargs)


def test_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert submissions.main([str(tmp_path / "nope")]) == 2
    assert "root must be" in capsys.readouterr().err
