import nbformat
import pytest

from course_lib import authoring

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
    authoring.generate(sol, ex)  # a learner who only ran the cells is not blocking


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


def test_new_notebook_has_badge_and_bootstrap(tmp_path, monkeypatch):
    monkeypatch.setattr(authoring, "ROOT", tmp_path)
    nb = authoring.new_notebook("notebooks/99_x.ipynb", "Title", [("md", "text"), ("code", "1 + 1", ["t"])])
    assert authoring.colab_url("notebooks/99_x.ipynb") in nb.cells[0].source
    assert nb.cells[1].source == authoring.bootstrap_source()
    assert nb.cells[3].metadata["tags"] == ["t"]
    with pytest.raises(ValueError, match="cell kind"):
        authoring.new_notebook("notebooks/98.ipynb", "T", [("raw", "x")])


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
