"""Hostile submissions: each module here is one attack on the grader, written as a student who
wants marks without the work (or to harm others) would write it.

A module holds:

* ``CELLS``: ``[(where, source)]``, the attack's code. ``where`` is ``"after_imports"`` (a new
  cell after the notebook's imports), ``"end"`` (a new last cell), ``"exercise"`` (appended to
  every exercise cell, so it also runs when the checks load the learner's functions) or
  ``"body:NAME"`` (replaces the body of the learner's function ``NAME``);
* ``SOLVE``: the exercises (function names) it answers correctly, so that its real answers have
  a known worth;
* ``EXPECTED``: ``{check: status}``, the exact outcome of each check (``passed`` earns its point);
* optional ``FILENAME`` (default ``00_setup.ipynb``), ``FOLDER`` (default: the module's name;
  ``""`` puts the notebook at the top of the submissions folder), ``EDIT(nb)`` (changes to the
  notebook's metadata), ``PROBLEM`` (the start of the row's notes, for a notebook that is not
  graded), ``NOTES`` (text its notes must hold), ``MARKERS`` (the attack starts processes whose
  command line holds the marker), ``REQUIRES = "cgroup"`` (an attack that only a cgroup per
  sandbox withstands: left out where the grader cannot make one, as its warning says).

Sources may hold ``@@COURSE@@`` (the course folder being graded with), ``@@SUBMISSIONS@@``,
``@@SELF@@`` (this notebook's path), ``@@VICTIM@@`` (another student's notebook), ``@@SCORES@@``
(the CSV), ``@@HOSTTMP@@`` (a folder of the grader's machine) and ``@@MARKER@@`` (a token to
find its processes by); the test fills them in, as an attacker who knows the paths would.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from types import ModuleType

import nbformat

BASE = "00_setup.ipynb"


def attacks() -> dict[str, ModuleType]:
    """Every attack module of this folder, by name."""
    from course_tools.sandbox import Cgroups

    cgroups = Cgroups().version is not None
    found = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if getattr(module, "REQUIRES", None) != "cgroup" or cgroups:
            found[info.name] = module
    return found


def _exercise_cells(nb):
    return [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]


def build(attack: ModuleType, exercise, solution, fill: dict[str, str]):
    """The attack's notebook: ``exercise`` with ``SOLVE`` answered from ``solution`` and the
    attack's cells put in place, every ``@@NAME@@`` replaced from ``fill``."""
    nb = nbformat.from_dict(exercise)
    answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in _exercise_cells(solution)}

    def defines(cell, name):
        return re.search(rf"^def {name}\(", cell.source, re.M)

    def sub(text: str) -> str:
        return re.sub(r"@@(\w+)@@", lambda m: fill[m.group(1)], text)

    for cell in _exercise_cells(nb):
        if any(defines(cell, name) for name in getattr(attack, "SOLVE", ())):
            cell.source = answers[cell.metadata["nbgrader"]["grade_id"]]
    imports = next(i for i, c in enumerate(nb.cells) if "from course_lib import grading" in c.source)
    after, end = [], []
    for where, source in attack.CELLS:
        source = sub(source.strip("\n"))
        if where == "after_imports":
            after.append(nbformat.v4.new_code_cell(source))
        elif where == "end":
            end.append(nbformat.v4.new_code_cell(source))
        elif where == "exercise":
            for cell in _exercise_cells(nb):
                cell.source += "\n\n\n" + source
        elif where.startswith("body:"):
            name = where.split(":", 1)[1]
            cell = next(c for c in _exercise_cells(nb) if defines(c, name))
            header = re.search(rf"^def {name}\(.*\):$", cell.source, re.M).group(0)
            cell.source = header + "\n" + "".join(f"    {line}\n" for line in source.splitlines())
        else:
            raise ValueError(f"where must be after_imports, end, exercise or body:NAME, got {where!r}")
    nb.cells[imports + 1:imports + 1] = after
    nb.cells += end
    if hasattr(attack, "EDIT"):
        attack.EDIT(nb)
    return nb
