"""What the grader writes survives what submissions hold: the scores (CSV and JSON) and the
executed notebooks returned to learners."""

import csv
import json
import os
import re
from html.parser import HTMLParser

import nbformat
import pytest

from course_tools import grade


def _sub(path, notes="", status="passed"):
    sub = grade.Submission(path=path, notebook="n.ipynb", checks=[
        grade.CheckResult("a", "id-a", 1.0, 1.0 if status == "passed" else 0.0, status)],
        problem=notes)
    return sub


def test_unencodable_text_is_escaped_and_every_row_is_written(tmp_path):
    out = tmp_path / "scores.csv"
    # an exception message with a lone surrogate, a file name with the byte 0xff
    results = [_sub("a.ipynb"), _sub("b.ipynb", notes="ValueError: \ud800"),
               _sub(os.fsdecode(b"c\xff.ipynb")), _sub("d.ipynb")]
    grade.write_csv(results, out)
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert [r[0] for r in rows[1:]] == ["a.ipynb", "b.ipynb", "c\\udcff.ipynb", "d.ipynb"]
    assert "\\ud800" in rows[2][-1]
    grade.write_results(results, tmp_path / "scores.json")
    data = json.loads((tmp_path / "scores.json").read_text())
    assert [d["submission"] for d in data][-1] == "d.ipynb" and len(data) == 4


def test_a_failure_while_writing_leaves_the_older_scores_whole(tmp_path, monkeypatch):
    out = tmp_path / "scores.csv"
    out.write_text("submission,total\nold.ipynb,3\n")

    class Broken:
        def __init__(self, f):
            self.f = f

        def writerows(self, rows):
            self.f.write("submission,half a file")
            raise OSError("disk full")

    monkeypatch.setattr(grade.csv, "writer", Broken)
    with pytest.raises(OSError, match="disk full"):
        grade.write_csv([_sub("a.ipynb")], out)
    assert out.read_text() == "submission,total\nold.ipynb,3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.csv"]  # no temporary left


def test_executed_notebooks_come_back_without_active_content():
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    code = nbformat.v4.new_code_cell("x")
    code.outputs = [
        nbformat.v4.new_output("display_data", data={
            "text/html": "<script>steal()</script>", "text/plain": "<IPython.HTML>"}),
        nbformat.v4.new_output("display_data", data={
            "application/javascript": "steal()"}),
        nbformat.v4.new_output("display_data", data={"image/png": "iVBOR", "text/html": "<img>"}),
        nbformat.v4.new_output("stream", text="2 passed\n")]
    nb.cells = [nbformat.v4.new_markdown_cell('<img src=x onerror="steal()"> **bold** & co'),
                nbformat.v4.new_raw_cell("<script>steal()</script>"), code]
    clean = nbformat.reads(grade.inert_notebook(nbformat.writes(nb)), as_version=4)
    text = nbformat.writes(clean)
    assert "<script" not in text and "<img" not in text and "widgets" not in clean.metadata
    assert clean.cells[0].source == '&lt;img src=x onerror="steal()"> **bold** &amp; co'
    assert clean.cells[1].cell_type == "markdown"
    outputs = clean.cells[2].outputs
    assert outputs[0].data == {"text/plain": "<IPython.HTML>"}
    assert "removed by the grader" in outputs[1].data["text/plain"]
    assert set(outputs[2].data) == {"image/png"} and outputs[3].text == "2 passed\n"
    assert grade.inert_notebook("not json") == "not json"


_LINKS = ["[a](javascript:steal())", "[b](JaVaScRiPt:steal())", "[c]( vbscript:msgbox(1) )",
          "[d](data:text/html;base64,PHNjcmlwdD4=)", "[e](javascript&#58;steal())",
          "[f](java&#x09;script:steal())", "[f2](javascript&amp;#58;steal())", "[g](javascript\\:steal())", "[h](DATA\\:text/html,x)",
          "![i](data:image/svg+xml;base64,PHN2Zz4=)", "[j][ref]\n\n[ref]: javascript:steal()",
          "<a href='javascript:steal()'>k</a>", "[l](https://pytorch.org)"]


@pytest.mark.parametrize("markdown", _LINKS)
def test_links_in_returned_notebooks_cannot_run_code(markdown):
    """Every link and image of a learner's Markdown, exported to HTML and read as a browser reads
    a URL (entities decoded, tabs and line breaks dropped, spaces trimmed), is not a
    ``javascript:``, ``vbscript:`` or ``data:`` URL."""
    from nbconvert import HTMLExporter

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(markdown)]
    page, _ = HTMLExporter().from_notebook_node(
        nbformat.reads(grade.inert_notebook(nbformat.writes(nb)), as_version=4))
    urls = []

    class Links(HTMLParser):
        def handle_starttag(self, tag, attrs):
            urls.extend(re.sub(r"[\t\n\r]", "", v).strip("".join(map(chr, range(33)))).lower()
                        for k, v in attrs if k in ("href", "src") and v)

    Links().feed(page[page.index("jp-MarkdownCell"):])
    assert not [u for u in urls if u.split(":")[0] in ("javascript", "vbscript", "data")], urls
    if "pytorch" in markdown:
        assert "https://pytorch.org" in urls  # an ordinary link stays a link
