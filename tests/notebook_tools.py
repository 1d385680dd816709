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
