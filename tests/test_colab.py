"""Colab readiness, beyond tests/test_repo.py (which checks each notebook's own badge and its
bootstrap cell, and runs that cell with a stand-in ``google.colab`` module).

* Links: every Colab address, in the README and in the notebooks, opens a notebook that exists
  in this repository; the README lists every lecture with its own badge.
* What the bootstrap installs: the package pip builds from the repository holds every
  ``course_lib`` module, and its requirements are all preinstalled on Colab at versions they
  accept, so ``pip install git+...`` adds the course and nothing else (above all it must not
  replace Colab's ipywidgets 7, whose front end cannot show ipywidgets 8 models).
* What the notebooks need: only the standard library, the course's runtime requirements and
  ``course_lib``; no repository files (Colab opens the notebook alone); no other installs; no
  matplotlib backend that Colab lacks.
* ipywidgets 7 and 8: Colab runs ipywidgets 7.7.1, the course runs 8. Rather than install 7 in
  a throwaway environment and re-run every lecture (minutes, a download, and only the kernel
  side: JupyterLab 4 cannot host the 7 front end), a static scan checks notebooks and
  ``course_lib`` against the API that 8 added (``API_NEW_IN_8``, derived from both releases by
  comparing their public names, widget traits and style traits). A second scan checks the
  one behaviour that differs: under 7, a figure drawn in a widget callback appears in the
  ``Output`` only if the draw function shows it (``plt.show()``) itself.
"""

import ast
import re
import subprocess
import sys
import zipfile

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager
from notebook_tools import COMPANIONS, EXERCISES, LECTURES, ROOT, SOLUTIONS
from packaging.requirements import Requirement

from course_lib import COURSE_REPO
from course_tools import authoring

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

NOTEBOOKS = LECTURES + COMPANIONS + SOLUTIONS + EXERCISES
MODULES = sorted((ROOT / "course_lib").rglob("*.py"))
COLAB_URL = re.compile(r"https://colab\.research\.google\.com/github/([^/\s)]+/[^/\s)]+)/blob/"
                       r"([^/\s)]+)/([^\s)]+)")
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"

# What Colab's runtime has installed (snapshot of 2025); each runtime requirement of the course
# must be among them and accept that version, so that the bootstrap installs nothing else.
COLAB_PREINSTALLED = {"torch": "2.6.0", "numpy": "2.0.2", "matplotlib": "3.10.0",
                      "ipywidgets": "7.7.1", "tqdm": "4.67.1",
                      # torchao as Colab's GPU runtime lists it in its published pip freeze (2026)
                      "torchao": "0.10.0"}
IMPORT_NAME = {}  # distribution -> module, where they differ (none yet)
# Preinstalled on Colab but not required by the package: imported only inside
# ``try: ... except ImportError``, so that course_lib still imports where they are missing.
COLAB_OPTIONAL = {"triton": "3.6.0"}  # Colab's GPU runtime, beside its torch

# ipywidgets API that 8.1 has and Colab's 7.7.1 lacks. Derived by importing both releases and
# comparing dir(ipywidgets), each widget class's class_trait_names() and its style class's.
API_NEW_IN_8 = {
    "names": {"ColorsInput", "DatetimePicker", "FloatsInput", "IntsInput", "NaiveDatetimePicker",
              "Stack", "TagsInput", "TimePicker", "TypedTuple", "widget_datetime",
              "widget_tagsinput", "widget_time"},
    # Traits new on every widget that has them (``tooltip`` is new except on the buttons).
    "traits": {"behavior", "description_allow_html", "tabbable", "titles", "playing", "repeat",
               "border_bottom", "border_left", "border_right", "border_top"},
    "traits_of": {"DatePicker": {"max", "min", "step"}, "RadioButtons": {"orientation"}},
    "tooltip_in_7": {"Button", "ToggleButton"},
    # Style keys (``style={...}``) new in 8, per widget.
    "style_of": {
        **dict.fromkeys(["Button", "FileUpload"], {"font_family", "font_size", "font_style",
                                                   "font_variant", "text_color",
                                                   "text_decoration"}),
        "ToggleButton": {"font_family", "font_size", "font_style", "font_variant", "font_weight",
                         "text_color", "text_decoration"},
        "Label": {"background", "font_family", "font_size", "font_style", "font_variant",
                  "font_weight", "text_color", "text_decoration"},
        **dict.fromkeys(["Combobox", "HTML", "HTMLMath", "Password", "Text", "Textarea"],
                        {"background", "font_size", "text_color"}),
        "Checkbox": {"background"},
        **dict.fromkeys(["SelectionSlider", "SelectionRangeSlider"], {"handle_color"}),
    },
}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _rel(path) -> str:
    return str(path.relative_to(ROOT))


