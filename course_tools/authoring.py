"""Maintainers' tools: generate exercises/ from solutions/, refresh committed outputs.

These are tools for whoever maintains a copy of the course, run from a checkout of it; they are
not part of ``course_lib`` (the learner's runtime, which Colab pip-installs without solutions/
or nbformat). Every command takes the course folder explicitly.

solutions/ is the single source of every exercise notebook. In a solution cell,
the code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (directly inside a
function body, so that an unfinished exercise still defines its name) becomes a
stub that raises ``NotImplementedError``; ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN
TESTS`` blocks are removed. Everything else that could carry a solution into exercises/ stops the
generation before anything is written, naming the notebook and the cell: any other line that
reads as a marker (other hashes, case, spelling or order, a zero-width space, a Cyrillic letter;
see :func:`_marker_like`), a marker in a string, in a Markdown or raw cell or in metadata, an
nbgrader answer cell (``solution: true``) without a block to stub, a cell that would not change
or not compile, and a solution's text found in any other cell. Outputs are not copied. The
markers are nbgrader's, and the cells carry nbgrader's metadata, so an instructor can also
release and autograde solutions/ with nbgrader itself.

The generator writes to solutions/ only to add what is missing (the nbgrader metadata of a new
solution or check cell, a grade id); it keeps what authors wrote there (a check worth
``points: 3``, nbgrader metadata on other cells, any other metadata). Each generated notebook
records a hash of the cells it was written with; the generator refuses to overwrite an exercise
notebook whose cells no longer match that hash (a learner or an instructor edited it) unless
told ``force=True``. ``outputs`` refuses to save over a notebook that changed on disk while it
ran (someone saved it meanwhile).

Command line (from the course folder, or with ``--course DIR``)::

    python -m course_tools.authoring --course . exercises [--force]   # regenerate exercises/
    python -m course_tools.authoring --course . check          # exit 1 if exercises/ is stale
    python -m course_tools.authoring --course . outputs [NOTEBOOK ...]  # re-execute notebooks
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import io
import json
import math
import os
import re
import sys
import tokenize
import unicodedata
from pathlib import Path

import nbformat

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
STUB = 'raise NotImplementedError("Exercise: replace this line with your code")'
CHECK_CALL = re.compile(r"\bgrading\.check_\w+\(")


def colab_url(relpath: str) -> str:
    """The Colab address of a notebook of this repository (``notebooks/00_setup.ipynb``)."""
    from course_lib import COURSE_REPO

    return f"https://colab.research.google.com/github/{COURSE_REPO}/blob/main/{relpath}"


def colab_badge(relpath: str) -> str:
    """The "Open in Colab" badge, as Markdown, for a notebook of this repository."""
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(relpath)})"


def bootstrap_source() -> str:
    """The first code cell of every notebook: installs the course on Colab, does nothing elsewhere."""
    from course_lib import COURSE_REPO

    return (
        "#@title On Colab only: install the course package (locally, `make lab` has installed it)\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        "    import subprocess\n"
        "\n"
        '    subprocess.run([sys.executable, "-m", "pip", "install", "-q",\n'
        f'                    "git+https://github.com/{COURSE_REPO}"], check=True)'
    )


def new_notebook(relpath: str, title: str, cells: list[tuple], *, course) -> nbformat.NotebookNode:
    """A course notebook: title with Colab badge, the bootstrap cell, then ``cells``.

    Args:
        relpath: where the notebook goes, relative to the course folder
            (``"notebooks/09_x.ipynb"``); its Colab badge points there.
        title: the notebook's title (a ``#`` heading).
        cells: ``("md", source)`` or ``("code", source)`` tuples, optionally with a third item,
            a list of cell tags (e.g. ``["nbval-ignore-output"]``).
        course: the course folder.

    Returns:
        The notebook, also written to ``course / relpath``.

    Raises:
        ValueError: if a cell kind is neither ``"md"`` nor ``"code"``.

    Example::

        new_notebook("notebooks/09_more.ipynb", "More", [("md", "Text"), ("code", "1 + 1")],
                     course=".")
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
    path = Path(course) / relpath
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


