import time

import nbformat
import pytest

from course_tools import authoring

SOLUTION_CELL = """def area(w, h):
    ### BEGIN SOLUTION
    return w * h
    ### END SOLUTION
"""
CHECK_CELL = """grading.check_area(area)
### BEGIN HIDDEN TESTS
assert grading.check_area(area, quiet=True)
### END HIDDEN TESTS"""


def _solution(*sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t")] + [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


@pytest.fixture
def dirs(tmp_path):
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    nbformat.write(_solution(SOLUTION_CELL, CHECK_CELL), sol / "01_t.ipynb")
    return sol, ex


def test_stub_replaces_solution_and_hidden_tests_vanish(dirs):
    sol, ex = dirs
    authoring.generate(sol, ex)
    nb = nbformat.read(ex / "01_t.ipynb", 4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source == f"def area(w, h):\n    {authoring.STUB}"
    assert "return w * h" not in code[0].source
    assert code[1].source == "grading.check_area(area)"
    ns: dict = {}
    exec(code[0].source, ns)
    with pytest.raises(NotImplementedError):
        ns["area"](2, 3)


def test_nbgrader_metadata_on_solution_and_check_cells(dirs):
    sol, ex = dirs
    authoring.generate(sol, ex)
    for nb in (nbformat.read(ex / "01_t.ipynb", 4), nbformat.read(sol / "01_t.ipynb", 4)):
        meta = [c.metadata.get("nbgrader") for c in nb.cells]
        assert meta[0] is None
        assert meta[1]["solution"] and not meta[1]["grade"] and meta[1]["schema_version"] == 3
        assert meta[2]["grade"] and meta[2]["locked"] and meta[2]["points"] == 1
        assert meta[1]["grade_id"] != meta[2]["grade_id"]


def test_generation_is_idempotent_and_detects_staleness(dirs):
    sol, ex = dirs
    assert authoring.generate(sol, ex)  # first run writes
    assert authoring.generate(sol, ex) == []
    nb = nbformat.read(sol / "01_t.ipynb", 4)
    nb.cells[1].source = nb.cells[1].source.replace("w * h", "h * w")
    nb.cells.append(nbformat.v4.new_markdown_cell("new text"))
    nbformat.write(nb, sol / "01_t.ipynb")
    assert authoring.generate(sol, ex, write=False) == [ex / "01_t.ipynb"]


def test_refuses_to_overwrite_a_learners_edits_unless_forced(dirs):
    sol, ex = dirs
    authoring.generate(sol, ex)
    target = ex / "01_t.ipynb"
    learner = nbformat.read(target, 4)
    learner.cells[1].source = "def area(w, h):\n    return w * h  # my answer"
    nbformat.write(learner, target)
    nb = nbformat.read(sol / "01_t.ipynb", 4)
    nb.cells.append(nbformat.v4.new_markdown_cell("a change upstream"))
    nbformat.write(nb, sol / "01_t.ipynb")
    with pytest.raises(authoring.AuthoringError, match="--force"):
        authoring.generate(sol, ex)
    assert "my answer" in target.read_text()  # untouched
    authoring.generate(sol, ex, force=True)
    assert "my answer" not in target.read_text()


def test_outputs_alone_are_not_foreign_changes(dirs):
    sol, ex = dirs
    authoring.generate(sol, ex)
    target = ex / "01_t.ipynb"
    nb = nbformat.read(target, 4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="… area: not done yet")]
    nbformat.write(nb, target)
    src = nbformat.read(sol / "01_t.ipynb", 4)
    src.cells.append(nbformat.v4.new_markdown_cell("upstream"))
    nbformat.write(src, sol / "01_t.ipynb")
    # a learner who only ran the cells is not blocking: the exercise is regenerated
    assert authoring.generate(sol, ex) == [target]
    regenerated = nbformat.read(target, 4)
    assert regenerated.cells[-1].source == "upstream"
    assert all(not c.get("outputs") for c in regenerated.cells if c.cell_type == "code")
    assert authoring.generate(sol, ex) == []


@pytest.mark.parametrize("source,message", [
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "inside a function body"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1", "never closed"),
    ("def f():\n    return 1\n    ### END SOLUTION", "without"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n", "inside another"),
])
def test_marker_mistakes_are_reported(tmp_path, source, message):
    sol = tmp_path / "solutions"
    sol.mkdir()
    nbformat.write(_solution(source), sol / "bad.ipynb")
    with pytest.raises(authoring.AuthoringError, match=message):
        authoring.generate(sol, tmp_path / "exercises")
    assert not (tmp_path / "exercises" / "bad.ipynb").exists()


def test_new_notebook_has_badge_and_bootstrap(tmp_path):
    nb = authoring.new_notebook("notebooks/99_x.ipynb", "Title",
                                [("md", "text"), ("code", "1 + 1", ["t"])], course=tmp_path)
    assert authoring.colab_url("notebooks/99_x.ipynb") in nb.cells[0].source
    assert nb.cells[1].source == authoring.bootstrap_source()
    assert nb.cells[3].metadata["tags"] == ["t"]
    assert nbformat.read(tmp_path / "notebooks" / "99_x.ipynb", 4) == nb
    with pytest.raises(ValueError, match="cell kind"):
        authoring.new_notebook("notebooks/98.ipynb", "T", [("raw", "x")], course=tmp_path)


def test_slides_start_at_section_headings():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"), nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_markdown_cell("## 1. Part\ntext"),
                nbformat.v4.new_markdown_cell("### detail"), nbformat.v4.new_markdown_cell("prose")]
    authoring.stamp_slides(nb)
    kinds = [c.metadata["slideshow"]["slide_type"] for c in nb.cells]
    assert kinds == ["slide", "-", "slide", "subslide", "-"]


def test_sections_in_the_middle_of_a_cell_get_their_own_slides():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(
        "intro\n\n## 2. Two\ntext\n```python\n# a comment, not a heading\n```\n### 2.1 sub\nmore")]
    nb.cells[0].id = "m"
    authoring.stamp_slides(nb)
    assert [c.source.split("\n")[0] for c in nb.cells] == ["intro", "## 2. Two", "### 2.1 sub"]
    assert [c.metadata["slideshow"]["slide_type"] for c in nb.cells] == ["-", "slide", "subslide"]
    assert [c.id for c in nb.cells] == ["m", "m-1", "m-2"]
    authoring.stamp_slides(nb)  # idempotent
    assert len(nb.cells) == 3


