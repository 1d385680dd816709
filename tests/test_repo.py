"""The repository's promises: one package set, badges that point home, committed outputs,
a Colab bootstrap that installs the course and nothing else."""

import json
import re
import subprocess
import sys
import types

import pytest
from notebook_tools import COMPANIONS, EXERCISES, LECTURES, ROOT, SOLUTIONS, read

from course_lib import COURSE_REPO
from course_tools import authoring

ALL_NOTEBOOKS = LECTURES + COMPANIONS + SOLUTIONS + EXERCISES


def _rel(path) -> str:
    return path.relative_to(ROOT).as_posix()
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_and_pyproject_name_the_same_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env, section = set(), None
    for line in (ROOT / "environment.yml").read_text().splitlines():
        item = line.strip()
        if not line.startswith(" "):
            section = line.split(":")[0]
        if section == "dependencies" and item.startswith("- ") and not item.endswith(":"):
            name = _name(item[2:])
            if name not in ("python", "pip", "-e"):
                env.add(name)
    assert env == declared


def test_install_path_pins_the_cpu_torch():
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in pins
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch>=2.4" in project["dependencies"]
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_rel)
def test_notebook_has_its_own_colab_badge_and_the_bootstrap_cell(path):
    nb = read(path)
    assert authoring.colab_url(_rel(path)) in nb.cells[0].source
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    assert first_code.source == authoring.bootstrap_source()


@pytest.mark.parametrize("path", LECTURES + COMPANIONS + SOLUTIONS, ids=_rel)
def test_lectures_and_solutions_are_committed_executed(path):
    code = [c for c in read(path).cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), f"run `make outputs NB={path.relative_to(ROOT)}`"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_exercises_are_committed_without_outputs(path):
    assert all(not c.get("outputs") for c in read(path).cells if c.cell_type == "code")


def _run_bootstrap(monkeypatch, colab: bool):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append((a, k)))
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(authoring.bootstrap_source(), {})
    return calls


def test_bootstrap_is_a_no_op_outside_colab(monkeypatch):
    assert _run_bootstrap(monkeypatch, colab=False) == []


def test_bootstrap_installs_only_the_course_on_colab(monkeypatch):
    calls = _run_bootstrap(monkeypatch, colab=True)
    assert len(calls) == 1
    (argv,), kwargs = calls[0]
    assert argv[:4] == [sys.executable, "-m", "pip", "install"]
    assert [a for a in argv[4:] if not a.startswith("-")] == [f"git+https://github.com/{COURSE_REPO}"]
    assert kwargs == {"check": True}


@pytest.mark.parametrize("path", LECTURES + COMPANIONS, ids=_rel)
def test_lectures_export_to_slides(path, tmp_path):
    nb = read(path)
    slides = [c for c in nb.cells if c.metadata.get("slideshow", {}).get("slide_type") == "slide"]
    assert len(slides) >= 2, "run `make outputs` to stamp slideshow metadata"
    from nbconvert import SlidesExporter

    html, _ = SlidesExporter().from_notebook_node(nb)
    assert html.count("<section") >= len(slides)


def _index(doc: str) -> list[str]:
    """The names of an index table (a package's ``__init__`` docstring), top to bottom."""
    return re.findall(r"^``(\w+)``", doc, re.M)


def _module_index() -> list[str]:
    """Every module of course_lib in import order: the top modules and each wing's modules
    (``wing.module``) where the wing stands in the top index."""
    import importlib

    import course_lib

    order = []
    for name in _index(course_lib.__doc__):
        if (ROOT / "course_lib" / name / "__init__.py").exists() and name != "grading":
            wing = importlib.import_module(f"course_lib.{name}")
            order += [f"{name}.{module}" for module in _index(wing.__doc__)]
        else:
            order.append(name)
    return order