#: The first line of a collapsed cell: Colab shows it as the cell's title (a form), and
#: JupyterLab (4.0 on) shows a collapsed cell's first line. Three kinds are collapsed: the Colab
#: bootstrap, a lecture's setup cell (imports, helpers, plotting style: the story starts with its
#: first idea) and the check cells.
TITLE = "#@title "
CHECK_TITLE = TITLE + "Check: "
SETUP_TITLE = TITLE + "Setup: "


def is_check_cell(cell) -> bool:
    """A code cell that holds a lecture's assertions, out of the narrative's way."""
    return cell.cell_type == "code" and cell.source.startswith(CHECK_TITLE)


def stamp_check_cells(nb) -> int:
    """Collapse every titled cell (bootstrap, setup, checks) by default: its code hidden, its
    title line and output shown.

    ``metadata.jupyter.source_hidden`` is JupyterLab's collapsed input (nbformat 4.5), and
    ``metadata.cellView = "form"`` Colab's; every other code cell loses both, so a cell that
    stops being a check cell opens again. Returns the number of check cells.
    """
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        jupyter = cell.metadata.get("jupyter", {})
        if cell.source.startswith(TITLE):
            count += is_check_cell(cell)
            cell.metadata["jupyter"] = {**jupyter, "source_hidden": True}
            cell.metadata["cellView"] = "form"
        else:
            jupyter.pop("source_hidden", None)
            if jupyter:
                cell.metadata["jupyter"] = jupyter
            else:
                cell.metadata.pop("jupyter", None)
            cell.metadata.pop("cellView", None)
    return count


class AuthoringError(ValueError):
    """A solution notebook breaks the marker rules, or an exercise holds foreign changes."""


_MARKERS = (BEGIN_SOLUTION, END_SOLUTION, BEGIN_HIDDEN, END_HIDDEN)
#: Cyrillic and Greek capitals drawn like Latin ones (small letters are upper-cased first).
_LOOKALIKES = str.maketrans("АВЕЅІЈКМНОРСТХУԀԌԚԜҺӀΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
                            "ABESIJKMHOPCTXYDGQWHIABEZHIKMNOPTYX")
#: nbgrader's markers (and its mark-scheme markers), read as bare letters, in either order.
_MARKER_WORDS = re.compile(r"(BEGIN|END)(SOLUTION|HIDDENTESTS?|MARKSCHEME)"
                           r"|(SOLUTION|HIDDENTESTS?|MARKSCHEME)(BEGIN|END)")


def _marker_like(line: str) -> bool:
    """Whether a line reads as a marker to a person or to another tool.

    The line is reduced to the letters a reader sees: compatibility forms and accents undone
    (NFKD), upper case, Cyrillic and Greek look-alikes read as Latin, and everything that is not
    a letter dropped (zero-width spaces and other format characters, ``#``, ``_``, ``-``,
    spaces). ``### BEGIN_SOLUTION``, ``SOLUTION BEGIN`` and ``### BEGIN SОLUTION`` (a Cyrillic
    О) all read as BEGINSOLUTION. Only the exact markers in a code cell are replaced; a variant
    would be copied, solution and all, so it is refused instead.
    """
    letters = unicodedata.normalize("NFKD", line).upper().translate(_LOOKALIKES)
    return bool(_MARKER_WORDS.search("".join(ch for ch in letters if ch.isalpha())))


