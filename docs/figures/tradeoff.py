"""Render the picture the README opens with: lecture 03's trade-off at a glance, one setting.

    .venv/bin/python docs/figures/tradeoff.py

GPT-2 124M (1024 tokens) trained in bf16-mixed on the A100 80GB preset, an effective batch of
64 as 16 micro-batches of 4 with every block checkpointed, against one batch of 64 in one pass:
memory from the course's memory engine, time from its time model
(``course_lib.playground.optimizer_step_cost``), both predicted, nothing measured. The widget
that draws the same picture live is ``course_lib.step_views.tradeoff_explorer``.
"""

from pathlib import Path

from course_lib import step_views
from course_lib.model_zoo import PRESETS

OUT = Path(__file__).resolve().parent / "tradeoff.png"

if __name__ == "__main__":
    setting = step_views.tradeoff(PRESETS["GPT-2 124M"].config, 4, 16, checkpointing="blocks",
                                  precision="mixed", gpu="A100 80GB")
    fig = step_views.tradeoff_figure(
        setting, "GPT-2 124M (1024 tokens), bf16-mixed, on the A100 80GB preset (predicted)")
    fig.savefig(OUT, dpi=100)
    print(f"wrote {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}: "
          f"memory x{setting.step.peak_bytes / setting.plain.peak_bytes:.2f}, "
          f"time x{setting.step.seconds / setting.plain.seconds:.2f} of the plain step")