def test_check_cells_are_collapsed_and_other_cells_open():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("#@title Check: one is one\nassert 1 == 1"),
                nbformat.v4.new_code_cell("# Check: not the title line\nx = 1"),
                nbformat.v4.new_code_cell("#@title Check: x\nassert x"),
                nbformat.v4.new_markdown_cell("#@title Check: markdown is never a check cell")]
    nb.cells[1].metadata.update(jupyter={"source_hidden": True, "outputs_hidden": False},
                                cellView="form")  # was a check cell, its title since removed
    nb.cells[2].metadata["jupyter"] = {"outputs_hidden": False}
    assert authoring.stamp_check_cells(nb) == 2
    assert nb.cells[0].metadata == {"jupyter": {"source_hidden": True}, "cellView": "form"}
    assert nb.cells[1].metadata == {"jupyter": {"outputs_hidden": False}}
    assert nb.cells[2].metadata == {"jupyter": {"outputs_hidden": False, "source_hidden": True},
                                    "cellView": "form"}
    assert nb.cells[3].metadata == {}
    assert authoring.stamp_check_cells(nb) == 2 and nb.cells[1].metadata == {
        "jupyter": {"outputs_hidden": False}}  # idempotent


def test_a_setup_cell_is_collapsed_too_but_not_counted_as_a_check():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("#@title Setup: the helpers\nimport torch"),
                nbformat.v4.new_code_cell("# Setup, without the title\nimport torch")]
    assert authoring.stamp_check_cells(nb) == 0
    assert nb.cells[0].metadata == {"jupyter": {"source_hidden": True}, "cellView": "form"}
    assert nb.cells[1].metadata == {}


def _stamped(sol):
    authoring.generate(sol, sol.parent / "exercises")
    return nbformat.read(sol / "01_t.ipynb", 4)


def test_generator_keeps_custom_points_and_metadata_in_solutions(dirs):
    sol, ex = dirs
    nb = _stamped(sol)
    nb.cells[2].metadata["nbgrader"]["points"] = 3
    nb.cells[2].metadata["nbgrader"]["grade_id"] = "my-area-check"
    nb.cells[0].metadata["nbgrader"] = {"grade": True, "grade_id": "essay", "points": 2,
                                        "solution": False, "task": True, "schema_version": 3}
    nb.cells[1].metadata["custom"] = {"keep": "me"}
    nbformat.write(nb, sol / "01_t.ipynb")
    text = (sol / "01_t.ipynb").read_text()
    assert authoring.generate(sol, ex) == [ex / "01_t.ipynb"]  # only the exercise changes
    assert (sol / "01_t.ipynb").read_text() == text  # solutions/ untouched, byte for byte
    exercise = nbformat.read(ex / "01_t.ipynb", 4)
    assert exercise.cells[2].metadata["nbgrader"]["points"] == 3
    assert exercise.cells[2].metadata["nbgrader"]["grade_id"] == "my-area-check"
    assert exercise.cells[0].metadata["nbgrader"]["grade_id"] == "essay"
    assert exercise.cells[1].metadata["custom"] == {"keep": "me"}


