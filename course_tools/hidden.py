"""Cases the grader adds to the checks, drawn when it grades (not part of ``course_lib``).

The checks in ``course_lib.grading`` try public cases: the learner sees them, and each message
names the expected answer, so a table of their answers would pass them. When the grader runs a
check that passed, it tries the learner's function on cases of :data:`CASES` too, drawn from a
seed that the check process takes from the operating system after the learner's process has
started (the learner's process holds no copy of it), with the truths computed here, in the
check's process. The truth formulas of lecture 01 live only here, not in the installed package.

Each entry is ``CASES[check name](fn, rng)``: it calls ``fn`` (the learner's function, through
the grader's boundary) on a few drawn cases and raises ``course_lib.grading.CheckFailed``
(through :func:`course_lib.grading.expect`) at the first wrong answer, its message ending with
:data:`DRAWN`. Checks whose inputs are all public (``pick_training_dtype``,
``bytes_per_param``) or that build their own models and data (lectures 02-04, 07's
``average_gradients``, 08's ``fuse_optimizer`` and ``chunked_loss``, 06's ``train_or_report``)
have no entry.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable

import torch

from course_lib.grading import expect

#: The end of every message about a drawn case.
DRAWN = "(a case drawn by the grader)"

#: Bytes per parameter of model states (the ZeRO paper's accounting, lecture 01):
#: precision -> (sgd, sgd-momentum, adam, adamw).
TABLE = {"fp32": (8, 12, 16, 16), "fp16-mixed": (8, 12, 16, 16), "bf16-mixed": (8, 12, 16, 16),
         "bf16": (4, 6, 8, 8)}
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
#: ZeRO with mixed-precision Adam (K = 12): per-device bytes per parameter = a + b / N.
ZERO = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def fewest_gpus(P: int, capacity: int, stage: int) -> int | None:
    """Smallest N with a*P + b*P/N <= capacity (exact integers); None if no N is enough."""
    a, b = ZERO[stage]
    if b == 0:
        return 1 if a * P <= capacity else None
    if a * P >= capacity:
        return None
    return max(1, -(-b * P // (capacity - a * P)))


def _tensor_nbytes(fn, rng: random.Random) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
              torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
    for _ in range(4):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        dtype = rng.choice(dtypes)
        truth = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        got = fn(shape, dtype)
        expect(got == truth, f"tensor_nbytes({shape}, {dtype}) returned {got!r}, expected "
               f"{truth} {DRAWN}", hint="elements = product of the shape, times the bytes per "
               "element of the dtype")


def _zero_bytes_per_device(fn, rng: random.Random) -> None:
    for _ in range(4):
        stage, N = rng.randint(0, 3), rng.randint(1, 512)
        P = N * rng.randint(10**4, 10**9)  # whole shards: no rounding to argue about
        a, b = ZERO[stage]
        truth = a * P + b * P // N
        got = fn(P, stage, N)
        expect(_is_int(got) and got == truth, f"zero_bytes_per_device({P}, zero_stage={stage}, "
               f"world_size={N}) returned {got!r}, expected {truth} {DRAWN}",
               hint="per device: stage 0 16P, stage 1 4P + 12P/N, stage 2 2P + 14P/N, stage 3 "
                    "16P/N, rounded down")


def _largest_model(fn, rng: random.Random) -> None:
    for _ in range(4):
        capacity = rng.randint(10**9, 2 * 10**11)
        optimizer, precision = rng.choice(OPTIMIZERS), rng.choice(list(TABLE))
        per = TABLE[precision][OPTIMIZERS.index(optimizer)]
        truth = capacity // per
        got = fn(capacity, optimizer, precision)
        expect(_is_int(got) and got == truth, f"largest_model({capacity}, {optimizer!r}, "
               f"{precision!r}) returned {got!r}, expected {truth} {DRAWN}",
               hint="capacity // bytes per parameter")


def _gpus_needed(fn, rng: random.Random) -> None:
    for _ in range(4):
        P, capacity, stage = rng.randint(10**8, 10**11), rng.randint(10**9, 10**11), \
            rng.randint(0, 3)
        truth = fewest_gpus(P, capacity, stage)
        got = fn(P, capacity, stage)
        expect((got is None) if truth is None else (_is_int(got) and got == truth),
               f"gpus_needed({P:,}, {capacity:,}, zero_stage={stage}) returned {got!r}, "
               f"expected {truth!r} {DRAWN}",
               hint="the smallest N with a*P + b*P/N <= capacity, or None")


def _choose_every(fn, rng: random.Random) -> None:
    def peak(n, every, block, inp, fixed):
        wrapped = len(range(0, n, every))
        return fixed + (n - wrapped) * block + wrapped * inp + (block - inp)

    for _ in range(6):
        n, block = rng.randint(1, 30), rng.randint(20, 600)
        inp, fixed = rng.randint(1, block // 2), rng.randint(0, 2000)
        budget = rng.randint(fixed, fixed + n * block + block)
        fitting = [k for k in range(1, n + 1) if peak(n, k, block, inp, fixed) <= budget]
        truth = max(fitting) if fitting else None
        got = fn(n, block, inp, fixed, budget)
        expect(got == truth,
               f"choose_every(n_layers={n}, block_bytes={block}, input_bytes={inp}, "
               f"fixed_bytes={fixed}, budget_bytes={budget}) returned {got!r}, expected "
               f"{truth!r} {DRAWN}", hint="the largest k whose peak fits, None if none")


def _pareto_front(fn, rng: random.Random) -> None:
    for _ in range(4):
        pairs = {(rng.randint(1, 20), rng.randint(1, 20) / 4) for _ in range(rng.randint(2, 12))}
        points = [(m, t, f"q{i}") for i, (m, t) in enumerate(sorted(pairs, key=str))]
        truth = sorted((p for p in points if not any(
            q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)),
            key=lambda p: (p[0], p[1]))
        got = fn(list(points))
        expect(isinstance(got, list) and [tuple(p) if isinstance(p, list | tuple) else p
                                          for p in got] == truth,
               f"pareto_front({points}) returned {got!r}, expected {truth} {DRAWN}",
               hint="keep the points no other point dominates, sorted by memory")


def _step_peak(fn, rng: random.Random) -> None:
    for _ in range(4):
        resident, act, grads, scratch, K = (rng.randint(1, 5000), rng.randint(1, 3000),
                                            rng.randint(1, 3000), rng.randint(0, 3000),
                                            rng.randint(1, 9))
        live = [resident + (grads if k > 0 else 0) + act for k in range(K)]
        truth = max(live + [resident + grads + scratch])
        got = fn(resident, act, grads, scratch, K)
        expect(got == truth, f"step_peak({resident}, {act}, {grads}, {scratch}, {K}) returned "
               f"{got!r}, expected {truth} {DRAWN}", hint="the largest phase of the step")


def _largest_micro_batch(fn, rng: random.Random) -> None:
    for _ in range(3):
        base, per = rng.randint(10, 2000), rng.randint(1, 400)
        effective = rng.choice([6, 8, 12, 16, 18, 24, 32])

        def peak_of(b, base=base, per=per):
            return base + per * b + b * b

        fitting = [b for b in range(1, effective + 1) if effective % b == 0]
        budget = peak_of(rng.choice(fitting)) + rng.randint(0, per)
        ok = [b for b in fitting if peak_of(b) <= budget]
        truth = (max(ok), effective // max(ok))
        got = fn(peak_of, budget, effective)
        expect(isinstance(got, tuple) and got == truth, f"largest_micro_batch(peak_of, "
               f"{budget}, {effective}) returned {got!r}, expected {truth} {DRAWN}",
               hint="the largest micro-batch that divides the effective batch and fits")


def _ddp_accumulation_plan(fn, rng: random.Random) -> None:
    for _ in range(4):
        N, micro, K, buckets = (rng.randint(1, 64), rng.randint(1, 32), rng.randint(1, 32),
                                rng.randint(1, 40))
        no_sync = rng.random() < 0.5
        truth = (N * micro * K, buckets * (1 if no_sync else K))
        got = fn(N, micro, K, buckets, no_sync)
        expect(isinstance(got, tuple | list) and tuple(got) == truth,
               f"ddp_accumulation_plan({N}, {micro}, {K}, {buckets}, use_no_sync={no_sync}) "
               f"returned {got!r}, expected {truth} {DRAWN}",
               hint="(world x micro x accumulation, buckets x synchronising backwards)")


def _fsdp_local_numel(fn, rng: random.Random) -> None:
    for _ in range(4):
        shape = tuple(rng.randint(1, 300) for _ in range(rng.randint(1, 3)))
        N = rng.randint(1, 16)
        rows, row = shape[0], math.prod(shape[1:])
        step = -(-rows // N)
        truth = [max(0, min(step, rows - r * step)) * row for r in range(N)]
        got = fn(shape, N)
        expect(isinstance(got, list | tuple) and list(got) == truth,
               f"fsdp_local_numel({shape}, {N}) returned {got!r}, expected {truth} {DRAWN}",
               hint="ceil(rows / world_size) whole rows per rank, in turn")


def _quantized_state_bytes(fn, rng: random.Random) -> None:
    low_bit = {8: (256, 256), 4: (128, 16)}
    for _ in range(4):
        bits = rng.choice([8, 4])
        block, qmap = low_bit[bits]
        numel = rng.choice([rng.randint(1, 8000), block * rng.randint(1, 5000)])
        if numel >= 4096 and numel % block == 0:
            truth = 2 * (numel * bits // 8 + 4 * (numel // block) + 4 * qmap)
        else:
            truth = 2 * 4 * numel
        got = fn(numel, bits)
        expect(got == truth, f"quantized_state_bytes({numel}, {bits}) = {got!r}, expected "
               f"{truth} {DRAWN}", hint="codes, one fp32 scale per block, one fp32 map per "
               "state; small tensors stay in fp32")


def _rank_levers(fn, rng: random.Random) -> None:
    for _ in range(3):
        levers, used = [], set()
        for i in range(rng.randint(3, 8)):
            saved = rng.choice([0, rng.randint(1, 5000), -rng.randint(1, 50)])
            paid = rng.choice([0.0, rng.randint(1, 400) / 1000, -rng.randint(1, 400) / 1000])
            key = (saved > 0 and paid <= 0, paid, saved, saved / paid if paid > 0 else 0)
            if key in used:
                continue
            used.add(key)
            levers.append((f"lever {i}", saved, paid))
        free = [lv for lv in levers if lv[1] > 0 and lv[2] <= 0]
        paid_ = [lv for lv in levers if lv[1] > 0 and lv[2] > 0]
        nothing = [lv for lv in levers if lv[1] <= 0]
        free.sort(key=lambda lv: (lv[2], -lv[1]))
        paid_.sort(key=lambda lv: -lv[1] / lv[2])
        ratios = [lv[1] / lv[2] for lv in paid_]
        if len(set(ratios)) != len(ratios) or len({(lv[2], lv[1]) for lv in free}) != len(free):
            continue  # a tie: more than one order is right
        truth = [name for name, _, _ in free + paid_ + nothing]
        got = fn([tuple(lv) for lv in levers])
        expect(isinstance(got, list | tuple) and list(got) == truth,
               f"for {levers} you gave {got!r}, expected {truth} {DRAWN}",
               hint="free levers, then bytes saved per time paid, then those that save nothing")


def _mlp_saved_bytes(fn, rng: random.Random) -> None:
    from course_lib.measurement.memory import saved_bytes
    from course_lib.model.gpt import MLP, GPTConfig

    for _ in range(2):
        b, seq, h = rng.randint(1, 4), rng.randint(1, 9), rng.choice([8, 16, 24, 32])
        dtype, p = rng.choice([torch.float32, torch.bfloat16]), rng.choice([0.0, 0.1, 0.3])
        torch.manual_seed(0)
        mlp = MLP(GPTConfig(d_model=h, n_heads=1, dropout=p)).to(dtype).train()
        truth = saved_bytes(mlp(torch.randn(b, seq, h, dtype=dtype, requires_grad=True)),
                            mlp.parameters())
        got = fn(b, seq, h, dtype, p)
        expect(got == truth, f"mlp_saved_bytes({b}, {seq}, {h}, {dtype}, dropout={p}) returned "
               f"{got!r}, measured {truth} {DRAWN}", hint="list what each op keeps")


def _distinct_saved_bytes(fn, rng: random.Random) -> None:
    from course_lib.grading import observe
    from course_lib.grading.lecture02 import _drawn_distinct_answer, _drawn_sequential
    from course_lib.units import storage_bytes, storage_key

    for _ in range(2):
        widths = [rng.randint(2, 24) for _ in range(rng.randint(2, 5))]
        acts = [rng.choice(["relu", "tanh", "gelu"]) for _ in widths[1:-1]]
        batch, seed = rng.randint(1, 6), rng.randint(0, 10**6)
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, seen=seen: seen.append(t) or t,
                                                      lambda t: t):
            _, params = _drawn_sequential(widths, acts, batch, seed)
        weights = {storage_key(p) for p in params}
        truth = storage_bytes(t for t in seen if storage_key(t) not in weights)
        got = observe(_drawn_distinct_answer, fn, widths, acts, batch, seed)
        expect(got == truth, f"for a Sequential of widths {widths} with {acts} on {batch} "
               f"samples you returned {got!r}, autograd keeps {truth} bytes {DRAWN}",
               hint="each distinct storage once, parameters left out")


def _batch_coupled_modules(fn, rng: random.Random) -> None:
    from course_lib.grading import observe
    from course_lib.grading.lecture03 import COUPLED_KINDS, _drawn_coupled_answer

    kinds = ["linear", "bn", "bn_eval", "ln", "relu", "drop", "center", "gn", "tanh"]
    for _ in range(2):
        layers = [(f"m{i}", rng.choice(kinds)) for i in range(rng.randint(3, 8))]
        truth = {name for name, kind in layers if kind in COUPLED_KINDS}
        got = observe(_drawn_coupled_answer, fn, layers, rng.randint(0, 10**6))
        expect(isinstance(got, list | set | tuple) and all(isinstance(n, str) for n in got)
               and set(got) == truth, f"for a Sequential of {[k for _, k in layers]} you "
               f"returned {got!r}, expected {sorted(truth)} {DRAWN}",
               hint="test every leaf module by measurement")


def _largest_batch(fn, rng: random.Random) -> None:
    from course_lib.grading.lecture02 import SMALL
    from course_lib.prediction.engine import predict_step_memory

    for _ in range(2):
        gpu = rng.choice(["T4", "A100 40GB", "A100 80GB", "H100 80GB"])
        precision, seq = rng.choice(["fp32", "bf16-mixed", "fp16-mixed"]), rng.choice([16, 32])
        if gpu == "T4" and precision == "bf16-mixed":
            precision = "fp16-mixed"

        def need(b, seq=seq, precision=precision, gpu=gpu):
            return predict_step_memory(SMALL, b, precision=precision, seq_len=seq, gpu=gpu).total

        capacity = need(rng.randint(1, 40)) + rng.randint(0, 50_000)
        truth = 0
        while need(truth + 1) <= capacity:
            truth += 1
        got = fn(SMALL, seq, capacity, precision, gpu)
        expect(got == truth, f"largest_batch(d_model={SMALL.d_model}, n_layers="
               f"{SMALL.n_layers}, seq_len={seq}, capacity={capacity:,}, {precision!r}, "
               f"gpu={gpu!r}) returned {got!r}, expected {truth} {DRAWN}",
               hint="the last batch whose predicted total fits the capacity")


def _choose_segments(fn, rng: random.Random) -> None:
    from course_lib.grading.lecture04 import SEGMENT_COSTS, SEGMENTS_BATCH, SEGMENTS_CONFIG

    peaks = sorted({nbytes for nbytes, _ in SEGMENT_COSTS.values()})
    for _ in range(2):
        budget = rng.randint(peaks[0] - 1000, peaks[-1] + 1000)
        fits = [k for k, (nbytes, _) in SEGMENT_COSTS.items() if nbytes <= budget]
        truth = min(fits, key=lambda k: (SEGMENT_COSTS[k][1], k)) if fits else None
        got = fn(SEGMENTS_CONFIG, SEGMENTS_BATCH, budget)
        expect(got == truth, f"choose_segments(config, {SEGMENTS_BATCH}, budget={budget:,}) "
               f"returned {got!r}, expected {truth!r} {DRAWN}",
               hint="the fewest FLOPs among the segment counts that fit")


#: The drawn cases of each check, by the check's name (without ``check_``).
CASES: dict[str, Callable[..., None]] = {
    "tensor_nbytes": _tensor_nbytes, "zero_bytes_per_device": _zero_bytes_per_device,
    "largest_model": _largest_model, "gpus_needed": _gpus_needed,
    "choose_every": _choose_every, "pareto_front": _pareto_front, "step_peak": _step_peak,
    "largest_micro_batch": _largest_micro_batch,
    "ddp_accumulation_plan": _ddp_accumulation_plan, "fsdp_local_numel": _fsdp_local_numel,
    "quantized_state_bytes": _quantized_state_bytes, "rank_levers": _rank_levers,
    "mlp_saved_bytes": _mlp_saved_bytes, "distinct_saved_bytes": _distinct_saved_bytes,
    "batch_coupled_modules": _batch_coupled_modules, "largest_batch": _largest_batch,
    "choose_segments": _choose_segments,
}
