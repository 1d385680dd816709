"""Maintainers' tools: generate exercises/ from solutions/, refresh committed outputs.

solutions/ is the single source of every exercise notebook. In a solution cell,
the code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (always inside a
function body, so that an unfinished exercise still defines its name) becomes a
stub that raises ``NotImplementedError``; ``### BEGIN HIDDEN TESTS`` ...
``### END HIDDEN TESTS`` blocks are removed. The markers are nbgrader's, and the
cells carry nbgrader's metadata, so an instructor can also release and autograde
solutions/ with nbgrader itself.

Each generated notebook records a hash of the cells it was written with. The
generator refuses to overwrite an exercise notebook whose cells no longer match
that hash (a learner or an instructor edited it) unless told ``force=True``.

Command line::

    python -m course_lib.authoring exercises [--force]   # regenerate exercises/
    python -m course_lib.authoring check                 # exit 1 if exercises/ is stale
    python -m course_lib.authoring outputs [NOTEBOOK ...] # re-execute lectures and solutions
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
STUB = 'raise NotImplementedError("Exercise: replace this line with your code")'
CHECK_CALL = re.compile(r"\bgrading\.check_\w+\(")


def colab_url(relpath: str) -> str:
    """The Colab address of a notebook of this repository (``notebooks/00_setup.ipynb``)."""
    from . import COURSE_REPO

    return f"https://colab.research.google.com/github/{COURSE_REPO}/blob/main/{relpath}"


def colab_badge(relpath: str) -> str:
    """The "Open in Colab" badge, as Markdown, for a notebook of this repository."""
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(relpath)})"


def bootstrap_source() -> str:
    """The first code cell of every notebook: installs the course on Colab, does nothing elsewhere."""
    from . import COURSE_REPO

    return (
        "# On Colab only: install the course package (locally, `make lab` has installed it).\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        "    import subprocess\n"
        "\n"
        '    subprocess.run([sys.executable, "-m", "pip", "install", "-q",\n'
        f'                    "git+https://github.com/{COURSE_REPO}"], check=True)'
    )


def new_notebook(relpath: str, title: str, cells: list[tuple]) -> nbformat.NotebookNode:
    """A course notebook: title with Colab badge, the bootstrap cell, then ``cells``.

    ``cells`` holds ``("md", source)`` or ``("code", source)`` tuples, optionally
    with a third item, a list of cell tags (e.g. ``["nbval-ignore-output"]``).
    Written to ``relpath`` under the repository root; returns the notebook.
    """
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells.append(nbformat.v4.new_markdown_cell(f"# {title}\n\n{colab_badge(relpath)}"))
    nb.cells.append(nbformat.v4.new_code_cell(bootstrap_source()))
    for item in cells:
        kind, source, tags = (*item, [])[:3]
        if kind not in ("md", "code"):
            raise ValueError(f"cell kind must be 'md' or 'code', got {kind!r}")
        make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        cell = make(source.strip("\n"))
        if tags:
            cell.metadata["tags"] = list(tags)
        nb.cells.append(cell)
    for index, cell in enumerate(nb.cells):
        cell.id = f"c{index:03d}"  # stable ids keep diffs small
    stamp_slides(nb)
    path = ROOT / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dumps(nb))
    return nb


_HEADING = re.compile(r"^#{1,3} ")


def _split_at_headings(cell) -> list:
    """A markdown cell cut before every ``#``-``###`` heading line (outside code fences)."""
    parts, current, fenced = [], [], False
    for line in cell.source.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and _HEADING.match(line) and any(x.strip() for x in current):
            parts.append(current)
            current = []
        current.append(line)
    parts.append(current)
    if len(parts) == 1:
        return [cell]
    cells = []
    for number, lines in enumerate(parts):
        piece = nbformat.v4.new_markdown_cell("\n".join(lines).strip("\n"))
        piece.metadata = copy.deepcopy(cell.metadata)
        piece.id = cell.id if number == 0 else f"{cell.id}-{number}"
        cells.append(piece)
    return cells


def stamp_slides(nb) -> None:
    """Slides for ``jupyter nbconvert --to slides``: a new slide at each ``#``/``##`` heading, a
    sub-slide at each ``###`` heading, everything else continues its slide. A markdown cell
    holding several sections is first cut so that every section starts a cell of its own."""
    cells = []
    for cell in nb.cells:
        cells.extend(_split_at_headings(cell) if cell.cell_type == "markdown" else [cell])
    nb.cells = cells
    for cell in nb.cells:
        first = cell.source.lstrip().split("\n", 1)[0] if cell.cell_type == "markdown" else ""
        if first.startswith(("# ", "## ")):
            kind = "slide"
        elif first.startswith("### "):
            kind = "subslide"
        else:
            kind = "-"
        cell.metadata["slideshow"] = {"slide_type": kind}


class AuthoringError(ValueError):
    """A solution notebook breaks the marker rules, or an exercise holds foreign changes."""