def test_generator_only_adds_missing_ids_to_solutions(dirs):
    sol, ex = dirs
    nb = _stamped(sol)
    del nb.cells[2].metadata["nbgrader"]["grade_id"]
    nb.cells[2].metadata["nbgrader"]["points"] = 5
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_CELL.replace("area", "volume")))
    nbformat.write(nb, sol / "01_t.ipynb")
    assert sol / "01_t.ipynb" in authoring.generate(sol, ex)
    after = nbformat.read(sol / "01_t.ipynb", 4)
    assert after.cells[2].metadata["nbgrader"]["grade_id"] == f"check-{after.cells[2].id}"
    assert after.cells[2].metadata["nbgrader"]["points"] == 5
    assert after.cells[3].metadata["nbgrader"]["grade"] is True


@pytest.mark.parametrize("points", [-1, float("nan"), "3", True, float("inf")])
def test_bad_points_in_solutions_are_reported(dirs, points):
    sol, ex = dirs
    nb = _stamped(sol)
    nb.cells[2].metadata["nbgrader"]["points"] = points
    nbformat.write(nb, sol / "01_t.ipynb")
    with pytest.raises(authoring.AuthoringError, match="points"):
        authoring.generate(sol, ex)


def _notebook_that_sleeps(path, seconds):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(f"import time\ntime.sleep({seconds})\nprint('ran')")]
    nbformat.write(nb, path)


def test_outputs_are_saved_when_the_file_did_not_change(tmp_path):
    path = tmp_path / "n.ipynb"
    _notebook_that_sleeps(path, 0)
    authoring.execute_in_place(path)
    assert nbformat.read(path, 4).cells[0].outputs[0]["text"] == "ran\n"


def test_outputs_never_overwrite_a_notebook_saved_while_it_ran(tmp_path):
    import threading

    path = tmp_path / "n.ipynb"
    _notebook_that_sleeps(path, 2)
    saved = path.read_text().replace("print('ran')", "print('edited by its author')")

    def save_meanwhile():
        time.sleep(1)
        path.write_text(saved)

    thread = threading.Thread(target=save_meanwhile)
    thread.start()
    with pytest.raises(authoring.AuthoringError, match="changed on disk"):
        authoring.execute_in_place(path)
    thread.join()
    assert path.read_text() == saved
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("kwargs,name", [({"timeout": 0}, "timeout"), ({"attempts": 1.5}, "attempts")])
def test_execute_in_place_rejects_bad_arguments(tmp_path, kwargs, name):
    path = tmp_path / "n.ipynb"
    _notebook_that_sleeps(path, 0)
    with pytest.raises(ValueError, match=name):
        authoring.execute_in_place(path, **kwargs)


def test_the_command_takes_the_course_folder(tmp_path, dirs, capsys):
    sol, ex = dirs
    assert authoring._main(["--course", str(tmp_path), "check"]) == 1
    assert "stale: exercises/01_t.ipynb" in capsys.readouterr().out
    assert authoring._main(["--course", str(tmp_path), "exercises"]) == 0
    assert authoring._main(["--course", str(tmp_path), "check"]) == 0
    assert authoring._main(["--course", str(tmp_path / "nope"), "check"]) == 2


