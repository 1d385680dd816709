"""Hostile submissions (tests/hostile/, one module per attack) graded together, as an instructor
grades a class: each attacker scores exactly what its real answers earn, the victims keep their
scores, nothing outside the sandbox changes (checksums of the submissions, of the course graded
with and of this repository's solutions/ and course_lib/), no process is left behind, and the
grader finishes within its limits with a CSV row for everyone.

The course is graded from a copy in a temporary folder, so that a sandbox failure could not
damage this repository. Without bubblewrap these tests are skipped, with the reason (set
COURSE_REQUIRE_SANDBOX=1, as .ci/run does, to make that a failure).
"""

import csv
import hashlib
import os
import shutil
import time
import uuid

import hostile
import nbformat
import pytest
from notebook_tools import ROOT, read

from course_tools import grade, sandbox

EXERCISE = ROOT / "exercises" / hostile.BASE
SOLUTION = ROOT / "solutions" / hostile.BASE
CELL_TIMEOUT, TIMEOUT, JOBS = 3, 60, 3
CHECKS = ["tensor_nbytes", "pick_training_dtype"]
ATTACKS = hostile.attacks()
LIMITS = ["--cell-output", "20k", "--notebook-output", "100k"]

needs_sandbox = pytest.mark.skipif(
    sandbox.find_bwrap() is None and not os.environ.get("COURSE_REQUIRE_SANDBOX"),
    reason="bubblewrap (bwrap) is not installed: the grader refuses to run without it "
           "(apt-get install bubblewrap)")
pytestmark = needs_sandbox


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(*folders):
    return {p: _sha(p) for f in folders for p in sorted(f.rglob("*")) if p.is_file()
            and "__pycache__" not in p.parts}


def _processes_with(marker: str) -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(entry.name)
            except OSError:
                pass
    return found


def _key(attack) -> str:
    folder = getattr(attack, "FOLDER", attack.__name__.rsplit(".", 1)[1])
    return folder or grade.spreadsheet_safe(getattr(attack, "FILENAME", hostile.BASE))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    course, submitted, out, host_tmp = (tmp / n for n in ("course", "submitted", "out", "hosttmp"))
    for part in ("course_lib", "solutions"):
        shutil.copytree(ROOT / part, course / part, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in (submitted, out, host_tmp):
        folder.mkdir()
    scores = out / "scores.csv"
    marker = f"hostile-{uuid.uuid4().hex}"
    paths = {}
    for name, attack in ATTACKS.items():
        folder = getattr(attack, "FOLDER", name)
        paths[name] = submitted / folder / getattr(attack, "FILENAME", hostile.BASE)
    fill = {"COURSE": str(course), "SUBMISSIONS": str(submitted), "SCORES": str(scores),
            "VICTIM": str(paths["victim"]), "HOSTTMP": str(host_tmp), "MARKER": marker}
    exercise, solution = read(EXERCISE), read(SOLUTION)
    for name, attack in ATTACKS.items():
        nb = hostile.build(attack, exercise, solution, {**fill, "SELF": str(paths[name])})
        paths[name].parent.mkdir(exist_ok=True)
        nbformat.write(nb, paths[name])
    repo = _tree(ROOT / "course_lib", ROOT / "solutions")
    before = _tree(submitted, course)
    start = time.monotonic()
    code = grade.main([str(submitted), "--course", str(course), "--out", str(scores),
                       "--timeout", str(TIMEOUT), "--cell-timeout", str(CELL_TIMEOUT),
                       "--jobs", str(JOBS), "--executed", str(tmp / "executed"), *LIMITS])
    elapsed = time.monotonic() - start
    written = _sha(scores)
    time.sleep(3)  # a detached process would rewrite scores.csv now
    with open(scores, newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    return {"code": code, "elapsed": elapsed, "header": header, "scores": scores,
            "rows": {row["submission"].split(os.sep)[0]: row for row in rows},
            "before": before, "after": _tree(submitted, course), "repo": repo,
            "written": written, "rewritten": _sha(scores), "marker": marker, "fill": fill,
            "executed": tmp / "executed", "paths": paths}


def test_grader_finishes_in_time_with_a_row_for_everyone(graded):
    assert graded["code"] == 0
    assert set(graded["rows"]) == {_key(a) for a in ATTACKS.values()}
    assert graded["header"] == ["submission", "notebook", *CHECKS, "total", "max", "seconds",
                                "notes"]
    # Every submission ends within its limits: the notebook's run, then two checks.
    per_submission = TIMEOUT + 2 * (CELL_TIMEOUT + grade.INTERRUPT_GRACE) + 2 * grade.STARTUP
    assert graded["elapsed"] < per_submission * len(ATTACKS) / JOBS
    for row in graded["rows"].values():
        assert float(row["seconds"]) < per_submission, row
    # A stopped kernel uses no CPU: the wall-clock backstop ends its cell after 3 x 3 s plus the
    # interrupt's 10 s grace, added once. Its whole row, its checks included, stays under what
    # the backstop alone would be with the grace multiplied: 3 x (3 s + 10 s).
    row = graded["rows"][_key(ATTACKS["sigstop_grader"])]
    assert float(row["seconds"]) < grade.WALL_BACKSTOP * (CELL_TIMEOUT + grade.INTERRUPT_GRACE), row


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_submission_scores_exactly_its_real_answers(graded, name):
    attack = ATTACKS[name]
    row = graded["rows"][_key(attack)]
    expected = attack.EXPECTED
    if hasattr(attack, "PROBLEM"):
        assert row["notes"].startswith(attack.PROBLEM), row["notes"]
        assert (row["total"], row["max"], row["notebook"]) == ("0", "0", "")
        assert all(row[c] == "" for c in CHECKS)
        return
    assert row["notebook"] == hostile.BASE
    for check, status in expected.items():
        assert row[check] == ("1" if status == "passed" else "0"), (check, row["notes"])
        if status != "passed":
            assert f"{check}: {status}" in row["notes"], (check, row["notes"])
    assert row["total"] == str(sum(s == "passed" for s in expected.values())), row["notes"]
    assert row["max"] == "2", row  # points from solutions/, never from the notebook
    for note in getattr(attack, "NOTES", ()):
        assert note in row["notes"], row["notes"]


def test_nothing_outside_the_sandbox_changes(graded):
    assert graded["after"] == graded["before"]  # the submissions and the course graded with
    assert _tree(ROOT / "course_lib", ROOT / "solutions") == graded["repo"]
    for path in ATTACKS["write_outside"].OUTSIDE:
        for key, value in graded["fill"].items():
            path = path.replace(f"@@{key}@@", value)
        assert not os.path.exists(path), path


def test_scores_are_not_rewritten_after_the_grader_exits(graded):
    assert graded["rewritten"] == graded["written"]
    assert "everyone" not in graded["scores"].read_text()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_no_process_outlives_the_grading(graded):
    assert _processes_with(graded["marker"]) == []


def test_cut_output_keeps_the_executed_notebook_small(graded):
    executed = graded["executed"] / "endless_print" / hostile.BASE
    size = executed.stat().st_size
    assert size < 100_000 + 20_000  # the notebook cap, plus the cells' own sources
    assert "[output cut by the grader" in executed.read_text()


def test_the_victim_keeps_its_answers(graded):
    text = graded["paths"]["victim"].read_text()
    assert "return 1 + " not in text
    assert graded["rows"]["victim"]["total"] == "2"