def _imports_in(source: str, package: tuple = ("course_lib",)) -> set[str]:
    """The course_lib modules ``source`` imports (``units``, ``model.gpt``, ``grading``), at the
    top or inside functions; a relative import resolves against ``package``, the parts of the
    source's package (``("course_lib", "grading")`` for a file of course_lib/grading/)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(".".join(a.name.split(".")[1:3]) for a in node.names
                         if a.name.startswith("course_lib."))
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        parts = list(package[:len(package) - node.level + 1]) if node.level else []
        parts += node.module.split(".") if node.module else []
        if parts[:1] != ["course_lib"]:
            continue
        names = [a.name for a in node.names]
        if len(parts) == 1:
            found.update(names)
        elif (ROOT / "course_lib" / parts[1] / "__init__.py").exists() and len(parts) == 2:
            found.update(f"{parts[1]}.{n}" if (ROOT / "course_lib" / parts[1] / f"{n}.py").exists()
                         else parts[1] for n in names)
        else:
            found.add(".".join(parts[1:3]))
    return {"grading" if m.startswith("grading") else m for m in found}


def _course_lib_imports(path) -> set[str]:
    """:func:`_imports_in` of a file of course_lib, its package taken from its path."""
    parts = path.parent.parts
    return _imports_in(path.read_text(), parts[len(parts) - parts[::-1].index("course_lib") - 1:])


def test_the_module_index_lists_every_module_once():
    index = _module_index()
    lib = ROOT / "course_lib"
    modules = {p.stem for p in lib.glob("*.py") if p.stem != "__init__"}
    for wing in (p for p in lib.iterdir() if (p / "__init__.py").exists()):
        modules |= ({wing.name} if wing.name == "grading" else
                    {f"{wing.name}.{p.stem}" for p in wing.glob("*.py") if p.stem != "__init__"})
    assert sorted(index) == sorted(modules)
    assert len(index) == len(set(index))


def test_the_top_holds_at_most_a_dozen_modules():
    top = [p for p in (ROOT / "course_lib").glob("*.py") if p.stem != "__init__"]
    assert len(top) <= 12, sorted(p.stem for p in top)


def test_modules_import_only_modules_above_them_in_the_index():
    index = _module_index()
    later = {}
    for name in index:
        path = ROOT / "course_lib" / (name.replace(".", "/") + ".py")
        files = [path] if path.exists() else sorted((ROOT / "course_lib" / name).glob("*.py"))
        for file in files:
            bad = [m for m in _course_lib_imports(file)
                   if m in index and index.index(m) >= index.index(name) and m != name]
            if bad:
                later[str(file.relative_to(ROOT))] = bad
    assert not later, f"modules importing modules at or below them in the index: {later}"


def test_the_import_check_catches_a_later_import(tmp_path):
    module = tmp_path / "course_lib" / "planning" / "mod.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from course_lib.training.levers import use_chunked_loss\n\n"
                      "from course_lib.planning.fit import fit_model\nfrom course_lib import units\n"
                      "from course_lib.views import widgets\n")
    assert _course_lib_imports(module) == {"training.levers", "planning.fit", "units",
                                           "views.widgets"}
    grading = tmp_path / "course_lib" / "grading" / "lecture09.py"
    grading.parent.mkdir()
    grading.write_text("from .core import grader\nfrom ..units import GiB\nfrom .. import claims\n")
    assert _course_lib_imports(grading) == {"grading", "units", "claims"}


def _private_uses(path) -> list[str]:
    """Another course_lib module's private names that ``path`` uses: ``from course_lib.x import
    _y`` and ``alias._y`` where ``alias`` is a course_lib module it imported."""
    import ast

    tree, own = ast.parse(path.read_text()), path.stem
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                "course_lib")):
            source = (node.module or "").split(".")[-1]
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and source != own:
                    found.append(f"{node.module}.{a.name}")
                elif not a.name.startswith("_"):
                    aliases[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__") and aliases[node.value.id] != own):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    used = {str(p.relative_to(ROOT)): _private_uses(p)
            for p in sorted((ROOT / "course_lib").rglob("*.py"))}
    assert not {p: names for p, names in used.items() if names}


def test_the_private_name_check_catches_both_forms(tmp_path):
    module = tmp_path / "mod.py"
    module.write_text("from course_lib.prediction import activations as act\n"
                      "from course_lib.model.kernels import _gpu\nact._check(1)\n")
    assert sorted(_private_uses(module)) == ["act._check", "course_lib.model.kernels._gpu"]


def _notebook_imports(path) -> set[str]:
    """The course_lib modules a notebook's code cells import (shell and magic lines left out)."""
    found = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            found |= _imports_in("\n".join(line for line in "".join(cell["source"]).splitlines()
                                           if not line.lstrip().startswith(("%", "!"))))
    return found


