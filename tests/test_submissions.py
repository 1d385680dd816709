"""The grading command: scores per check, untouched submissions, time limits that hold, files it
refuses to read, a CSV a spreadsheet cannot run, and the refusal to grade without a sandbox.

Submissions are built from exercises/00_setup.ipynb (two checks): solved, unfilled, one whose
first exercise loops, one whose first exercise loops and ignores the interrupt, one that kills
its process, one that fakes "✓" lines, plus an unreadable file, a named pipe and a link to the
solutions notebook. They are graded together by one command, as an instructor would. The
attacks of a hostile student are in tests/test_hostile_submissions.py.
"""

import csv
import hashlib
import os
import tempfile
import time

import nbformat
import pytest
from notebook_tools import ROOT, read

from course_tools import authoring, grade, sandbox

EXERCISE = ROOT / "exercises" / "00_setup.ipynb"
SOLUTION = ROOT / "solutions" / "00_setup.ipynb"
CELL_TIMEOUT, TIMEOUT = 3, 60
CHECKS = ["tensor_nbytes", "pick_training_dtype"]

needs_sandbox = pytest.mark.skipif(
    sandbox.find_bwrap() is None and not os.environ.get("COURSE_REQUIRE_SANDBOX"),
    reason="bubblewrap (bwrap) is not installed: the grader refuses to run without it "
           "(apt-get install bubblewrap)")


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
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(
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
    # The check cells are run as released and the verdicts come from the checks themselves:
    # the edited check cell costs nothing, the fake "✓" earns nothing.
    "fakes": (_fakes, {"tensor_nbytes": "failed", "pick_training_dtype": "passed"}),
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
        nbformat.write(nb, folder / name / "00_setup.ipynb")
    for name in ("broken", "fifo", "link"):
        (folder / name).mkdir()
    (folder / "broken" / "00_setup.ipynb").write_text("{ not a notebook")
    os.mkfifo(folder / "fifo" / "00_setup.ipynb")  # a reader that opens it blocks forever
    os.symlink(SOLUTION, folder / "link" / "00_setup.ipynb")  # "my" notebook: the solutions
    before = {p: _sha(p) for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}
    out = tmp_path_factory.mktemp("scores") / "scores.csv"
    # The grading run's folder (named in every sandbox's command line) goes in a folder of this
    # test's own, so that the processes it started can be told from anyone else's.
    scratch, tempdir = tmp_path_factory.mktemp("scratch"), tempfile.tempdir
    tempfile.tempdir = str(scratch)
    start = time.monotonic()
    try:
        code = grade.main([str(folder), "--course", str(ROOT), "--out", str(out),
                           "--timeout", str(TIMEOUT), "--cell-timeout", str(CELL_TIMEOUT),
                           "--jobs", "3"])
    finally:
        tempfile.tempdir = tempdir
    elapsed = time.monotonic() - start
    with open(out, newline="") as f:
        rows = {row["submission"].split(os.sep)[0]: row for row in csv.DictReader(f)}
    after = {p: _sha(p) for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}
    return {"code": code, "rows": rows, "before": before, "after": after, "elapsed": elapsed,
            "folder": folder, "scratch": scratch}


@needs_sandbox
def test_command_succeeds_and_writes_a_row_per_submission(graded):
    assert graded["code"] == 0
    assert set(graded["rows"]) == {*SUBMISSIONS, "broken", "fifo", "link"}
    header = list(next(iter(graded["rows"].values())))
    assert header == ["submission", "notebook", *CHECKS, "total", "max", "seconds", "notes"]


@needs_sandbox
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


@needs_sandbox
def test_submissions_are_never_modified(graded):
    assert graded["before"] == graded["after"]
    assert sorted(p.name for p in graded["folder"].rglob("*") if p.is_file()) == [
        "00_setup.ipynb"] * (len(SUBMISSIONS) + 2)  # and the link


@needs_sandbox
@pytest.mark.parametrize("name,why", [("broken", "unreadable notebook"),
                                      ("fifo", "not a regular file"),
                                      ("link", "ELOOP")])
def test_what_is_not_a_notebook_file_scores_zero_and_says_why(graded, name, why):
    row = graded["rows"][name]
    assert row["total"] == "0" and row["notes"].startswith("unreadable notebook"), row
    assert why in row["notes"] or (name == "link" and "Too many levels" in row["notes"]), row


@needs_sandbox
def test_time_limits_hold(graded):
    # Without the limits the looping notebooks would never finish; with them each costs about
    # two cell limits (its own run, then the check), plus the interrupt's grace.
    for name in ("loops", "ignores_interrupt"):
        assert float(graded["rows"][name]["seconds"]) < TIMEOUT
    assert "stopped at cell" in graded["rows"]["ignores_interrupt"]["notes"]
    assert "interrupted at the cell time limit" in graded["rows"]["loops"]["notes"]


@needs_sandbox
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_no_sandbox_is_left_behind(graded):
    # Every sandbox of the run mounts the run's folder, under this test's scratch folder: no
    # process naming it may remain (what ran inside a sandbox dies with it).
    assert not list(graded["scratch"].iterdir())  # the run's folder is removed too
    left = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if str(graded["scratch"]).encode() in f.read():
                        left.append(entry.name)
            except OSError:
                continue
    assert left == []


# --- matching, assignments and the CSV, without running anything -----------------------------


def _assignments():
    return {p.name: grade.load_assignment(p) for p in sorted((ROOT / "solutions").glob("*.ipynb"))}


def test_checks_and_points_come_from_solutions():
    assignment = grade.load_assignment(SOLUTION)
    assert [(c.name, c.points, c.args) for c in assignment.checks] == [
        ("tensor_nbytes", 1.0, ["tensor_nbytes"]),
        ("pick_training_dtype", 1.0, ["pick_training_dtype"])]
    assert all(c.visible.startswith("grading.check_") and authoring.BEGIN_HIDDEN not in c.visible
               for c in assignment.checks)


def test_custom_points_in_solutions_are_kept(tmp_path):
    nb = read(SOLUTION)
    check = next(c for c in nb.cells if authoring.cell_kind(c) == "check")
    check.metadata["nbgrader"]["points"] = 3
    nbformat.write(nb, tmp_path / "00_setup.ipynb")
    assert grade.load_assignment(tmp_path / "00_setup.ipynb").checks[0].points == 3.0


def _renamed_without_course_metadata(nb):
    nb.metadata.pop("course")
    return "my_homework.ipynb"


def _without_any_metadata(nb):
    _renamed_without_course_metadata(nb)
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
    return "Copy of homework.ipynb"


@pytest.mark.parametrize("edit,note", [
    (lambda nb: "00_setup.ipynb", ""),                                 # as released
    (_renamed_without_course_metadata, ""),                            # by its cells
    (_without_any_metadata, ""),
    (lambda nb: "03_gradient_accumulation.ipynb", "differs from"),     # its metadata first
])
def test_a_submission_is_matched_with_its_solutions_notebook(edit, note):
    nb = read(EXERCISE)
    name, why = grade.match(nb, edit(nb), _assignments())
    assert name == "00_setup.ipynb" and note in why


def _without_any_metadata_in_capitals(nb):
    _without_any_metadata(nb)
    nb.cells = [c for c in nb.cells if c.cell_type == "code"][:2]  # too few cells to match by
    return "00_setup.IPYNB"


def test_a_notebook_is_matched_by_its_name_in_any_case():
    nb = read(EXERCISE)
    assert grade.match(nb, _without_any_metadata_in_capitals(nb), _assignments()) == (
        "00_setup.ipynb", "")


def test_every_file_handed_in_gets_a_row(tmp_path, capsys):
    """A notebook whose suffix is in capitals is graded; a file that is not a notebook is
    listed, with the reason; Jupyter's checkpoints and a file browser's hidden files are not."""
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "ann" / ".ipynb_checkpoints" / "00_setup-checkpoint.ipynb").write_text("{}")
    (tmp_path / "ann" / "00_setup.IPYNB").write_text("{ not a notebook")
    (tmp_path / "ann" / "00_setup.py").write_text("def tensor_nbytes(shape, dtype): ...")
    (tmp_path / "ann" / ".DS_Store").write_bytes(b"\0")  # left by the learner's file browser
    assert grade.find_notebooks(tmp_path) == [tmp_path / "ann" / "00_setup.IPYNB",
                                              tmp_path / "ann" / "00_setup.py"]
    results = grade.grade(tmp_path, course=ROOT, unsafe_no_sandbox=True)
    assert [(r.path, r.problem.split(":")[0]) for r in results] == [
        ("ann/00_setup.IPYNB", "unreadable notebook"), ("ann/00_setup.py", "not graded")]
    assert results[1].problem == grade.NOT_A_NOTEBOOK