def _replace_blocks(source: str, begin: str, end: str, stub: bool, where: str) -> str:
    out, inside, indent = [], False, ""
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped == begin:
            if inside:
                raise AuthoringError(f"{where}: line {number}: {begin} inside another block")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            if stub:
                if not indent:
                    raise AuthoringError(
                        f"{where}: line {number}: {begin} must sit inside a function body, "
                        "so that the unfinished exercise still defines its name")
                out.append(indent + STUB)
        elif stripped == end:
            if not inside:
                raise AuthoringError(f"{where}: line {number}: {end} without {begin}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise AuthoringError(f"{where}: {begin} is never closed by {end}")
    return "\n".join(out)


def cell_kind(cell) -> str:
    """'solution', 'check' (a cell calling ``grading.check_*``) or 'plain'."""
    if cell.cell_type != "code":
        return "plain"
    if BEGIN_SOLUTION in cell.source:
        return "solution"
    if CHECK_CALL.search(cell.source) or BEGIN_HIDDEN in cell.source:
        return "check"
    return "plain"


def nbgrader_metadata(cell, index: int) -> dict | None:
    """nbgrader's cell metadata (schema 3) for a solution or check cell, else None."""
    kind = cell_kind(cell)
    grade_id = f"{kind}-{cell.get('id') or index}"
    if kind == "solution":
        return {"grade": False, "grade_id": grade_id, "locked": False,
                "schema_version": 3, "solution": True, "task": False}
    if kind == "check":
        return {"grade": True, "grade_id": grade_id, "locked": True, "points": 1,
                "schema_version": 3, "solution": False, "task": False}
    return None


def _cells_hash(nb) -> str:
    payload = [(c.cell_type, c.source) for c in nb.cells]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def stamp_solution(nb) -> bool:
    """Give a solution notebook's cells their nbgrader metadata; True if anything changed."""
    changed = False
    for index, cell in enumerate(nb.cells):
        meta = nbgrader_metadata(cell, index)
        if meta is None:
            changed |= cell.metadata.pop("nbgrader", None) is not None
        elif cell.metadata.get("nbgrader") != meta:
            cell.metadata["nbgrader"] = meta
            changed = True
    return changed


def make_exercise(solution, name: str = "solution"):
    """The exercise notebook for a solution notebook (a new object; the input is unchanged)."""
    nb = copy.deepcopy(solution)
    stamp_solution(nb)
    for index, cell in enumerate(nb.cells):
        where = f"{name} cell {index}"
        if cell.cell_type == "code":
            source = _replace_blocks(cell.source, BEGIN_SOLUTION, END_SOLUTION, True, where)
            cell.source = _replace_blocks(source, BEGIN_HIDDEN, END_HIDDEN, False, where)
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    if nb.cells and nb.cells[0].cell_type == "markdown":  # the badge opens the exercise itself
        nb.cells[0].source = nb.cells[0].source.replace(
            colab_url(f"solutions/{name}"), colab_url(f"exercises/{name}"))
    nb.metadata["course"] = {"generated_from": f"solutions/{name}", "cells_sha256": _cells_hash(nb)}
    nb.metadata.pop("widgets", None)
    return nb


def _holds_foreign_changes(path: Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    recorded = nb.metadata.get("course", {}).get("cells_sha256")
    return recorded != _cells_hash(nb)


def _dumps(nb) -> str:
    return nbformat.writes(nb) + "\n"


def generate(solutions_dir: Path = ROOT / "solutions", exercises_dir: Path = ROOT / "exercises",
             *, force: bool = False, write: bool = True) -> list[Path]:
    """Regenerate every exercise notebook; return the paths that changed (or would change).

    Raises :class:`AuthoringError` before writing anything if an exercise notebook
    holds changes the generator did not write and ``force`` is False.
    """
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    plans = []
    for src in sorted(solutions_dir.glob("*.ipynb")):
        solution = nbformat.read(src, as_version=4)
        stamped = stamp_solution(solution)
        exercise = make_exercise(solution, src.name)
        dst = exercises_dir / src.name
        new_text = _dumps(exercise)
        old_text = dst.read_text() if dst.exists() else None
        if old_text != new_text and dst.exists() and not force and _holds_foreign_changes(dst):
            raise AuthoringError(
                f"{dst} holds changes the generator did not write; keep them elsewhere "
                "or pass --force to overwrite")
        plans.append((src, solution if stamped else None, dst, new_text, old_text))
    changed = []
    for src, stamped_solution, dst, new_text, old_text in plans:
        if stamped_solution is not None:
            changed.append(src)
            if write:
                src.write_text(_dumps(stamped_solution))
        if new_text != old_text:
            changed.append(dst)
            if write:
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text(new_text)
    return changed


def execute_in_place(path: Path, timeout: int = 300, attempts: int = 3) -> None:
    """Run a notebook top to bottom in a fresh kernel and save it with its outputs.

    nbclient occasionally waits forever on a cell that displays a widget while the
    kernel sits idle (jupyter/nbclient#312); no course cell needs ``timeout`` seconds,
    so a cell past it counts as that hang and the notebook is run again, from a fresh
    kernel, up to ``attempts`` times.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    path = Path(path)
    for attempt in range(1, attempts + 1):
        nb = nbformat.read(path, as_version=4)
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            break
        except CellTimeoutError:
            if attempt == attempts:
                raise
            print(f"  a cell ran past {timeout} s (nbclient hang?): running {path.name} again",
                  flush=True)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    stamp_slides(nb)
    path.write_text(_dumps(nb))


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.authoring")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("exercises", help="regenerate exercises/ from solutions/")
    ex.add_argument("--force", action="store_true", help="overwrite edited exercise notebooks")
    sub.add_parser("check", help="exit 1 if exercises/ is out of date")
    out = sub.add_parser("outputs", help="re-execute notebooks and save their outputs")
    out.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "exercises":
            for path in generate(force=args.force):
                print(f"wrote {path.relative_to(ROOT)}")
        elif args.command == "check":
            stale = generate(write=False)
            for path in stale:
                print(f"stale: {path.relative_to(ROOT)} (run `make exercises`)")
            return 1 if stale else 0
        else:
            paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted(
                (ROOT / "solutions").glob("*.ipynb"))
            for path in paths:
                print(f"executing {path} ...", flush=True)
                execute_in_place(path)
            generate()
    except AuthoringError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
