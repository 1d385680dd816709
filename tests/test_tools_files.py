"""The files the course's tools write: the grader's scores and executed notebooks go where
they are meant to, private to their owner, and never over what a learner or instructor wrote."""

import json
import os

import nbformat
import pytest

from course_tools import grade


def _sub(path):
    return grade.Submission(path=path, notebook="n.ipynb", checks=[
        grade.CheckResult("a", "id-a", 1.0, 1.0, "passed")])


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A course folder, submissions and a grading run that returns one result at once."""
    course = tmp_path / "course"
    for part in ("solutions", "course_lib", "notebooks"):
        (course / part).mkdir(parents=True)
    (course / "solutions" / "00_setup.ipynb").write_text("the instructor's solution")
    (course / "README.md").write_text("the course's README")
    (tmp_path / "submitted").mkdir()
    (tmp_path / "submitted" / "a.ipynb").write_text("a learner's notebook")
    (tmp_path / "notes.json").write_text('{"the instructor": "notes"}')
    monkeypatch.setattr(grade, "grade", lambda *args, **kwargs: [_sub("a.ipynb")])
    return course


def _main(tmp_path, course, out, *more):
    return grade.main([str(tmp_path / "submitted"), "--course", str(course), "--out", str(out),
                       *more])


@pytest.mark.parametrize("name", ["scores.json", "scores.csv", "scores"])
def test_the_csv_and_the_json_are_each_written_once_where_intended(tmp_path, course, name):
    (tmp_path / "out").mkdir()
    assert _main(tmp_path, course, tmp_path / "out" / name) == 0
    csv_path = tmp_path / "out" / ("scores" if name == "scores" else "scores.csv")
    assert json.loads((tmp_path / "out" / "scores.json").read_text())[0]["submission"] == "a.ipynb"
    assert csv_path.read_text().startswith("submission,notebook,a,")
    assert _main(tmp_path, course, tmp_path / "out" / name) == 0  # a second run replaces both


@pytest.mark.parametrize("out", ["course/solutions/00_setup.ipynb", "course/solutions/new.csv",
                                 "course/course_lib/scores.csv", "course/README.md",
                                 "submitted/scores.csv", "returned/scores.csv", "notes.json",
                                 "notes.csv"])
def test_out_never_overwrites_what_learners_and_instructors_wrote(tmp_path, course, out, capsys):
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert _main(tmp_path, course, tmp_path / out, "--executed", str(tmp_path / "returned")) == 2
    assert "out must be" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def _mode(path):
    return oct(path.stat().st_mode & 0o777)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_scores_and_executed_notebooks_are_private(tmp_path, monkeypatch, umask_022):
    out = tmp_path / "grades" / "term" / "scores.csv"
    (tmp_path / "grades").mkdir()  # the instructor's folder keeps its mode
    grade.write_csv([_sub("a.ipynb")], out)
    grade.write_results([_sub("a.ipynb")], out.with_suffix(".json"))
    assert [_mode(p) for p in (out, out.with_suffix(".json"), out.parent, tmp_path / "grades")
            ] == ["0o600", "0o600", "0o700", "0o755"]

    class Run:
        def run_notebook(self, nb, slot):
            return [], nbformat.writes(nbformat.v4.new_notebook())

    monkeypatch.setattr(grade, "_notebook_to_run", lambda nb, chosen: nb)
    executed = tmp_path / "returned"
    assert grade._run_and_save(Run(), None, None, 0, executed, "alice/00_setup.ipynb") == []
    saved = executed / "alice" / "00_setup.ipynb"
    assert nbformat.reads(saved.read_text(), as_version=4).cells == []
    assert [_mode(p) for p in (saved, saved.parent, executed)] == ["0o600", "0o700", "0o700"]


def test_an_executed_notebook_replaces_a_link_and_never_writes_through_it(tmp_path, monkeypatch):
    class Run:
        def run_notebook(self, nb, slot):
            return [], nbformat.writes(nbformat.v4.new_notebook())

    monkeypatch.setattr(grade, "_notebook_to_run", lambda nb, chosen: nb)
    (tmp_path / "returned").mkdir()
    mine = tmp_path / "instructor.ipynb"
    mine.write_text("the instructor's notebook")
    (tmp_path / "returned" / "a.ipynb").symlink_to(mine)
    grade._run_and_save(Run(), None, None, 0, tmp_path / "returned", "a.ipynb")
    assert mine.read_text() == "the instructor's notebook"
    assert not (tmp_path / "returned" / "a.ipynb").is_symlink()