def test_a_notebook_of_other_text_is_not_matched():
    nb = read(EXERCISE)
    nb.metadata.pop("course")
    nb.cells = [nbformat.v4.new_code_cell("grading.check_tensor_nbytes(f)  # mine")]
    name, why = grade.match(nb, "homework.ipynb", _assignments())
    assert name is None and why.startswith("no notebook of solutions/ matches it")


def test_the_notebook_run_restores_the_released_check_cells():
    nb = read(EXERCISE)
    _fakes(nb)
    run = grade._notebook_to_run(nb, grade.load_assignment(SOLUTION))
    checks = [c.source for c in run.cells if authoring.cell_kind(c) == "check"]
    assert checks == ["grading.check_tensor_nbytes(tensor_nbytes)",
                      "grading.check_pick_training_dtype(pick_training_dtype)"]
    assert all(not c.get("outputs") for c in run.cells if c.cell_type == "code")
    assert read(EXERCISE) != nb and "_Fake" in nb.cells[4].source  # the input is left as it was


@pytest.mark.parametrize("value,safe", [
    ("=1+1+cmd|calc!A0.ipynb", "'=1+1+cmd|calc!A0.ipynb"), ("+1", "'+1"), ("-1", "'-1"),
    ("@SUM(A1)", "'@SUM(A1)"), ("\t=1", "'\t=1"), ("\r=1", "'\r=1"), ("a=1", "a=1"), (3, 3),
    (-1.5, -1.5)])