@pytest.mark.parametrize("source,message", [
    # marker variants: taken for plain code, they would carry the solution into exercises/
    ("def f():\n    ### BEGIN SOLUTION (your code)\n    return 1\n    ### END SOLUTION",
     "cell 1: line 2: .* is not a marker"),
    ("def f():\n    #### BEGIN SOLUTION\n    return 1\n    #### END SOLUTION", "not a marker"),
    ("def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION", "not a marker"),
    ("def f():\n    ### begin solution\n    return 1\n    ### end solution", "not a marker"),
    ("def f():\n    return 1  ### BEGIN SOLUTION\n", "not a marker"),
    ("x = 1\n#### BEGIN HIDDEN TESTS\nassert x\n### END HIDDEN TESTS", "not a marker"),
    # markers the line-based replacement would misread
    ('def f():\n    s = """\n    ### BEGIN SOLUTION\n    """\n    return 1\n    ### END SOLUTION',
     "inside a string"),
    ("if True:\n    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION", "at a If block"),
    ("for i in range(2):\n    ### BEGIN SOLUTION\n    x = i\n    ### END SOLUTION",
     "at a For block"),
    ("class A:\n    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION", "at a ClassDef block"),
    ("def f(x):\n    if x:\n        ### BEGIN SOLUTION\n        return 1\n        ### END SOLUTION\n"
     "    return 0", "at a If block"),
    ("def f():\n    ### BEGIN SOLUTION\n    return (1\n    ### END SOLUTION", "not valid Python"),
])
def test_marker_variants_and_misplaced_markers_are_refused(tmp_path, source, message):
    sol = tmp_path / "solutions"
    sol.mkdir()
    nbformat.write(_solution(source), sol / "bad.ipynb")
    with pytest.raises(authoring.AuthoringError, match=message):
        authoring.generate(sol, tmp_path / "exercises")
    assert not (tmp_path / "exercises").exists()


def test_markers_in_nested_functions_and_methods_are_accepted(tmp_path):
    source = ("class A:\n    def area(self, w, h):\n        ### BEGIN SOLUTION\n"
              "        return w * h\n        ### END SOLUTION\n\n"
              "def outer():\n    def inner():\n        ### BEGIN SOLUTION\n        return 2\n"
              "        ### END SOLUTION\n    return inner")
    sol = tmp_path / "solutions"
    sol.mkdir()
    nbformat.write(_solution(source), sol / "ok.ipynb")
    authoring.generate(sol, tmp_path / "exercises")
    code = nbformat.read(tmp_path / "exercises" / "ok.ipynb", 4).cells[1].source
    assert "w * h" not in code and "return 2" not in code and code.count(authoring.STUB) == 2
    compile(code, "exercise", "exec")


