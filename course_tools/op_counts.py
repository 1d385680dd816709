"""Record the operator counts the time model reads (course_lib/prediction/op_counts.json).

Counts one training step of a tiny GPT for every structure the course's models, modes and
precisions can take, on 1 and 2 layers (:func:`course_lib.prediction.time_model.count_step_ops`).
Run it again after a PyTorch upgrade: ``python -m course_tools.op_counts``; a test recounts a
sample and compares.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

from course_lib.model.gpt import ATTENTION_KINDS
from course_lib.prediction import time_model
from course_lib.prediction.engine import PRECISIONS

PATH = Path(time_model.__file__).parent / "op_counts.json"


def structures():
    """Every key the time model may ask for: layers, dropout, attention, bias, mode, precision,
    AdamW's implementation."""
    return itertools.product((1, 2), (False, True), ATTENTION_KINDS, (False, True),
                             time_model.CHECKPOINTING, PRECISIONS, (False, True))


def main() -> int:
    torch.set_num_threads(1)
    counts = {}
    for i, key in enumerate(structures()):
        counts[time_model.op_count_key(*key)] = list(time_model.count_step_ops(*key))
        if i % 64 == 0:
            print(f"{i} structures counted", file=sys.stderr)
    rows = ",\n".join(f"  {json.dumps(key)}: {json.dumps(n)}" for key, n in sorted(counts.items()))
    PATH.write_text(f'{{"torch": "{torch.__version__.split("+")[0]}",\n "counts": {{\n{rows}\n}}}}\n')
    print(f"wrote {len(counts)} counts to {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
