"""Thin ipywidgets views: controls, one output area, one pure function that draws.

Every widget in the course is built with :func:`live_plot`: the callback reads the
controls, calls a ``draw(**values)`` function (which calls one pure ``course_lib``
function and draws one matplotlib figure, ending with ``plt.show()`` so that it
also renders under the ipywidgets 7 that Colab ships), and shows a bad value as a
message instead of a traceback. Only APIs common to ipywidgets 7 and 8 are used
(``observe(..., names="value")``, ``Output`` as a context manager).
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets


def show_error(exc: Exception) -> None:
    """How a widget reports bad input: one line, no traceback."""
    kind = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
    print(f"⚠ {kind}{exc}")


def live_plot(draw: Callable[..., None], controls: dict[str, widgets.Widget],
              *, columns: int = 3) -> widgets.VBox:
    """A box of ``controls`` over an output area that ``draw(**values)`` redraws on every change.

    The returned box has a ``redraw()`` method (used by tests and benchmarks) and an
    ``output`` attribute (the ``ipywidgets.Output`` that holds the figure).
    """
    if not controls:
        raise ValueError("controls must name at least one widget")
    out = widgets.Output()

    def redraw(change=None) -> None:
        values = {name: control.value for name, control in controls.items()}
        with out:
            out.clear_output(wait=True)
            try:
                draw(**values)
            except Exception as exc:  # a bad value must show a message, not kill the view
                show_error(exc)

    for control in controls.values():
        control.observe(redraw, names="value")
    items = list(controls.values())
    rows = [widgets.HBox(items[i:i + columns]) for i in range(0, len(items), columns)]
    box = widgets.VBox([*rows, out])
    box.redraw, box.output, box.controls = redraw, out, controls
    redraw()
    return box