def _code_cells(path) -> list[tuple[int, str]]:
    """(cell index, Python source) of a notebook's code cells, IPython magics translated."""
    to_python = TransformerManager().transform_cell
    return [(i, to_python(c.source)) for i, c in enumerate(nbformat.read(path, as_version=4).cells)
            if c.cell_type == "code"]


def _sources() -> list[tuple[str, str]]:
    """(where, source) of every course_lib module and every notebook code cell."""
    found = [(_rel(p), p.read_text()) for p in MODULES]
    found += [(f"{_rel(p)} cell {i}", src) for p in NOTEBOOKS for i, src in _code_cells(p)]
    return found


# --- links -------------------------------------------------------------------------------

def test_every_colab_link_opens_a_notebook_of_this_repository():
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for path in NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        texts[_rel(path)] = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    links = [(where, m.groups()) for where, text in texts.items() for m in COLAB_URL.finditer(text)]
    assert links
    bad = [(where, repo, branch, rel) for where, (repo, branch, rel) in links
           if repo != COURSE_REPO or branch != "main" or not (ROOT / rel).is_file()]
    assert not bad, f"Colab links to other repositories, branches or missing files: {bad}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_the_title_badge_opens_this_very_notebook(path):
    title = nbformat.read(path, as_version=4).cells[0].source
    assert BADGE_IMAGE in title
    assert {m.group(3) for m in COLAB_URL.finditer(title)} == {_rel(path)}


@pytest.mark.parametrize("path", LECTURES, ids=_rel)
def test_readme_lists_the_lecture_with_its_badge(path):
    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if f"({_rel(path)})" in line]
    assert rows, f"README.md has no table row linking {_rel(path)}"
    assert authoring.colab_badge(_rel(path)) in rows[0]


def test_the_bootstrap_installs_from_the_project_home():
    assert _project()["urls"]["Homepage"] == f"https://github.com/{COURSE_REPO}"
    assert f'"git+https://github.com/{COURSE_REPO}"' in authoring.bootstrap_source()
    assert authoring.colab_url("notebooks/x.ipynb") == (
        f"https://colab.research.google.com/github/{COURSE_REPO}/blob/main/notebooks/x.ipynb")


# --- what the bootstrap installs ---------------------------------------------------------

def test_runtime_requirements_are_preinstalled_on_colab_at_versions_they_accept():
    for line in _project()["dependencies"]:
        req = Requirement(line)
        name = req.name.lower().replace("_", "-")
        assert name in COLAB_PREINSTALLED, f"{name} is not on Colab: the bootstrap would install it"
        assert req.specifier.contains(COLAB_PREINSTALLED[name], prereleases=True), (
            f"{line!r} rejects Colab's {name} {COLAB_PREINSTALLED[name]}: pip would replace it")


def test_bootstrap_passes_pip_no_upgrade_or_extras():
    tree = ast.parse(authoring.bootstrap_source())
    argv = next(n for n in ast.walk(tree) if isinstance(n, ast.List))
    words = [ast.literal_eval(e) for e in argv.elts if isinstance(e, ast.Constant)]
    assert words == ["-m", "pip", "install", "-q", f"git+https://github.com/{COURSE_REPO}"]