def test_no_committed_exercise_holds_a_solution_line():
    """Every line between the markers in solutions/ is absent from the exercise cell."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "solutions").glob("*.ipynb")):
        solution = nbformat.read(path, 4)
        exercise = nbformat.read(root / "exercises" / path.name, 4)
        pairs = zip([c for c in solution.cells if c.cell_type == "code"],
                    [c for c in exercise.cells if c.cell_type == "code"], strict=True)
        for sol_cell, ex_cell in pairs:
            inside = False
            for line in sol_cell.source.splitlines():
                if line.strip() in (authoring.BEGIN_SOLUTION, authoring.END_SOLUTION):
                    inside = line.strip() == authoring.BEGIN_SOLUTION
                elif inside and len(line.strip()) > 12:
                    assert line not in ex_cell.source.splitlines(), (path.name, line)
            assert "SOLUTION" not in ex_cell.source


@pytest.mark.parametrize("kwargs", [{"force": "no"}, {"write": "no"}, {"force": 1},
                                    {"write": None}])
def test_generate_takes_bools_only(dirs, kwargs):
    sol, ex = dirs
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        authoring.generate(sol, ex, **kwargs)
    assert not ex.exists()


def _generate_refuses(tmp_path, nb, message):
    sol = tmp_path / "solutions"
    sol.mkdir()
    nbformat.write(nb, sol / "bad.ipynb")
    with pytest.raises(authoring.AuthoringError, match=message):
        authoring.generate(sol, tmp_path / "exercises")
    assert not (tmp_path / "exercises").exists()


@pytest.mark.parametrize("marker", [
    "### {}_SOLUTION", "### {}-SOLUTION", "### {}SOLUTION", "### SOLUTION {}",
    "### {}\u200b SOLUTION", "### {} S\u041eLUTION", "### {} \uff33\uff2f\uff2c\uff35\uff34\uff29\uff2f\uff2e",
    "### {} HIDDEN\u200bTESTS", "### {} hidden-tests", "### {} s\u043elution",
])
def test_marker_lookalikes_stop_the_generation(tmp_path, marker):
    begin, end = marker.format("BEGIN"), marker.format("END")
    source = f"def f():\n    {begin}\n    return 42  # the answer\n    {end}"
    _generate_refuses(tmp_path, _solution(source), r"bad\.ipynb cell 1: line 2: .* not a marker")


def _cell(kind, source, **metadata):
    make = {"markdown": nbformat.v4.new_markdown_cell, "raw": nbformat.v4.new_raw_cell,
            "code": nbformat.v4.new_code_cell}[kind]
    cell = make(source)
    cell.metadata.update(metadata)
    return cell


ANSWER = {"grade": True, "grade_id": "why", "points": 2, "schema_version": 3,
          "solution": True, "task": False, "locked": False}


@pytest.mark.parametrize("cell,message", [
    (_cell("markdown", "### BEGIN SOLUTION\nThe answer is 42.\n### END SOLUTION"), "marker"),
    (_cell("raw", "### BEGIN SOLUTION\nThe answer is 42.\n### END SOLUTION"), "marker"),
    (_cell("markdown", "### BEGIN HIDDEN TESTS\nassert f() == 42\n### END HIDDEN TESTS"), "marker"),
    (_cell("markdown", "=== BEGIN MARK SCHEME ===\n42, 1 point\n=== END MARK SCHEME ==="),
     "marker"),
    (_cell("code", "x = 1", note="### BEGIN SOLUTION"), "marker"),
    # nbgrader's answer cells: autograded (code, no markers) and manually graded (Markdown)
    (_cell("code", "def f():\n    return 42", nbgrader={**ANSWER, "grade": False}), "nbgrader"),
    (_cell("markdown", "The answer is 42, because ...", nbgrader=ANSWER), "nbgrader"),
    (_cell("raw", "42", nbgrader=ANSWER), "nbgrader"),
])
def test_markers_outside_code_and_unmarked_answer_cells_stop_the_generation(
        tmp_path, cell, message):
    nb = _solution(SOLUTION_CELL)
    nb.cells.append(cell)
    _generate_refuses(tmp_path, nb, rf"bad\.ipynb cell 2: .*{message}")


LONG = "def area(w, h):\n    ### BEGIN SOLUTION\n    return width_of(w) * h\n    ### END SOLUTION"


def _quoting(where):
    nb = _solution(LONG, "x = 1")
    cell = nb.cells[2]
    if where == "markdown":
        nb.cells.append(nbformat.v4.new_markdown_cell("Hint: `return  width_of(w) * h`"))
    elif where == "metadata":
        cell.metadata["notes"] = {"answer": "return width_of(w) * h"}
    elif where == "attachment":
        nb.cells.append(nbformat.v4.new_markdown_cell("![a](attachment:a.txt)"))
        nb.cells[3].attachments = {"a.txt": {"text/plain": "return width_of(w) * h"}}
    elif where == "notebook":
        nb.metadata["answers"] = ["return width_of(w) * h"]
    else:  # a later cell's output printed the solution: outputs are never copied
        cell.outputs = [nbformat.v4.new_output("stream", text="return width_of(w) * h\n")]
    return nb


@pytest.mark.parametrize("where,message", [
    ("markdown", "cell 3: it holds the solution of cell 1"),
    ("metadata", "cell 2: it holds the solution of cell 1"),
    ("attachment", "cell 3: it holds the solution of cell 1"),
    ("notebook", "metadata: it holds the solution of cell 1"),
])
def test_a_solution_quoted_elsewhere_stops_the_generation(tmp_path, where, message):
    _generate_refuses(tmp_path, _quoting(where), message)


def test_outputs_never_reach_the_exercise(tmp_path):
    sol = tmp_path / "solutions"
    sol.mkdir()
    nbformat.write(_quoting("output"), sol / "ok.ipynb")
    authoring.generate(sol, tmp_path / "exercises")
    assert "width_of" not in (tmp_path / "exercises" / "ok.ipynb").read_text()


@pytest.mark.parametrize("target", ["solutions", "solutions/sub", ".", "notebooks",
                                    "course_lib/x"])
def test_the_generator_never_writes_over_its_sources(dirs, target):
    sol, ex = dirs
    before = (sol / "01_t.ipynb").read_text()
    with pytest.raises(ValueError, match="exercises_dir"):
        authoring.generate(sol, sol.parent / target, force=True)
    assert (sol / "01_t.ipynb").read_text() == before
    assert sorted(p.name for p in sol.parent.rglob("*")) == ["01_t.ipynb", "solutions"]


def test_an_exercise_linked_to_its_solution_is_replaced_not_written_through(dirs):
    sol, ex = dirs
    authoring.generate(sol, sol.parent / "elsewhere")  # adds the solution's nbgrader metadata
    before = (sol / "01_t.ipynb").read_text()
    ex.mkdir()
    (ex / "01_t.ipynb").symlink_to(sol / "01_t.ipynb")
    authoring.generate(sol, ex, force=True)
    assert (sol / "01_t.ipynb").read_text() == before
    assert not (ex / "01_t.ipynb").is_symlink()
    assert "w * h" not in (ex / "01_t.ipynb").read_text()