def _comment_lines(source: str, where: str) -> set[int]:
    """The numbers of the lines that hold a comment token (not a ``#`` inside a string)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError) as exc:
        raise AuthoringError(f"{where}: the solution cell is not valid Python ({exc})") from None
    return {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}


def _check_markers(source: str, where: str) -> None:
    """Refuse marker variants, markers inside strings and solution markers outside a ``def``.

    A marker is honoured only as the whole of a comment line. ``### BEGIN SOLUTION`` must sit
    directly in the body of a function (found with :mod:`ast`: the innermost statement around
    it is a ``def``, at its body's indentation), so that the stub that replaces the block is
    the function's body and the unfinished exercise still defines the name and still parses.
    """
    lines = source.splitlines()
    marked = [(n, line) for n, line in enumerate(lines, 1) if _marker_like(line)]
    if not marked:
        return
    for number, line in marked:
        if line.strip() not in _MARKERS:
            raise AuthoringError(
                f"{where}: line {number}: {line.strip()!r} is not a marker; write exactly one "
                f"of {', '.join(repr(m) for m in _MARKERS)} alone on its line")
    for begin, end in ((BEGIN_SOLUTION, END_SOLUTION), (BEGIN_HIDDEN, END_HIDDEN)):
        _replace_blocks(source, begin, end, False, where)  # pairs: raises on a stray marker
    comments = _comment_lines(source, where)
    for number, line in marked:
        if number not in comments:
            raise AuthoringError(f"{where}: line {number}: {line.strip()} sits inside a string")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise AuthoringError(f"{where}: the solution cell is not valid Python ({exc})") from None
    blocks = [node for node in ast.walk(tree) if isinstance(node, ast.stmt)
              and any(isinstance(getattr(node, f, None), list) and getattr(node, f)
                      and isinstance(getattr(node, f)[0], ast.stmt)
                      for f in ("body", "orelse", "finalbody", "handlers", "cases"))]
    for number, line in marked:
        if line.strip() != BEGIN_SOLUTION:
            continue
        around = [node for node in blocks if node.lineno < number <= node.end_lineno]
        inner = max(around, key=lambda node: node.lineno, default=None)
        indent = len(line) - len(line.lstrip())
        if (not isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef)
                or indent != inner.body[0].col_offset):
            what = "module level" if inner is None else f"a {type(inner).__name__} block"
            raise AuthoringError(
                f"{where}: line {number}: {BEGIN_SOLUTION} is at {what}; it must sit directly "
                "inside a function body, so that the unfinished exercise still defines its name")


def _replace_blocks(source: str, begin: str, end: str, stub: bool, where: str) -> str:
    out, inside, indent = [], False, ""
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped == begin:
            if inside:
                raise AuthoringError(f"{where}: line {number}: {begin} inside another block")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            if stub:
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


def _exercise_source(source: str, where: str) -> str:
    """A solution cell's code with its solutions stubbed and its hidden tests removed.

    Raises:
        AuthoringError: if a marker breaks the rules of :func:`_check_markers`, or if the
            result still holds a marker, equals the solution, or does not compile: whatever
            the cause, no solution reaches exercises/.
    """
    _check_markers(source, where)
    exercise = _replace_blocks(source, BEGIN_SOLUTION, END_SOLUTION, True, where)
    exercise = _replace_blocks(exercise, BEGIN_HIDDEN, END_HIDDEN, False, where)
    if BEGIN_SOLUTION in source and (exercise == source or any(
            _marker_like(line) for line in exercise.splitlines())):
        raise AuthoringError(f"{where}: the solution cell did not change when its blocks were "
                             "replaced; its solution would reach the exercise")
    try:
        compile(exercise, where, "exec")
    except SyntaxError as exc:
        raise AuthoringError(f"{where}: the exercise cell does not compile ({exc})") from None
    return exercise


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
    """Add the nbgrader metadata that a solution or check cell lacks; True if anything was added.

    Only missing keys are added (a new cell's whole metadata, a lost ``grade_id``): what an
    author wrote is kept, such as ``points: 3`` on a check cell, a custom ``grade_id``, nbgrader
    metadata on other cells, or any other metadata.

    Args:
        nb: a solution notebook, changed in place.

    Returns:
        True if a cell's metadata was added to.
    """
    changed = False
    for index, cell in enumerate(nb.cells):
        meta = nbgrader_metadata(cell, index)
        if meta is None:
            continue
        current = cell.metadata.get("nbgrader")
        if not isinstance(current, dict):
            cell.metadata["nbgrader"] = meta
            changed = True
            continue
        for key, value in meta.items():
            if key not in current:
                current[key] = value
                changed = True
    return changed


def check_points(cell, where: str) -> float:
    """The points of a check cell (its nbgrader ``points``, 1 if unset).

    Raises:
        AuthoringError: if they are not a finite number >= 0.
    """
    points = cell.metadata.get("nbgrader", {}).get("points", 1)
    if (not isinstance(points, int | float) or isinstance(points, bool)
            or not math.isfinite(points) or points < 0):
        raise AuthoringError(f"{where}: points must be a finite number >= 0, got {points!r}")
    return float(points)


def _strings(value):
    """Every string in a cell or in metadata, however deeply nested."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _strings(item)


def _solution_blocks(source: str) -> list[str]:
    """The text between a code cell's solution markers, one string per block, spaces collapsed."""
    blocks, current = [], None
    for line in source.splitlines():
        if line.strip() == BEGIN_SOLUTION:
            current = []
        elif line.strip() == END_SOLUTION:
            blocks.append(" ".join(" ".join(current).split()))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


#: A solution shorter than this is not searched for in other cells (``return x`` is everywhere).
_SHORTEST_SEARCHED = 16


def _refuse_leaks(value, where: str, solutions: list[tuple[int, str]]) -> None:
    """Refuse a part of an exercise notebook that holds a marker or a solution's text."""
    texts = list(_strings(value))
    for line in (line for text in texts for line in text.splitlines()):
        if _marker_like(line):
            raise AuthoringError(
                f"{where}: {line.strip()[:60]!r} reads as a marker; only the exact markers, in a "
                "code cell, are replaced, and this would reach the exercise as it is")
    flat = " ".join(" ".join(texts).split())
    for origin, block in solutions:
        if len(block) >= _SHORTEST_SEARCHED and block in flat:
            raise AuthoringError(f"{where}: it holds the solution of cell {origin} "
                                 f"({block[:40]!r}...), which would reach the exercise")


def make_exercise(solution, name: str = "solution"):
    """The exercise notebook for a solution notebook (a new object; the input is unchanged).

    Raises:
        AuthoringError: naming the notebook and the cell, if anything could carry a solution
            into the exercise (see the module's docstring).
    """
    nb = copy.deepcopy(solution)
    stamp_solution(nb)
    solutions = []
    for index, cell in enumerate(nb.cells):
        where = f"{name} cell {index}"
        kind = cell_kind(cell)
        if kind == "check":
            check_points(cell, where)
        grader = cell.metadata.get("nbgrader")
        if kind != "solution" and isinstance(grader, dict) and grader.get("solution"):
            raise AuthoringError(
                f"{where}: nbgrader marks this {cell.cell_type} cell as an answer (solution: "
                f"true), but it holds no {BEGIN_SOLUTION} block in a code cell to replace")
        if cell.cell_type == "code":
            exercise = _exercise_source(cell.source, where)
            solutions += [(index, block) for block in _solution_blocks(cell.source)]
            cell.source = exercise
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    if nb.cells and nb.cells[0].cell_type == "markdown":  # the badge opens the exercise itself
        nb.cells[0].source = nb.cells[0].source.replace(
            colab_url(f"solutions/{name}"), colab_url(f"exercises/{name}"))
    nb.metadata["course"] = {"generated_from": f"solutions/{name}", "cells_sha256": _cells_hash(nb)}
    nb.metadata.pop("widgets", None)
    for index, cell in enumerate(nb.cells):
        _refuse_leaks(cell, f"{name} cell {index}", solutions)
    _refuse_leaks(nb.metadata, f"{name} metadata", solutions)
    return nb


def _holds_foreign_changes(path: Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    recorded = nb.metadata.get("course", {}).get("cells_sha256")
    return recorded != _cells_hash(nb)


def _dumps(nb) -> str:
    return nbformat.writes(nb) + "\n"


def generate(solutions_dir, exercises_dir, *, force: bool = False,
             write: bool = True) -> list[Path]:
    """Regenerate every exercise notebook; return the paths that changed (or would change).

    A solution notebook is written only when a cell lacked nbgrader metadata (see
    :func:`stamp_solution`); everything else in solutions/ is left as it is.

    Args:
        solutions_dir: the folder of solution notebooks (``COURSE/solutions``).
        exercises_dir: the folder of exercise notebooks to (re)write (``COURSE/exercises``).
        force: overwrite exercise notebooks that hold changes the generator did not write.
        write: False to only report what would change.

    Returns:
        The solution and exercise notebooks that changed (or would change).

    Raises:
        AuthoringError: before writing anything, if a solution could reach an exercise (see
            :func:`make_exercise`) or an exercise notebook holds foreign changes and ``force``
            is False.
        TypeError: if ``force`` or ``write`` is not a bool (``"no"`` is truthy).
        ValueError: if ``solutions_dir`` is not a folder, or ``exercises_dir`` is, holds or
            sits inside ``solutions_dir`` or the course's ``notebooks/`` or ``course_lib/``.

    Example::

        generate(Path("solutions"), Path("exercises"), write=False)  # [] when up to date
    """
    for name, value in (("force", force), ("write", write)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    if not solutions_dir.is_dir():
        raise ValueError(f"solutions_dir must be a folder, got {str(solutions_dir)!r}")
    source, target = solutions_dir.resolve(), exercises_dir.resolve()
    for kept in (source, source.parent / "notebooks", source.parent / "course_lib"):
        if target == kept or kept in target.parents or target in kept.parents:
            raise ValueError(f"exercises_dir must be a folder apart from {kept} (not it, not "
                             f"inside it, not holding it), got {str(exercises_dir)!r}")
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
                tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
                tmp.write_text(new_text)
                os.replace(tmp, dst)  # replaces a link at dst, never writes through it
    return changed


def execute_in_place(path, timeout: int = 300, attempts: int = 3) -> None:
    """Run a notebook top to bottom in a fresh kernel and save it with its outputs.

    nbclient occasionally waits forever on a cell that displays a widget while the
    kernel sits idle (jupyter/nbclient#312); no course cell needs ``timeout`` seconds,
    so a cell past it counts as that hang and the notebook is run again, from a fresh
    kernel, up to ``attempts`` times. The notebook is saved only if the file still holds
    what was read before the run (an author may have saved it meanwhile), through a temporary
    file moved into place, so a reader never sees half a notebook.

    Args:
        path: the notebook to run and save.
        timeout: seconds a cell may run.
        attempts: runs before a cell past ``timeout`` is reported.

    Raises:
        AuthoringError: if the file changed on disk while the notebook ran (it is left as it is).
        ValueError: if ``path`` is not a file, or ``timeout`` or ``attempts`` is not a positive int.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path must be a notebook file, got {str(path)!r}")
    for name, value in (("timeout", timeout), ("attempts", attempts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for attempt in range(1, attempts + 1):
        before = path.read_bytes()
        nb = nbformat.reads(before.decode(), as_version=4)
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
    stamp_check_cells(nb)
    _replace_if_unchanged(path, before, _dumps(nb))


def _replace_if_unchanged(path: Path, before: bytes, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    if path.read_bytes() != before:
        tmp.unlink()
        raise AuthoringError(f"{path} changed on disk while it ran; not overwritten (run it "
                             "again to save its outputs)")
    os.replace(tmp, path)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.authoring")
    parser.add_argument("--course", type=Path, default=Path("."),
                        help="the course folder, holding solutions/, exercises/ and notebooks/ "
                             "(default: the current folder)")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("exercises", help="regenerate exercises/ from solutions/")
    ex.add_argument("--force", action="store_true", help="overwrite edited exercise notebooks")
    sub.add_parser("check", help="exit 1 if exercises/ is out of date")
    out = sub.add_parser("outputs", help="re-execute notebooks and save their outputs")
    out.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    course = args.course.resolve()
    if not (course / "solutions").is_dir():
        print(f"error: --course must be the course folder (holding solutions/), got {course}",
              file=sys.stderr)
        return 2
    solutions, exercises = course / "solutions", course / "exercises"

    def shown(path: Path) -> str:
        return str(path.relative_to(course)) if course in path.resolve().parents else str(path)

    try:
        if args.command == "exercises":
            for path in generate(solutions, exercises, force=args.force):
                print(f"wrote {shown(path)}")
        elif args.command == "check":
            stale = generate(solutions, exercises, write=False)
            for path in stale:
                print(f"stale: {shown(path)} (run `make exercises`)")
            return 1 if stale else 0
        else:
            paths = args.notebooks or (sorted((course / "notebooks").glob("*.ipynb"))
                                       + sorted((course / "notebooks" / "deeper").glob("*.ipynb"))
                                       + sorted(solutions.glob("*.ipynb")))
            for path in paths:
                print(f"executing {path} ...", flush=True)
                execute_in_place(path)
            generate(solutions, exercises)
    except AuthoringError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
