"""Read exercise functions and check calls out of the course notebooks, without running them."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat

from course_tools.authoring import cell_kind

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
LECTURES = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: Lectures whose core is still being cut to size (issue "Lectures a learner finishes"): the
#: reading rules and the guide's quotes are expected to fail for them; each leaves this set as
#: it is rewritten, and the set must be empty when the issue closes.
PENDING: set[str] = set()
#: Each lecture's depth: the companion notebook it links to (notebooks/deeper/NN_*.ipynb).
COMPANIONS = sorted((ROOT / "notebooks" / "deeper").glob("*.ipynb"))


def read(path):
    return nbformat.read(path, as_version=4)


def definitions(path) -> dict:
    """Namespace of a notebook's imports, functions and classes, then its solution cells.

    Data cells (assignments, training runs) are skipped: checks build their own
    cases, so the exercise functions must not depend on notebook state.
    """
    nb = read(path)
    namespace: dict = {"__name__": "exercise_notebook"}
    for cell in nb.cells:
        if cell.cell_type != "code" or cell_kind(cell) == "check":
            continue
        if cell_kind(cell) == "solution":
            exec(compile(cell.source, f"{Path(path).name}", "exec"), namespace)
            continue
        tree = ast.parse(cell.source)
        keep = [n for n in tree.body if isinstance(
            n, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef)]
        exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def check_calls(path) -> list[tuple[str, list[str]]]:
    """``[(check name, [argument names])]`` for every visible check call of a notebook."""
    calls = []
    for cell in read(path).cells:
        if cell_kind(cell) != "check":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("check_")
                    and not any(k.arg == "quiet" for k in node.keywords)):
                calls.append((node.func.attr, [ast.unparse(a) for a in node.args]))
    return calls


def is_hidden_code(cell) -> bool:
    """A check or setup cell (collapsed) or the Colab bootstrap cell: code a reader does not
    read."""
    return cell.source.startswith("#@title ")


def printed_lines(cell) -> list[str]:
    """The lines a code cell's outputs show as text (a table row counts as one line)."""
    lines = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            lines += output.get("text", "").splitlines()
        elif "data" in output:
            data = output["data"]
            if "text/html" in data:
                lines += ["<tr>"] * data["text/html"].count("<tr")
            elif not ({"image/png", "application/vnd.jupyter.widget-view+json"} & set(data)):
                lines += data.get("text/plain", "").splitlines()
    return lines


def reading_size(path) -> dict:
    """What a reader meets in a lecture: the measures of the size rule of DESIGN.md.

    ``words`` of markdown, ``code_lines`` (non-blank lines of the visible code cells: check
    cells and the Colab cell not counted), ``longest_cell`` (the most such lines in one cell),
    ``printed_lines`` (text the outputs show, a table row a line) and ``cells`` (markdown and
    visible code cells).
    """
    import re

    nb = read(path)
    visible = [c for c in nb.cells if c.cell_type == "code" and not is_hidden_code(c)]
    lines = [len([x for x in c.source.splitlines() if x.strip()]) for c in visible]
    markdown = [c for c in nb.cells if c.cell_type == "markdown"]
    return {
        "words": sum(len(re.findall(r"\S+", c.source)) for c in markdown),
        "code_lines": sum(lines),
        "longest_cell": max(lines, default=0),
        "printed_lines": sum(len(printed_lines(c)) for c in nb.cells if c.cell_type == "code"),
        "cells": len(markdown) + len(visible),
    }


def run_judge(job: dict) -> list[dict]:
    """The grader's judge (``inside.judge``, as in the sandbox minus bubblewrap) on ``job``, in a
    forked process, with the drawn cases in a folder of their own that is removed once the judge
    holds it open, as the grader does; returns the judge's messages."""
    import contextlib
    import json
    import os
    import shutil
    import tempfile

    from course_tools import grade, inside

    folder = tempfile.mkdtemp()
    shutil.copyfile(grade.DRAWN_CASES, os.path.join(folder, "drawn.py"))
    job = {**job, "job_dir": folder}
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_fd)
            inside.judge(job, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    data = b""
    while chunk := os.read(read_fd, 1 << 16):
        data += chunk
        if b'"ready"' in data:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, "drawn.py"))
    os.close(read_fd)
    os.waitpid(pid, 0)
    shutil.rmtree(folder)
    return [json.loads(line) for line in data.decode().splitlines()]