def test_the_lecture_table_lists_what_each_lecture_imports():
    """course_lib's lecture table: each lecture's row names exactly the modules its notebooks
    (the lecture, its companion in notebooks/deeper/, its exercises) import."""
    import course_lib

    table = course_lib.__doc__.split("The code behind each lecture")[1]
    rows = re.findall(r"^(\d\d) +(.+(?:\n {8}.+)*)", table, re.M)
    documented = {n: {m.strip() for m in " ".join(mods.split()).split(",")} for n, mods in rows}
    imported = {}
    for folder in ("notebooks", "notebooks/deeper", "solutions"):
        for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            imported.setdefault(path.name[:2], set()).update(_notebook_imports(path))
    assert documented == imported


def test_contributing_shows_the_module_index():
    """CONTRIBUTING.md's module map: the index's modules in its order, with its words."""
    import importlib

    import course_lib

    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text[text.index("<!-- module map -->"):text.index("<!-- end of the module map -->")]
    rows = re.findall(r"^\| `([\w.]+)` \| ([\d-]+|all) \| (.*) \|$", table, re.M)
    pattern = r"^``(\w+)``\s+(?:([\d-]+): )?(.*)$"
    index = []
    for name, lecture, what in re.findall(pattern, course_lib.__doc__, re.M):
        if (ROOT / "course_lib" / name / "__init__.py").exists() and name != "grading":
            wing = importlib.import_module(f"course_lib.{name}")
            index += [(f"{name}.{m}", lec, w) for m, lec, w in re.findall(pattern, wing.__doc__, re.M)]
        else:
            index.append((name, lecture, what))
    assert [(m, lecture or "all", what.replace("``", "`")) for m, lecture, what in index] == rows


def _guide_table(number: str) -> list[tuple[str, int]]:
    """``(section, minutes)`` rows of the timing table under the guide's ``## NN ·`` heading."""
    guide = (ROOT / "docs" / "instructor_guide.md").read_text()
    part = re.split(r"^## ", guide, flags=re.M)
    section = next(p for p in part if p.startswith(f"{number} · "))
    rows = re.findall(r"^\| (.+?) \| \**(\d+)\** \|$", section, flags=re.M)
    return [(name.strip("*"), int(minutes)) for name, minutes in rows]


def _timing_problems(headings: list[str], rows: list[tuple[str, int]]) -> list[str]:
    """What is wrong with a lecture's timing table: a ``##`` section with no row, rows out of
    the lecture's order, a total that is not the sum, or more than an hour."""
    *sections, (total_name, total) = rows
    problems = [] if total_name == "total" else ["the last row is not the total"]
    if sum(m for _, m in sections) != total:
        problems.append(f"rows sum to {sum(m for _, m in sections)}, total says {total}")
    if total > 60:
        problems.append(f"{total} minutes: more than an hour")
    if not sections or not sections[0][0].startswith("title"):
        problems.append("the first row is not the title")
    last = 0
    for heading in headings:
        found = [i for i, (name, _) in enumerate(sections) if heading in name]
        if not found:
            problems.append(f"no row for section {heading!r}")
        elif found[-1] < last:
            problems.append(f"section {heading!r} is out of the lecture's order")
        else:
            last = next(i for i in found if i >= last)
    return problems