@pytest.mark.slow
def test_the_package_pip_builds_holds_every_module_and_needs_only_the_runtime(tmp_path):
    src = tmp_path / "src"  # build from a copy: never write build/ into the shared checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    for path in MODULES + sorted((ROOT / "course_tools").rglob("*.py")):
        (src / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (src / path.relative_to(ROOT)).write_bytes(path.read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("course_lib-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {_rel(p) for p in MODULES} <= names
    assert not [n for n in names if n.split("/")[0] in ("tests", "notebooks", "benchmarks",
                                                        "course_tools", "solutions")]
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(requires) == sorted(_project()["dependencies"])


# --- what the notebooks need -------------------------------------------------------------

def _allowed_modules() -> set[str]:
    runtime = {Requirement(r).name.lower() for r in _project()["dependencies"]}
    return set(sys.stdlib_module_names) | {IMPORT_NAME.get(n, n) for n in runtime} | {
        "IPython", "course_lib"} | set(COLAB_OPTIONAL)


def test_optional_packages_are_imported_only_where_their_absence_is_handled():
    for path in MODULES:
        tree = ast.parse(path.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
                   and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError"
                           for h in t.handlers) for s in t.body for n in ast.walk(s)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n.split(".")[0] in COLAB_OPTIONAL for n in names):
                assert id(node) in guarded, f"{_rel(path)}: import {names} outside try/except"


def _written(where: str) -> set[str]:
    """The modules a notebook writes itself (``%%writefile name.py``, lecture 07's workers)."""
    if " cell " not in where:
        return set()
    cells = nbformat.read(ROOT / where.split(" cell ")[0], as_version=4).cells
    return {m.group(1) for c in cells if c.cell_type == "code"
            for m in [re.match(r"%%writefile\s+(\w+)\.py\b", c.source)] if m}


def _imports(tree) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_notebooks_and_course_lib_import_only_what_colab_has():
    # Neither may import course_tools (the instructor's and maintainer's tools, with their dev
    # requirements): it is not in the package Colab installs.
    allowed, bad = _allowed_modules(), []
    for where, source in _sources():
        bad += [(where, m) for m in sorted(_imports(ast.parse(source)) - allowed - _written(where))]
    assert not bad, f"imports that Colab (or the course's runtime requirements) lack: {bad}"


def test_the_import_scan_finds_a_maintainers_tool_in_a_notebook():
    tree = ast.parse("from course_tools import authoring\nimport course_tools.grade as g")
    assert _imports(tree) - _allowed_modules() == {"course_tools"}


def test_course_lib_holds_only_the_learners_runtime():
    names = {p.stem for p in (ROOT / "course_lib").glob("*.py")}
    assert not names & {"authoring", "submissions", "grade", "sandbox"}
    # Nothing in it reads the course folder (gone once Colab pip-installs the package).
    for path in MODULES:
        constants = [n.value for n in ast.walk(ast.parse(path.read_text()))
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not [c for c in constants if c in ("solutions", "exercises", "notebooks")], path


REPO_PATH = re.compile(r"^(\.\./|(notebooks|solutions|exercises|benchmarks|tests|course_lib)/)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_needs_no_repository_file_no_install_and_no_foreign_backend(path):
    cells = nbformat.read(path, as_version=4).cells
    code = [(i, c.source) for i, c in enumerate(cells) if c.cell_type == "code"]
    installs = [i for i, src in code[1:] if re.search(r"(^|\n)\s*[%!]\s*(pip|conda|mamba)\b|"
                                                      r"\bpip\b.*\binstall\b", src)]
    assert not installs, f"cells {installs} install packages: only the bootstrap cell may"
    backends = [i for i, src in code if re.search(r"%matplotlib\s+(?!inline\b)\w+", src)]
    assert not backends, f"cells {backends} pick a matplotlib backend Colab lacks (use inline)"
    files = [(i, node.value) for i, src in _code_cells(path) for node in ast.walk(ast.parse(src))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and REPO_PATH.match(node.value)]
    assert not files, f"Colab opens the notebook alone, without the repository: {files}"


# --- ipywidgets 7 and 8 ------------------------------------------------------------------

def _widget_names(tree) -> tuple[set[str], dict[str, str]]:
    """Names bound to the ipywidgets module, and local names bound to its members."""
    modules, members = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "ipywidgets"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ipywidgets":
            for a in node.names:
                if a.name == "widgets":
                    modules.add(a.asname or a.name)
                else:
                    members[a.asname or a.name] = a.name
    return modules, members


def _style_keys(node) -> set[str]:
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {k.arg for k in node.keywords if k.arg}
    return set()


def ipywidgets_8_only(source: str) -> list[str]:
    """Uses of ipywidgets API that ipywidgets 7 lacks, in one Python source."""
    tree = ast.parse(source)
    modules, members = _widget_names(tree)
    if not (modules or members):
        return []
    new = API_NEW_IN_8
    found = [f"ipywidgets.{name}" for name in members.values() if name in new["names"]]

    def widget_class(func) -> str | None:
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and func.value.id in modules:
            return func.attr
        return members.get(func.id) if isinstance(func, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in modules and node.attr in new["names"]:
            found.append(f"ipywidgets.{node.attr}")
        elif isinstance(node, ast.Call) and (cls := widget_class(node.func)):
            for kw in node.keywords:
                if kw.arg in new["traits"] | new["traits_of"].get(cls, set()) or (
                        kw.arg == "tooltip" and cls not in new["tooltip_in_7"]):
                    found.append(f"{cls}({kw.arg}=...)")
                if kw.arg == "style":
                    found += [f"{cls}(style={{{k!r}: ...}})"
                              for k in sorted(_style_keys(kw.value) & new["style_of"].get(cls, set()))]
        elif isinstance(node, ast.Assign):
            found += [f".{t.attr} = ..." for t in node.targets
                      if isinstance(t, ast.Attribute) and t.attr in new["traits"]]
    return found


def test_the_scan_finds_ipywidgets_8_only_api():
    source = """
import ipywidgets as w
from ipywidgets import TagsInput, IntSlider
s = IntSlider(behavior="drag-tap", tooltip="x")
b = w.Button(tooltip="fine in 7", style={"font_size": "12px", "button_color": "red"})
t = w.Tab(titles=["a"])
w.Stack([])
s.description_allow_html = True
ok = w.IntSlider(value=3, description="n", style={"description_width": "initial"})
"""
    assert sorted(ipywidgets_8_only(source)) == sorted([
        "ipywidgets.TagsInput", "IntSlider(behavior=...)", "IntSlider(tooltip=...)",
        "Button(style={'font_size': ...})", "Tab(titles=...)", "ipywidgets.Stack",
        ".description_allow_html = ..."])
    assert ipywidgets_8_only("import ipywidgets as widgets\nwidgets.IntSlider(value=1)") == []


def test_notebooks_and_course_lib_use_only_ipywidgets_api_that_7_has():
    bad = [(where, use) for where, source in _sources() for use in ipywidgets_8_only(source)]
    assert not bad, f"ipywidgets 8 only (Colab runs 7.7.1): {bad}"


def _draw_functions_using_pyplot(source: str) -> list[str]:
    """Functions passed to ``live_plot`` that draw through pyplot or show a figure themselves.

    A widget's ``draw(fig, ...)`` must draw on the ``fig`` it is given: a pyplot figure made
    inside it is not the widget's (under ipywidgets 7, Colab, it is shown outside the widget
    or not at all), and ``plt.show()``/``display`` would put a second copy in the output.
    Functions that ``draw`` calls are scanned too.
    """
    tree = ast.parse(source)
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

    def uses_pyplot(fn, seen=()) -> bool:
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "plt":
                return True
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Attribute) and f.attr == "show") or (
                        isinstance(f, ast.Name) and f.id == "display"):
                    return True
                if isinstance(f, ast.Name) and f.id in defs and f.id not in seen \
                        and uses_pyplot(defs[f.id], (*seen, f.id)):
                    return True
        return False

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and (
                getattr(node.func, "id", None) == "live_plot"
                or getattr(node.func, "attr", None) == "live_plot"):
            draw = node.args[0]
            if isinstance(draw, ast.Name) and draw.id in defs and uses_pyplot(defs[draw.id]):
                bad.append(draw.id)
            elif isinstance(draw, ast.Lambda) and uses_pyplot(draw):
                bad.append("lambda")
    return bad


def test_the_pyplot_scan_finds_draw_functions_that_bypass_their_figure():
    source = """
def on_fig(fig, n):
    fig.subplots().plot([n])

def via_pyplot(fig, n):
    plt.plot([n])

def shows(fig, n):
    on_fig(fig, n)
    fig.show()

def helper(n):
    plt.subplots()

def via_helper(fig, n):
    helper(n)

live_plot(on_fig, {})
live_plot(via_pyplot, {})
live_plot(shows, {})
live_plot(via_helper, {})
live_plot(lambda fig, n: display(fig), {})
live_plot(lambda fig, n: on_fig(fig, n), {})
"""
    assert _draw_functions_using_pyplot(source) == ["via_pyplot", "shows", "via_helper", "lambda"]


def test_every_draw_function_draws_on_the_widgets_own_figure():
    sources = [(_rel(p), p.read_text()) for p in MODULES]
    sources += [(_rel(p), "\n".join(src for _, src in _code_cells(p))) for p in NOTEBOOKS]
    bad = [(where, name) for where, source in sources
           for name in _draw_functions_using_pyplot(source)]
    assert not bad, f"draw functions that draw through pyplot or show a figure themselves; " \
                    f"they must draw on the fig live_plot gives them: {bad}"
