"""Render the picture the README opens with: lecture 03's trade-off at a glance, one setting.

    .venv/bin/python docs/figures/tradeoff.py

GPT-2 124M (1024 tokens) trained in fp16-mixed on the T4 preset, an effective batch of 32 as 8
micro-batches of 4 against one batch of 32 in one pass: memory from the course's memory engine
against the card's memory as PyTorch reports it, time from its time model
(``course_lib.prediction.predict.predict``), both predicted, nothing measured. The widget
that draws the same picture live is ``course_lib.views.step_views.tradeoff_explorer``; the companion
of lecture 03 (``notebooks/deeper/03_gradient_accumulation.ipynb``, § 8) draws this figure and
prints its numbers.
"""

from pathlib import Path

from course_lib.model.zoo import PRESETS
from course_lib.prediction.predict import Step
from course_lib.units import format_bytes
from course_lib.views import step_views

OUT = Path(__file__).resolve().parent / "tradeoff.png"

if __name__ == "__main__":
    setting = step_views.tradeoff(Step(PRESETS["GPT-2 124M"].config, 4, 8, precision="fp16-mixed",
                                       gpu="T4"))
    fig = step_views.tradeoff_figure(
        setting, "GPT-2 124M (1024 tokens), fp16-mixed, on the T4 preset (predicted)")
    fig.savefig(OUT, dpi=100)
    print(f"wrote {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}: "
          f"one batch of 32 {format_bytes(setting.plain.total)}, 8 x 4 "
          f"{format_bytes(setting.accumulated.total)}, time x"
          f"{setting.accumulated.seconds / setting.plain.seconds:.2f}")
