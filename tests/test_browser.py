"""Every lecture, as a learner meets it: JupyterLab on 127.0.0.1 in headless Chromium.

For each notebook in notebooks/ (found by glob, so new lectures are picked up): open a
stripped copy, Run All Cells, check that no cell raised and nothing shows an error (stderr,
traceback, a widget that failed to render, a widget callback that crashed), and that no control
changed the value the code gave it when it was displayed (a value off a slider's step); then
move every slider (arrow key on its focused handle), change every menu, checkbox and toggle,
and press every button and Play widget,
and check that the figure or text it drives is redrawn (a control that matters in one mode only
is tried again in the widget's other modes), with still no error anywhere. A synthetic notebook
with broken widgets proves that the harness sees each of those failures.

Skipped, with the reason, where Chromium or the playwright package is missing;
``COURSE_REQUIRE_BROWSER=1`` (set by CI, which installs both) turns that skip into a failure.
"""

import os

import nbformat
import pytest
from browser_support import Lecture, chromium, lab_server, unavailable
from notebook_tools import LECTURES

pytestmark = pytest.mark.browser
MISSING = unavailable()
BY_NAME = {path.name: path for path in LECTURES}

# Each cell breaks a widget in one way a learner would notice (cell 0 is the working one).
BROKEN = [
    """import sys

import ipywidgets as widgets

from course_lib.views.widgets import live_plot


def draw_ok(fig, n):
    ax = fig.subplots()
    ax.plot([0, n])
    ax.set_title(f"n = {n}")


live_plot(draw_ok, {"n": widgets.IntSlider(value=1, min=0, max=5, description="ok")})""",
    'live_plot(lambda fig, n: print("always the same"),\n'
    '          {"n": widgets.IntSlider(value=1, min=0, max=5, description="stuck")})',
    'live_plot(draw_ok, {"n": widgets.IntSlider(value=3, min=0, max=10, step=2, '
    'description="snaps")})',
    """def draw_crash(fig, k):
    if k != 1:
        raise TypeError("boom")
    print("fine at 1")


live_plot(draw_crash, {"k": widgets.Dropdown(options=[1, 2], value=1, description="crash")})""",
    """def draw_mode(fig, scale, mode):
    print(f"scale {scale}" if mode == "scaled" else "plain")


live_plot(draw_mode, {"scale": widgets.IntSlider(value=1, min=0, max=5, description="scale"),
                      "mode": widgets.Dropdown(options=["plain", "scaled"], description="mode")})""",
    """played = live_plot(draw_ok, {"n": widgets.IntSlider(value=1, min=0, max=5,
                                                     description="played")})
play = widgets.Play(value=1, min=0, max=5, interval=300)
widgets.jslink((play, "value"), (played.controls["n"], "value"))
bump = widgets.Button(description="bump")
bump.on_click(lambda _: setattr(played.controls["n"], "value", (played.controls["n"].value + 1) % 6))
widgets.VBox([play, bump, played])""",
    'print("written to stderr", file=sys.stderr)',
    'raise RuntimeError("this cell fails")',
]


@pytest.fixture(scope="module")
def browser():
    if MISSING:
        if os.environ.get("COURSE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"COURSE_REQUIRE_BROWSER=1 but {MISSING}")
        pytest.skip(f"browser tests skipped: {MISSING}")
    with chromium() as browser:
        yield browser


@pytest.fixture(scope="module")
def lab(browser, tmp_path_factory):
    broken = tmp_path_factory.mktemp("broken") / "zz_broken_widgets.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in BROKEN])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, broken)
    with lab_server([*LECTURES, broken]) as server:
        yield server


@pytest.fixture
def lecture(request, browser, lab):
    view = Lecture(browser, lab, request.param)
    yield view
    view.close()
    lab.shutdown_kernels()


def _widget_cells(path) -> list[int]:
    """Indices of the code cells that build a widget with live_plot."""
    cells = nbformat.read(path, as_version=4).cells
    return [i for i, c in enumerate(cells) if c.cell_type == "code" and "live_plot(" in c.source]


@pytest.mark.parametrize("lecture", list(BY_NAME), indirect=True)
def test_lecture_runs_clean_and_every_control_redraws_its_output(lecture):
    failures = []
    if not lecture.run_all():
        failures.append("Run All stopped: a cell raised")
    if problems := lecture.problems():
        failures.append(f"errors shown after Run All: {problems}")
    if changed := lecture.updates_sent():
        failures.append("before any user action, controls changed the value the code gave "
                        f"them (a value off the slider's step, range or options?): {changed}")
    controls = lecture.controls()
    shown = {c.cell for c in controls}
    if missing := [i for i in _widget_cells(BY_NAME[lecture.name]) if i not in shown]:
        failures.append(f"cells {missing} build a widget but show no control")
    if stuck := [str(c) for c in controls if not lecture.redraws(c, controls)]:
        failures.append(f"moving these did not redraw their output: {stuck}")
    if problems := set(lecture.problems()) - set(problems):
        failures.append(f"errors shown after moving the controls: {sorted(problems)}")
    assert not failures, f"{lecture.name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("lecture", ["zz_broken_widgets.ipynb"], indirect=True)
def test_the_harness_sees_each_kind_of_breakage(lecture):
    assert not lecture.run_all(), "a cell that raises must fail Run All"
    problems = lecture.problems()
    assert any("written to stderr" in p for p in problems)
    assert any("Traceback" in p for p in problems)
    assert lecture.updates_sent() == [{"value": 4}]  # 3 is off the step of 2: shown as 4

    found = lecture.controls()
    controls = {c.label: c for c in found}
    assert [(c.label, c.kind) for c in found] == [("ok", "slider"), ("stuck", "slider"),
                                                  ("snaps", "slider"), ("scale", "slider"),
                                                  ("played", "slider"), ("crash", "dropdown"),
                                                  ("mode", "dropdown"), ("", "play"),
                                                  ("bump", "button")]
    assert lecture.move(controls["ok"]).redrawn
    assert lecture.move(controls["bump"]).redrawn  # a button that redraws
    assert lecture.move(controls[""]).redrawn  # a Play widget, linked to a slider in the browser
    stuck = lecture.move(controls["stuck"], timeout=30)
    assert (stuck.redrawn, stuck.outcome) == (False, "same")  # seen at once, not by timeout
    assert not lecture.move(controls["scale"]).redrawn  # matters only in the other mode...
    assert lecture.redraws(controls["scale"], found)  # ...which redraws() finds
    assert not any("TypeError" in p for p in lecture.problems())
    lecture.move(controls["crash"])
    assert any("⚠ TypeError: boom" in p for p in lecture.problems())
