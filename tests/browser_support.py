"""Drive the course notebooks in a real JupyterLab, in headless Chromium, as a learner would.

Used by ``tests/test_browser.py`` (every lecture runs without error; every control it shows
redraws its output) and by ``benchmarks/widget_latency.py --browser`` (how long that takes).

* :func:`unavailable` says why the browser cannot run here (no ``playwright``, no Chromium).
* :func:`lab_server` serves a throwaway *copy* of notebooks, outputs stripped, from JupyterLab
  on 127.0.0.1 (free port, token, isolated settings), and always shuts it down.
* :func:`chromium` launches Debian's Chromium through Playwright (never Playwright's own build).
* :class:`Lecture` opens one notebook in a page, runs all cells, lists the controls, moves one
  the way a user does (arrow key on the focused slider handle, a click on a checkbox, a button or
  a Play widget's play button, a choice in a menu) and
  waits until the output it drives has been redrawn.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course_lib.distributed.ranks import _free_port

CHROMIUM = Path(os.environ.get("COURSE_CHROMIUM", "/usr/bin/chromium"))
# Flags that work as root in a container: no sandbox, no GPU, and no traffic of its own.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STDERR = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'

# JupyterLab user settings for the test server: every cell in the DOM (no windowing, so
# offscreen outputs can be read), no news or update checks (no network, no pop-ups).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": '{"windowingMode": "none"}',
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        '{"fetchNews": "false", "checkForUpdates": false}',
}


def unavailable() -> str | None:
    """Why the browser tests cannot run on this machine, or None when they can."""
    if importlib.util.find_spec("playwright") is None:
        return "the Python package playwright is not installed (pip install playwright)"
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set COURSE_CHROMIUM)"
    return None


def strip_outputs(src: Path, dst: Path) -> None:
    """Copy a notebook without outputs or saved widget state: what the browser shows is fresh."""
    nb = nbformat.read(src, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, dst)


@dataclass
class LabServer:
    url: str
    token: str
    root: Path
    log: Path

    def api(self, path: str, method: str = "GET") -> bytes:
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()

    def lab_url(self, name: str) -> str:
        return f"{self.url}/lab/tree/{name}?reset&token={self.token}"

    def shutdown_kernels(self) -> None:
        """Stop every kernel, so that a finished lecture does not hold a core."""
        import json

        for kernel in json.loads(self.api("/api/kernels")):
            self.api(f"/api/kernels/{kernel['id']}", method="DELETE")


@contextmanager
def lab_server(notebooks: Iterable[Path], *, start_timeout: float = 120) -> Iterator[LabServer]:
    """JupyterLab serving stripped copies of ``notebooks`` from a temporary folder.

    The committed notebooks are never served, so the browser cannot save over them. All of
    Jupyter's config, data, runtime and settings folders are temporary too.
    """
    tmp = Path(tempfile.mkdtemp(prefix="course-lab-"))
    root = tmp / "notebooks"
    root.mkdir()
    for path in notebooks:
        strip_outputs(Path(path), root / Path(path).name)
    settings = tmp / "settings"
    for name, text in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(text)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"))
    env.pop("MPLBACKEND", None)  # the kernel must use its inline backend, as a learner's does
    port, token = _free_port(), secrets.token_hex(16)
    log = tmp / "jupyter.log"
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run all, kernel status
               "--ServerApp.jpserver_extensions={'jupyter_lsp': False}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    with open(log, "wb") as log_file:
        process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = LabServer(f"http://127.0.0.1:{port}", token, root, log)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                server.api("/api/status")
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.2)
        yield server
    finally:
        _stop(process)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (server and kernels), SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=15)


@contextmanager
def chromium():
    """A headless Chromium (Debian's) driven by Playwright; yields the Browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


# In-page helpers. A control is any input a widget shows inside a cell's output; the output it
# drives is every ipywidgets Output area of that same cell (live_plot puts the figure there).
_JS = r"""
window.__course = {
  kernelIdle() {
    const w = window.jupyterapp.shell.currentWidget;
    return w?.sessionContext?.session?.kernel?.status === 'idle';
  },
  controls() {
    const kinds = [
      ['slider', '.noUi-handle[data-handle="0"]'],
      ['dropdown', '.widget-dropdown select'],
      ['checkbox', '.widget-checkbox input[type="checkbox"]'],
      ['toggle-buttons', '.widget-toggle-buttons'],
      ['radio', '.widget-radio-box'],
      ['toggle-button', 'button.widget-toggle-button'],
      ['play', '.widget-play'],
      ['button', 'button.jupyter-button'],
    ];
    // A Play widget's own buttons and the buttons of a ToggleButtons are parts of other controls.
    const part = el => el.closest('.widget-play, .widget-toggle-buttons')
      || el.classList.contains('widget-toggle-button');
    const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
    const found = [];
    for (const [kind, selector] of kinds) {
      for (const el of document.querySelectorAll(`.jp-OutputArea-output ${selector}`)) {
        if (el.closest('[disabled]') || el.querySelector('[disabled]')) continue;
        if (kind === 'button' && part(el)) continue;
        const cell = el.closest('.jp-Cell');
        el.dataset.courseControl = String(found.length);
        const box = el.closest('.widget-inline-hbox') || el.parentElement;
        const text = e => (e?.textContent ?? '').replace(/\u200b/g, '').trim();
        const label = kind === 'button' ? text(el) : (text(box?.querySelector('.widget-label'))
          || text(box?.querySelector('.widget-label-basic')) || text(el));
        found.push({index: found.length, kind, label, cell: cells.indexOf(cell)});
      }
    }
    return found;
  },
  outputOf(el) {
    const outputs = el.closest('.jp-Cell')?.querySelectorAll('.widget-output, img.widget-image')
      ?? [];
    // What a learner sees: the text and the images (not attributes the output area sets); an
    // Image widget's source is a new blob URL for every new picture, '' while it is hidden.
    const seen = o => o.tagName === 'IMG' ? (o.offsetParent === null ? '' : o.src)
      : [o.innerText, ...[...o.querySelectorAll('img')].map(i => i.src),
         ...[...o.querySelectorAll('svg')].map(g => g.outerHTML)].join('\n');
    return outputs.length ? [...outputs].map(seen).join('\n') : null;
  },
  watchUpdates() {  // the control values the front end sends, and which the kernel finished
    this.sent = [];
    this.done = new Set();
    const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
    kernel.anyMessage.connect((_, {msg, direction}) => {
      if (direction === 'recv' && msg.header.msg_type === 'status'
          && msg.content.execution_state === 'idle') {
        this.done.add(msg.parent_header.msg_id);
        this.doneAt = performance.now();
      }
      const data = msg.content?.data;
      if (direction !== 'send' || msg.header.msg_type !== 'comm_msg' || data?.method !== 'update') {
        return;
      }
      // Output widgets send their outputs back too: keep only what a control holds.
      const state = Object.fromEntries(Object.entries(data.state ?? {})
        .filter(([key]) => ['value', 'index'].includes(key)));
      if (Object.keys(state).length) this.sent.push({id: msg.header.msg_id, state});
    });
  },
  settled() {  // true once the page's outputs and widget views stop changing for 500 ms
    const count = document.querySelectorAll('.jp-OutputArea-output, .jupyter-widgets').length;
    const now = performance.now();
    if (count !== this._count) { this._count = count; this._since = now; }
    return this.kernelIdle() && now - this._since >= 500;
  },
  // After a user action: 'changed' once the output differs and the kernel is idle; 'same'
  // once the kernel has handled every value sent since (200 ms ago) and the output is as it was.
  outcome(el, before, sentBefore) {
    if (!this.kernelIdle()) return false;
    const now = this.outputOf(el);
    if (now !== null && now !== before && now.trim() !== '') return 'changed';
    const sent = this.sent.slice(sentBefore);
    const handled = sent.length && sent.every(m => this.done.has(m.id));
    return handled && performance.now() - this.doneAt > 200 ? 'same' : false;
  },
  problems() {
    const texts = [...document.querySelectorAll('%(stderr)s')]
      .map(e => e.innerText.trim().slice(0, 1000));
    for (const out of document.querySelectorAll('.jp-OutputArea-output')) {
      const text = out.innerText || '';
      for (const pattern of [/Traceback \(most recent call last\)/, /Error displaying widget/,
                             /⚠ \w*(Error|Exception)\b.*/]) {
        const m = text.match(pattern);
        if (m) texts.push(m[0]);
      }
    }
    return [...new Set(texts)];
  },
};
""".replace("%(stderr)s", STDERR.replace("'", "\\'"))


@dataclass
class Control:
    index: int
    kind: str
    label: str
    cell: int

    def __str__(self) -> str:
        return f"{self.kind} {self.label!r} (cell {self.cell})"


@dataclass
class Move:
    control: Control
    redrawn: bool  # the output the control drives changed
    ms: float  # action to finished redraw; NaN when not redrawn
    outcome: str  # "changed", "same" (the kernel drew the same output) or "timeout"


class Lecture:
    """One notebook open in its own page of ``server``'s JupyterLab."""

    def __init__(self, browser, server: LabServer, name: str, *, timeout: float = 120):
        self.name, self.timeout_ms = name, timeout * 1000
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page_errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.page_errors.append(str(exc)))
        self.page.set_default_timeout(self.timeout_ms)
        self.page.goto(server.lab_url(name))
        self.page.wait_for_function(
            "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel"
            "?.status === 'idle'")
        self.page.evaluate(_JS)
        self.page.evaluate("() => window.__course.watchUpdates()")

    def close(self) -> None:
        self.page.close()

    def run_all(self) -> bool:
        """Run all cells, as Run > Run All Cells does; False if a cell raised."""
        ok = self.page.evaluate(
            "async () => await window.jupyterapp.commands.execute('notebook:run-all-cells')")
        self.page.wait_for_function("() => window.__course.settled()", polling=100)
        return bool(ok)

    def updates_sent(self) -> list[dict]:
        """Control values (``{"value": ...}`` or ``{"index": ...}``) the front end has sent.

        Before any user action this should be empty: an update then means that a control
        could not show the value the code gave it and changed it (a slider snapping to its
        step, a menu without that option), so the learner sees another state than the code's.
        """
        return self.page.evaluate("() => window.__course.sent.map(m => m.state)")

    def controls(self) -> list[Control]:
        return [Control(**c) for c in self.page.evaluate("() => window.__course.controls()")]

    def problems(self) -> list[str]:
        """Error outputs, tracebacks and widget failures anywhere in the page."""
        return self.page.evaluate("() => window.__course.problems()") + [
            f"JavaScript error: {e}" for e in self.page_errors]

    def move(self, control: Control, *, timeout: float = 120) -> Move:
        """Change ``control`` once, as a user does, and wait for the kernel to answer.

        ``ms`` runs from the user's action to the redrawn output with the kernel idle again
        (it includes a few ms of the driver's round trips); it is NaN when the output did not
        change: the kernel handled the new value and drew the same thing, or nothing happened
        within ``timeout`` seconds.
        """
        el = self.page.locator(f'[data-course-control="{control.index}"]')
        el.scroll_into_view_if_needed()
        before = el.evaluate("el => window.__course.outputOf(el)")
        sent = self.page.evaluate("() => window.__course.sent.length")
        start = time.perf_counter()
        getattr(self, f"_act_{control.kind.replace('-', '_')}")(el)
        try:
            outcome = self.page.wait_for_function(
                "([el, before, sent]) => window.__course.outcome(el, before, sent)",
                arg=[el.element_handle(), before, sent], polling=5,
                timeout=timeout * 1000).json_value()
        except Exception as exc:  # playwright's TimeoutError: report, do not raise
            if "Timeout" not in type(exc).__name__:
                raise
            outcome = "timeout"
        ms = (time.perf_counter() - start) * 1000 if outcome == "changed" else float("nan")
        if control.kind == "play" and el.locator(".fa-pause").count():
            # Pause the animation: its frames' updates would race the next control's move.
            el.locator("button").first.click()
            self.page.wait_for_function("() => window.__course.settled()", polling=100)
        return Move(control, outcome == "changed", ms, outcome)

    def redraws(self, control: Control, controls: list[Control]) -> bool:
        """Does moving ``control`` redraw its output, now or once a menu, checkbox or toggle
        of the same widget is set otherwise (a slider may matter in one mode only)?"""
        if self.move(control).redrawn:
            return True
        for other in controls:
            if other.cell != control.cell or other.kind == "slider" or other is control:
                continue
            for _ in range(self._choices(other) - 1):
                self.move(other)
                if self.move(control).redrawn:
                    return True
        return False

    def _choices(self, control: Control) -> int:
        el = self.page.locator(f'[data-course-control="{control.index}"]')
        return {"dropdown": lambda: el.evaluate("el => el.options.length"),
                "toggle-buttons": lambda: el.locator("button").count(),
                "radio": lambda: el.locator("input").count()}.get(control.kind, lambda: 2)()

    # One user action per kind of control.
    def _act_slider(self, el) -> None:
        now, top = (float(el.get_attribute(a)) for a in ("aria-valuenow", "aria-valuemax"))
        vertical = el.get_attribute("aria-orientation") == "vertical"
        up, down = ("ArrowUp", "ArrowDown") if vertical else ("ArrowRight", "ArrowLeft")
        el.press(down if now >= top else up)

    def _act_dropdown(self, el) -> None:
        count = el.evaluate("el => el.options.length")
        el.select_option(index=(max(0, el.evaluate("el => el.selectedIndex")) + 1) % count)

    def _act_checkbox(self, el) -> None:
        el.click()

    def _act_toggle_button(self, el) -> None:
        el.click()

    def _act_toggle_buttons(self, el) -> None:  # the next option, as for a menu
        active = el.evaluate("el => [...el.querySelectorAll('button')]"
                             ".findIndex(b => b.classList.contains('mod-active'))")
        buttons = el.locator("button")
        buttons.nth((max(0, active) + 1) % buttons.count()).click()

    def _act_play(self, el) -> None:  # its first button plays (or pauses) the animation
        el.locator("button").first.click()

    def _act_button(self, el) -> None:
        el.click()

    def _act_radio(self, el) -> None:
        checked = el.evaluate("el => [...el.querySelectorAll('input')].findIndex(i => i.checked)")
        inputs = el.locator("input")
        inputs.nth((max(0, checked) + 1) % inputs.count()).click()
