"""Benchmark 6: where a step's peak goes, three ways: the memory engine, the live tensors, the allocator.

    python benchmarks/peak_anatomy.py --device cuda            # the cases below, on this GPU
    python benchmarks/peak_anatomy.py --device cpu --quick     # 2 cases on the CPU, not written

For each case, one steady-state training step of the course GPT (built by
``course_lib.prediction.step_setup.build`` and run by ``course_lib.training.loop.train``, as
``step_setup.measure_step_memory`` runs it) is measured above its resident model states, three
ways:

* **engine**: ``course_lib.prediction.predict.predict(step).total`` less the resident
  bytes (``gpu="cuda"`` on a GPU, the CPU's kernels on the CPU);
* **tensors**: the peak of the step's own live tensors, counted by the course's live-tensor
  tracker, which also remembers the op that made each storage (storages rounded to the
  allocator's 512-byte blocks on CUDA); it lists the ops whose outputs are alive at that peak;
* **allocator**: ``torch.cuda.max_memory_allocated`` above the bytes allocated before the step
  (CUDA only; garbage collected first).

``engine - tensors`` is the engine's own error: what it predicts that is not there, or misses.
``allocator - tensors`` is memory that no dispatched op allocated: a library's workspace, a
kernel's own buffers, or tensors that the allocator frees later than Python lets go of them.
On the CPU the engine equals the tensors to the byte. The cases are those where a GPU run found
the engine off (the first GPU run, README): the estimator's CUDA shapes, the `gpu` test's
widest setting and lecture 04's depth sweep.

Results: benchmarks/results/peak_anatomy.json, one run per device kind.
"""

from __future__ import annotations

import collections
import gc

import torch
from bench_common import table
from bench_device import arguments, save, setup
from torch.utils._pytree import tree_leaves

from course_lib.measurement.memory import LiveTensorTracker, resident_bytes
from course_lib.model.gpt import GPTConfig, random_tokens
from course_lib.prediction import step_setup
from course_lib.prediction.predict import Step, predict
from course_lib.training.loop import train
from course_lib.units import format_bytes

#: ``(name, config fields, batch, precision, mode)``; the CUDA shapes, and the CPU's (--quick: 2).
CASES = {
    "cuda": [
        ("estimator, explicit bf16 blocks", dict(vocab_size=8192, seq_len=256, d_model=512,
                                                 n_heads=8, n_layers=4, attention="explicit"),
         4, "bf16", "blocks"),
        ("estimator, explicit fp32 none", dict(vocab_size=8192, seq_len=256, d_model=512,
                                               n_heads=8, n_layers=4, attention="explicit"),
         4, "fp32", "none"),
        ("estimator, sdpa bf16 blocks", dict(vocab_size=8192, seq_len=256, d_model=512, n_heads=8,
                                             n_layers=4), 4, "bf16", "blocks"),
        ("gpu test, explicit autocast blocks", dict(vocab_size=8192, seq_len=1024, d_model=768,
                                                    n_heads=12, n_layers=6, attention="explicit"),
         4, "autocast-bf16", "blocks"),
        ("lecture 04 sweep, none", dict(vocab_size=128, seq_len=1024, d_model=128, n_heads=2,
                                        n_layers=4), 8, "autocast-bf16", "none"),
        ("lecture 04 sweep, blocks", dict(vocab_size=128, seq_len=1024, d_model=128, n_heads=2,
                                          n_layers=4), 8, "autocast-bf16", "blocks"),
    ],
    "cpu": [
        ("explicit, dropout, blocks", dict(vocab_size=64, seq_len=32, d_model=32, n_heads=4,
                                           n_layers=2, attention="explicit", dropout=0.1),
         2, "fp32", "blocks"),
        ("sdpa, bf16, none", dict(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=2),
         2, "bf16", "none"),
        ("sdpa, autocast, selective", dict(vocab_size=64, seq_len=32, d_model=32, n_heads=4,
                                           n_layers=2), 2, "autocast-bf16", "selective"),
    ],
}


class OpTracker(LiveTensorTracker):
    """The course's live-tensor tracker, remembering which op made each storage it counts."""

    def __init__(self):
        super().__init__()
        self.ops: dict[int, str] = {}  # storage record's index -> the op that made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for item in tree_leaves(out):
            record = self.record_of(item) if isinstance(item, torch.Tensor) else None
            if record is not None:
                self.ops.setdefault(record.index, func.overloadpacket.__name__)
        return out

    def peak_holders(self, block: int = 1, most: int = 6) -> tuple[int, list[tuple[str, int]]]:
        """The peak with each storage rounded up to ``block`` bytes (512: the CUDA allocator's),
        and the ops whose outputs are alive at it, by bytes, largest first."""
        events = sorted([(r.born, r) for r in self.storages]
                        + [(r.died, r) for r in self.storages if r.died is not None],
                        key=lambda event: event[0])
        live, total, peak, at_peak = set(), 0, 0, set()
        for clock, record in events:
            size = -(-record.nbytes // block) * block
            if clock == record.born:
                live.add(record.index)
                total += size
            else:
                live.discard(record.index)
                total -= size
            if total > peak:
                peak, at_peak = total, set(live)
        by_op = collections.Counter()
        for record in self.storages:
            if record.index in at_peak:
                by_op[self.ops.get(record.index, "?")] += -(-record.nbytes // block) * block
        return peak, by_op.most_common(most)


def anatomy(name: str, fields: dict, batch: int, precision: str, mode: str, device: str) -> dict:
    config = GPTConfig(**fields)
    gpu = "cuda" if device == "cuda" else None
    predicted = predict(Step(config, batch, precision=precision, mode=mode, gpu=gpu)).peak
    model, optimizer = step_setup.build(config, precision=precision, mode=mode, device=device)
    options = step_setup.train_options(precision, device)
    x, y = random_tokens(config, batch, device=device)

    def step():
        train(model, optimizer, [(x, y)], micro_batch_size=batch, **options)

    step()  # AdamW's state exists: the next step is a steady-state one
    resident = resident_bytes(model, optimizer)
    allocator = None
    if device == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        allocator = torch.cuda.max_memory_allocated() - before
    tracker = OpTracker()
    with tracker:
        step()
    tensors, held = tracker.peak_holders(512 if device == "cuda" else 1)
    model = optimizer = None  # noqa: F841 (let them go before the next case)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"case": name, "precision": precision, "mode": mode, "batch": batch, **fields,
            "engine": predicted.total - resident, "engine_moment": predicted.moment,
            "tensors": tensors, "allocator": allocator, "resident": resident,
            "held_at_peak": held}


def main(argv=None) -> int:
    args = arguments(__doc__, argv)
    info = setup(args.device)
    cases = CASES[args.device][:2 if args.quick else None]
    rows = [anatomy(*case, args.device) for case in cases]
    lines = []
    for r in rows:
        alloc = r["allocator"]
        lines.append([r["case"], f"{r['engine']:,}", f"{r['tensors']:,}",
                      "-" if alloc is None else f"{alloc:,}",
                      f"{r['engine'] - r['tensors']:+,}",
                      "-" if alloc is None else f"{alloc - r['tensors']:+,}",
                      ", ".join(f"{op} {format_bytes(nbytes)}" for op, nbytes in r["held_at_peak"][:3])])
    print(table(lines, ["case", "engine", "tensors", "allocator", "engine - tensors",
                        "allocator - tensors", "held at the peak"]))
    path = save("peak_anatomy", args.device, {"machine": info, "quick": args.quick, "rows": rows},
                args.out, args.quick)
    print(f"\nwritten: {path}" if path else "\nquick run: nothing written (pass --out to write)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
