"""Every ``>>>`` example in a course_lib docstring runs, and prints what the docstring says.

Each module of ``course_lib`` (the grading package included) is searched with ``doctest`` and its
examples are run in the module's namespace, as ``pytest --doctest-modules course_lib`` would run
them; this file puts them on the path that ``make test`` (``pytest tests``) and ``.ci/run`` take.
An example that needs a GPU or a live kernel carries ``# doctest: +SKIP`` and is counted apart.
Every ``Example`` section is such an example, never a literal block that nothing runs.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import pathlib
import pkgutil
import re
import types

import pytest

import course_lib

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

MODULES = sorted(info.name for info in pkgutil.walk_packages(course_lib.__path__,
                                                             course_lib.__name__ + "."))


def run_examples(module: types.ModuleType) -> tuple[doctest.TestResults, str]:
    """Run every docstring example of ``module``: ``(results, report)``, the report being what
    ``doctest`` prints for each failure (empty when all pass)."""
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, module.__name__):
        if test.examples:
            runner.run(test, out=report.append, clear_globs=True)
    return runner.summarize(verbose=False), "".join(report)


def _examples(name: str) -> list[doctest.Example]:
    module = importlib.import_module(name)
    return [ex for test in doctest.DocTestFinder().find(module, name) for ex in test.examples]


@pytest.mark.parametrize("name", [n for n in MODULES if _examples(n)])
def test_examples_hold(name):
    results, report = run_examples(importlib.import_module(name))
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples fail:\n{report}"


def test_examples_are_found():
    """The finder sees the examples (a broken search would pass every module above vacuously):
    the engine's, the levers' and the widgets' among them, at least 102 run (106 when written)."""
    with_examples = {n for n in MODULES if _examples(n)}
    assert {"course_lib.prediction.engine", "course_lib.training.levers", "course_lib.views.widgets"} <= with_examples
    run = sum(1 for n in with_examples for ex in _examples(n)
              if not ex.options.get(doctest.SKIP))
    assert run >= 102


def _literal_examples(source: str) -> list[str]:
    """The names whose docstring has an ``Example`` section without a ``>>>`` line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        lines = (ast.get_docstring(node, clean=False) or "").splitlines()
        for i, line in enumerate(lines):
            header = re.fullmatch(r"(\s*)Examples?::?\s*", line)
            if header is None:
                continue
            indent = len(header.group(1))
            section = []
            for s in lines[i + 1:]:
                if s.strip() and len(s) - len(s.lstrip()) <= indent:
                    break  # the section ends where the text comes back to its header's margin
                section.append(s)
            if not any(s.lstrip().startswith(">>>") for s in section):
                found.append(getattr(node, "name", "the module"))
    return found


def test_every_example_section_runs():
    """An ``Example`` section is a doctest (``>>>``), which the tests above run; a literal block
    would go stale unseen."""
    root = pathlib.Path(course_lib.__file__).parent
    literal = {}
    for path in sorted(root.rglob("*.py")):
        names = _literal_examples(path.read_text())
        if names:
            literal[path.relative_to(root.parent).as_posix()] = names
    assert not literal, literal


def test_a_literal_example_is_found():
    """The section check sees a literal block, also after an Args section, and passes a doctest."""
    literal = 'def f():\n    """One.\n\n    Args:\n        x: a.\n\n    Example::\n\n        f()\n    """\n'
    doctested = 'def f():\n    """One.\n\n    Example:\n        >>> 1\n        1\n    """\n'
    assert (_literal_examples(literal), _literal_examples(doctested)) == (["f"], [])


def test_a_wrong_example_fails():
    """The runner reports a docstring whose printed result is false."""
    module = types.ModuleType("course_lib_fake")
    exec('def twice(x):\n    """Example:\n\n    >>> twice(2)\n    5\n    """\n    return 2 * x\n',
         module.__dict__)
    results, report = run_examples(module)
    assert (results.failed, results.attempted) == (1, 1)
    assert "Expected:\n    5\nGot:\n    4" in report


def test_skipped_examples_need_a_device():
    """Only examples that need CUDA or a live allocator are skipped: those of the allocator module."""
    skipped = {n for n in MODULES for ex in _examples(n) if ex.options.get(doctest.SKIP)}
    assert skipped <= {"course_lib.measurement.allocator"}