@pytest.mark.parametrize("path", LECTURES, ids=lambda p: p.name)
def test_instructor_guide_times_every_section_of_the_lecture_within_an_hour(path):
    headings = [re.sub(r"\s*<a id=.*?</a>", "", line[3:]).strip()
                for cell in read(path).cells if cell.cell_type == "markdown"
                for line in cell.source.split("\n") if line.startswith("## ")]
    assert headings
    assert _timing_problems(headings, _guide_table(path.name[:2])) == []


def test_the_timing_check_catches_a_missing_or_misordered_section():
    rows = [("title and overview", 3), ("1. A", 20), ("2. B", 30), ("Summary, Next", 2),
            ("total", 55)]
    assert _timing_problems(["1. A", "2. B", "Summary", "Next"], rows) == []
    assert _timing_problems(["1. A", "2. B", "3. C"], rows) == ["no row for section '3. C'"]
    assert _timing_problems(["2. B", "1. A"], rows) == ["section '1. A' is out of the lecture's order"]
    rows[-1] = ("total", 65)
    assert _timing_problems(["1. A"], rows) == ["rows sum to 55, total says 65",
                                                "65 minutes: more than an hour"]


@pytest.mark.parametrize("path", LECTURES + COMPANIONS, ids=_rel)
def test_check_cells_are_committed_collapsed(path):
    nb = read(path)
    before = [dict(c.metadata) for c in nb.cells]
    authoring.stamp_check_cells(nb)
    assert [dict(c.metadata) for c in nb.cells] == before, (
        f"run `python -m course_tools.authoring outputs {path.relative_to(ROOT)}`")


def test_the_claims_page_speaks_the_lectures_verdict_vocabulary():
    from course_lib.claims import _VERDICTS as VERDICTS

    rows = [line for line in (ROOT / "docs" / "claims.md").read_text().splitlines()
            if line.startswith('| "')]
    assert len(rows) > 30
    words = [re.match(r"\| \".*?\"[^|]*\| \*\*([^*]+)\*\*", row) for row in rows]
    assert all(words), [row[:80] for row, w in zip(rows, words) if not w]
    assert {w.group(1) for w in words} <= set(VERDICTS)


def _public_names(module) -> list[str]:
    """``__all__``, else the classes and functions the module defines without an underscore."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(module).items() if not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__]


def _docs_beside(module, name: str) -> str:
    """The module's docstring and those of its other public names, methods and properties."""
    import inspect

    docs = [inspect.getdoc(module) or ""]
    for other in _public_names(module):
        obj = getattr(module, other)
        if other == name or not (callable(obj) or inspect.isclass(obj)):
            continue
        docs.append(inspect.getdoc(obj) or "")
        for member in vars(obj).values() if inspect.isclass(obj) else ():
            member = member.fget if isinstance(member, property) else getattr(
                member, "__func__", member)
            if callable(member):
                docs.append(inspect.getdoc(member) or "")
    return "\n".join(docs)


def test_every_public_name_is_used_or_documented_beside_what_uses_it():
    """What the notebooks, the exercises and other modules use is public; so are the types a
    public function returns and the menus its parameters name, which its docstring names. The
    rest is private to its module (an underscore), so that a reader knows what to learn."""
    import importlib
    import pkgutil

    import course_lib

    texts = {}
    for path in [*LECTURES, *COMPANIONS, *EXERCISES, *SOLUTIONS]:
        texts[str(path)] = "\n".join(c.source for c in read(path).cells if c.cell_type == "code")
    for folder in ("course_lib", "course_tools", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            texts[str(path)] = path.read_text()
    unused = []
    for info in pkgutil.walk_packages(course_lib.__path__, "course_lib."):
        module = importlib.import_module(info.name)
        own = str(ROOT / (info.name.replace(".", "/") + ".py"))
        for name in _public_names(module):
            word = re.compile(rf"\b{re.escape(name)}\b")
            if not any(word.search(t) for path, t in texts.items() if path != own) and not (
                    word.search(_docs_beside(module, name))):
                unused.append(f"{info.name}.{name}")
    assert not unused, f"public, yet used and documented nowhere else: {unused}"