def test_cells_a_spreadsheet_would_run_are_escaped(value, safe):
    assert grade.spreadsheet_safe(value) == safe


def _sub(path, *names):
    return grade.Submission(path=path, notebook="n.ipynb", checks=[
        grade.CheckResult(name, f"id-{name}", 1.0, 1.0, "passed") for name in names])


def test_checks_cannot_take_a_reserved_column(tmp_path):
    results = [_sub("=cmd.ipynb", "submission", "total", "a"), _sub("b.ipynb", "a", "notes")]
    headers = grade.write_csv(results, tmp_path / "s.csv")
    assert headers == ["check: submission", "check: total", "a", "check: notes"]
    with open(tmp_path / "s.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert len(rows[0]) == len(set(rows[0]))
    assert rows[1][0] == "'=cmd.ipynb" and rows[1][-4:-2] == ["3", "3"]


def test_the_reserved_columns_are_refused_as_check_names():
    from course_lib import grading

    assert set(grading.RESERVED) == set(grade.RESERVED)

    def check_total(fn):
        pass

    with pytest.raises(ValueError, match="total"):
        grading.grader(check_total)
    assert "check_total" not in grading.CHECKS


def test_summary_escapes_control_characters():
    text = grade.summary([_sub("\x1b]0;owned\x07.ipynb", "a")])
    assert "\x1b" not in text and "\\x1b" in text


@pytest.mark.parametrize("text,size", [("512M", 512 << 20), ("4G", 4 << 30), ("100k", 102400),
                                       ("2048", 2048), ("1.5k", 1536)])
def test_sizes_are_read_with_their_units(text, size):
    assert grade.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1", "4X", "0"])
def test_bad_sizes_raise_value_error(text):
    with pytest.raises(ValueError, match="size"):
        grade.parse_size(text)


@pytest.mark.parametrize("kwargs,name", [
    ({"timeout": 0}, "timeout"), ({"cell_timeout": -1}, "cell_timeout"),
    ({"cell_timeout": float("nan")}, "cell_timeout"), ({"timeout": True}, "timeout"),
    ({"jobs": 0}, "jobs"), ({"jobs": 1.5}, "jobs"), ({"course": "/nonexistent"}, "course"),
    ({"assignment": "99_nope.ipynb"}, "assignment"), ({"limits": {}}, "limits")])
def test_bad_arguments_raise_value_error_naming_them(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        grade.grade(tmp_path, **{"course": ROOT, **kwargs})


@pytest.mark.parametrize("field", ["memory_bytes", "processes", "cpu_seconds"])
def test_bad_limits_raise_value_error_naming_them(field):
    with pytest.raises(ValueError, match=field):
        sandbox.Limits(**{field: 0})


def test_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert grade.main([str(tmp_path / "nope"), "--course", str(ROOT)]) == 2
    assert "folder must be" in capsys.readouterr().err


def test_without_bubblewrap_the_grader_refuses_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    (tmp_path / "in").mkdir()
    nbformat.write(read(EXERCISE), tmp_path / "in" / "00_setup.ipynb")
    assert grade.main([str(tmp_path / "in"), "--course", str(ROOT), "--out",
                       str(tmp_path / "s.csv")]) == 2
    err = capsys.readouterr().err
    assert "unsafe_no_sandbox" in err and "bubblewrap" in err
    assert not (tmp_path / "s.csv").exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the grader's check process forks (POSIX)")
def test_unsafe_mode_still_grades_and_says_loudly_what_it_exposes(tmp_path, capsys):
    nb = read(EXERCISE)
    _solved(nb)
    nbformat.write(nb, tmp_path / "00_setup.ipynb")
    out = tmp_path / "out" / "s.csv"
    out.parent.mkdir()
    results = grade.grade(tmp_path / "00_setup.ipynb", course=ROOT, timeout=TIMEOUT,
                          cell_timeout=CELL_TIMEOUT, unsafe_no_sandbox=True)
    assert [(r.total, r.max_points) for r in results] == [(2.0, 2.0)]
    err = capsys.readouterr().err
    assert "WITHOUT a sandbox" in err and "runs as you" in err


@needs_sandbox
def test_unmatched_notebooks_are_graded_on_their_own_check_calls_when_asked(tmp_path):
    nb = read(EXERCISE)
    _exercise_cells(nb)[0].source = next(c.source for c in _exercise_cells(read(SOLUTION)))
    nb.metadata.pop("course")
    nb.cells = [c for c in nb.cells if c.cell_type == "code"]
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
        if "grading.check_" in cell.source or "NotImplementedError" in cell.source:
            cell.source += "  # mine"  # no longer the released text
    nb.cells.append(nbformat.v4.new_code_cell(
        "@grading.grader\ndef check_submission(fn):\n    pass\n\n\n"
        "grading.check_submission(tensor_nbytes)"))
    nbformat.write(nb, tmp_path / "homework.ipynb")
    [default] = grade.grade(tmp_path, course=ROOT, timeout=TIMEOUT, cell_timeout=CELL_TIMEOUT)
    assert default.checks == [] and default.problem.startswith("no notebook of solutions/")
    [asked] = grade.grade(tmp_path, course=ROOT, timeout=TIMEOUT, cell_timeout=CELL_TIMEOUT,
                          grade_unmatched=True)
    assert [(c.name, c.status, c.points) for c in asked.checks] == [
        ("tensor_nbytes", "passed", 1.0), ("pick_training_dtype", "not done", 0.0)]
    assert asked.problem.startswith("not matched with solutions/")
    assert asked.notebook == "00_setup.ipynb" and asked.max_points == 2


def test_an_unmatched_notebook_scores_against_one_assignments_maximum():
    """``--grade-unmatched``: a notebook whose cells call lecture 01's checks and lecture 00's
    easy one is graded as lecture 01, on all of its checks; lecture 00's adds nothing."""
    assignments = _assignments()
    called = [{"id": f"cell-check-{n}", "name": n}
              for n in ("tensor_nbytes", "bytes_per_param", "zero_bytes_per_device")]
    name, checks, note = grade.graded_as(called, assignments)
    assert name == "01_where_the_memory_goes.ipynb" and note.startswith("not matched")
    assert [(c.name, c.max_points) for c in checks] == [
        (c.name, c.points) for c in assignments[name].checks]
    assert [c.grade_id for c in checks if c.grade_id.startswith("cell-check-")] == [
        "cell-check-bytes_per_param", "cell-check-zero_bytes_per_device"]
    assert grade.graded_as([], assignments)[:2] == ("", [])


@needs_sandbox
def test_every_solution_earns_full_marks_from_the_sandboxed_checks():
    # The judge runs every cell as Jupyter does (check calls left out) and each check reads the
    # names its check cell saw: that may not cost a real solution a point.
    from concurrent.futures import ThreadPoolExecutor

    run = grade._Run(ROOT, [ROOT], sandbox.Limits(), False, 600.0, 60.0)
    for slot in range(2):
        run.slots.put(slot)

    def judge(path):
        assignment = grade.load_assignment(path)
        cells = [{"source": c.source, "full": grade._is_exercise_cell(c, assignment)}
                 for c in read(path).cells if c.cell_type == "code"]
        checks = [{"id": c.grade_id, "name": c.name, "args": c.args} for c in assignment.checks]
        slot = run.slots.get()
        try:
            results, _, problem = run.judge(cells, checks, slot)
        finally:
            run.slots.put(slot)
        return path.name, problem, {c["name"]: results.get(c["id"]) for c in checks}

    try:
        with ThreadPoolExecutor(2) as pool:
            judged = list(pool.map(judge, sorted((ROOT / "solutions").glob("*.ipynb"))))
    finally:
        run.close()
    for name, problem, results in judged:
        assert problem == "" and results
        assert all(r == ("passed", "") for r in results.values()), (name, results)


def test_an_environment_under_tmp_is_mounted_over_the_private_tmp(tmp_path):
    """A checkout (and its .venv) under /tmp, as CI's clean clone may be, stays visible: the
    private /tmp is mounted first and the environment's folders onto it."""
    box = sandbox.Sandbox.__new__(sandbox.Sandbox)  # the arguments only, no bubblewrap needed
    box.bwrap, box.root, box.run_dir = "bwrap", False, tmp_path
    box.limits = sandbox.Limits()
    box.env_paths = ["/tmp/clone/.venv", "/usr/lib/python3"]
    args = box._bwrap_args(None, 0)
    tmpfs = next(i for i in range(len(args) - 1) if args[i:i + 2] == ["--tmpfs", "/tmp"])
    venv = next(i for i in range(len(args) - 2)
                if args[i:i + 3] == ["--ro-bind", "/tmp/clone/.venv", "/tmp/clone/.venv"])
    assert tmpfs < venv
