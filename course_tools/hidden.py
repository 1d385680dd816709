"""Cases the grader adds to the checks, drawn when it grades, and the checks' truths (not part
of ``course_lib``).

The checks in ``course_lib.grading`` try public cases: the learner sees them, and each message
names the expected answer, so a table of their answers would pass them. When the grader runs a
check that passed, it tries the learner's function on cases of :data:`CASES` too, drawn from a
seed that the check process takes from the operating system after the learner's process has
started (the learner's process holds no copy of it), with the truths computed here, in the
check's process. The truth formulas and measured tables live only here, not in the installed
package: lecture 01's bytes per parameter and ZeRO formulas, lecture 00's dtype rule, lecture
02's and 04's measured steps, lecture 05's every-k peak and Pareto front, lecture 06's step
phases and micro-batch search, lecture 07's plan and shard sizes, lecture 08's quantized state
bytes and fit ladder. The checks' public cases carry their answers written out;
``tests/test_grading_truths.py`` checks them against the truths here.

Each entry is ``CASES[check name](fn, rng)``: it calls ``fn`` (the learner's function, through
the grader's boundary) on a few drawn cases and raises ``course_lib.grading.CheckFailed``
(through :func:`course_lib.grading.expect`) at the first wrong answer, its message ending with
:data:`DRAWN`. ``pick_training_dtype`` and ``bytes_per_param`` have inputs of a few values
only: their public cases leave some out (a Mac's GPU without bf16, the CPU with bf16; five of
the sixteen recipes), and their drawn cases always hold those. Checks that build their own
models and data (lecture 03's gradients, 04's ``checkpoint_blocks``, 05's policies, 07's
``average_gradients``, 08's ``fuse_optimizer`` and ``chunked_loss``, 06's ``train_or_report``)
have no entry.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable

import torch

from course_lib.grading import exactly, expect

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


# --- the truths -------------------------------------------------------------------------------


def bytes_per_param(optimizer: str, precision: str) -> int:
    """Lecture 01: bytes of model states per parameter, from :data:`TABLE`."""
    return TABLE[precision][OPTIMIZERS.index(optimizer)]


def training_dtype(device_type: str, has_native_bf16: bool) -> torch.dtype:
    """Lecture 00 (and ``course_lib.device.pick_dtype``): fp32 on the CPU; on a GPU (CUDA or a
    Mac's MPS) bf16 where it runs natively, else fp16."""
    if device_type == "cpu":
        return torch.float32
    return torch.bfloat16 if has_native_bf16 else torch.float16


def fewest_gpus(P: int, capacity: int, stage: int) -> int | None:
    """Smallest N with a*P + b*P/N <= capacity (exact integers); None if no N is enough."""
    a, b = ZERO[stage]
    if b == 0:
        return 1 if a * P <= capacity else None
    if a * P >= capacity:
        return None
    return max(1, -(-b * P // (capacity - a * P)))


#: Lecture 02, measured (torch 2.13, CPU, ``course_lib.measurement.memory.LiveTensorTracker``):
#: the bytes live at the peak of one steady-state training step of ``GPT(lecture02.SMALL)`` (the
#: parameters and AdamW's ``m``, ``v`` and step counters held before it, plus the step's own
#: peak: forward, backward, ``AdamW(foreach=False).step()``), by ``(precision, seq_len)``, for
#: micro-batches 1, 2, 3, ... "fp32": an fp32 model; "bf16": a bf16 model and AdamW state.
SMALL_STEP_BYTES = {
    ("fp32", 24): (506484, 622008, 755448, 888888, 1022328, 1155768, 1289208, 1422648,
                   1556088, 1689528, 1822968, 1956408, 2089848),
    ("bf16", 32): (285432, 393080, 500728, 608376, 716024, 823672, 931320),
}


def measured_largest_batch(precision: str, seq_len: int, capacity: int) -> int:
    """Lecture 02: the most sequences whose measured step (:data:`SMALL_STEP_BYTES`) fits."""
    return max((b for b, nbytes in enumerate(SMALL_STEP_BYTES[(precision, seq_len)], start=1)
                if nbytes <= capacity), default=0)


#: Lecture 04, measured (torch 2.13, CPU) for ``GPT(lecture04.SEGMENTS_CONFIG)`` on
#: ``lecture04.SEGMENTS_BATCH`` sequences with its blocks in ``k`` segments
#: (``torch.utils.checkpoint.checkpoint_sequential``, the last segment not checkpointed),
#: ``k = 1 .. 16``: ``(peak bytes, FLOPs)``. Peak bytes: a steady-state AdamW step's, what was
#: held before it (parameters, ``m``, ``v``, step counters) plus its own peak
#: (``course_lib.measurement.memory.LiveTensorTracker``); FLOPs: forward, backward and
#: recomputation, as ``torch.utils.flop_counter.FlopCounterMode`` counts them.
SEGMENT_COSTS = {
    1: (11228952, 305135616), 2: (7316632, 353370112), 3: (5990168, 363855872),
    4: (5398168, 374341632), 5: (4994840, 372244480), 6: (6088472, 357564416),
    7: (5060376, 368050176), 8: (4438936, 378535936), 9: (7247640, 338690048),
    10: (6749976, 342884352), 11: (6252312, 347078656), 12: (5754648, 351272960),
    13: (5256984, 355467264), 14: (4759320, 359661568), 15: (4261656, 363855872),
    16: (3959320, 368050176),
}


def cheapest_segments(budget: int) -> int | None:
    """Lecture 04: of the segment counts whose measured peak fits, the fewest FLOPs."""
    fits = [k for k, (nbytes, _) in SEGMENT_COSTS.items() if nbytes <= budget]
    return min(fits, key=lambda k: (SEGMENT_COSTS[k][1], k)) if fits else None


def every_peak(n_layers: int, every: int, block: int, inp: int, fixed: int) -> int:
    """Lecture 05 (Chen et al. 2016): blocks 0, every, 2*every, ... keep their input, the others
    all they save; backward rebuilds a checkpointed block once the blocks after it are freed,
    which adds to the peak only for the last block (``every`` divides ``n_layers - 1``)."""
    wrapped = len(range(0, n_layers, every))
    rebuilt = block - inp if (n_layers - 1) % every == 0 else 0
    return fixed + (n_layers - wrapped) * block + wrapped * inp + rebuilt


def largest_every(n_layers: int, block: int, inp: int, fixed: int, budget: int) -> int | None:
    """Lecture 05: the largest ``every`` whose peak fits, None if none does."""
    fitting = [k for k in range(1, n_layers + 1)
               if every_peak(n_layers, k, block, inp, fixed) <= budget]
    return max(fitting) if fitting else None


def front(points: list) -> list:
    """Lecture 05: the points no other point dominates, sorted by memory, then time."""
    return sorted((p for p in points if not any(
        q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)),
        key=lambda p: (p[0], p[1]))


def phases_peak(resident: int, act: int, grads: int, scratch: int, K: int) -> int:
    """Lecture 06: live bytes in every phase of the step (micro-batch k holds the gradient from
    the second one on; then optimizer.step()), the largest of them."""
    live = [resident + (grads if k > 0 else 0) + act for k in range(K)]
    return max(live + [resident + grads + scratch])


def best_micro_batch(peak_of, budget: int, effective: int) -> tuple[int, int] | None:
    """Lecture 06: the largest micro-batch that divides ``effective`` and fits, with its
    accumulation steps; None when not even 1 fits."""
    ok = [b for b in range(1, effective + 1) if effective % b == 0 and peak_of(b) <= budget]
    return (max(ok), effective // max(ok)) if ok else None


def ddp_plan(N: int, micro: int, K: int, buckets: int, no_sync: bool) -> tuple[int, int]:
    """Lecture 07: (world x micro x accumulation, all-reduces per optimizer step per rank)."""
    return N * micro * K, buckets * (1 if no_sync else K)


def fsdp_numels(shape: tuple, N: int) -> list[int]:
    """Lecture 07: FSDP2 cuts dim 0 as ``torch.chunk``: ceil(rows / N) whole rows in turn."""
    rows, row = shape[0], math.prod(shape[1:])
    step = -(-rows // N)
    return [max(0, min(step, rows - r * step)) * row for r in range(N)]


#: Lecture 08, torchao's block-wise quantized AdamW states: elements per fp32 scale and the
#: number of fp32 entries of each state's quantization map.
LOW_BIT = {8: (256, 256), 4: (128, 16)}


def quantized_bytes(numel: int, bits: int) -> int:
    """Lecture 08: bytes of AdamW's m and v for one fp32 tensor of ``numel`` elements."""
    block, qmap = LOW_BIT[bits]
    if numel >= 4096 and numel % block == 0:
        return 2 * (numel * bits // 8 + 4 * (numel // block) + 4 * qmap)
    return 2 * 4 * numel


def ladder_order(levers: list) -> list[str]:
    """Lecture 08: free levers (most time gained, then most bytes), then bytes saved per time
    paid, largest first, then those that save nothing, in the order given."""
    free = [lv for lv in levers if lv[1] > 0 and lv[2] <= 0]
    paid = [lv for lv in levers if lv[1] > 0 and lv[2] > 0]
    nothing = [lv for lv in levers if lv[1] <= 0]
    free.sort(key=lambda lv: (lv[2], -lv[1]))
    paid.sort(key=lambda lv: -lv[1] / lv[2])
    return [name for name, _, _ in free + paid + nothing]


# --- the drawn cases --------------------------------------------------------------------------


#: ``(device_type, has_native_bf16)`` that the public check of ``pick_training_dtype`` leaves
#: out, and ``(optimizer, precision)`` that the public check of ``bytes_per_param`` leaves out:
#: every drawn set holds them, so that a table of the public answers fails.
DTYPE_HELD_BACK = (("cpu", True), ("mps", False))
BYTES_HELD_BACK = (("sgd-momentum", "bf16-mixed"), ("adamw", "bf16-mixed"),
                   ("sgd", "fp16-mixed"), ("adam", "fp16-mixed"), ("adamw", "bf16"))


def _pick_training_dtype(fn, rng: random.Random) -> None:
    domain = [(d, b) for d in ("cpu", "cuda", "mps") for b in (False, True)]
    drawn = list(DTYPE_HELD_BACK) + rng.sample(domain, 2)
    rng.shuffle(drawn)
    for device_type, bf16 in drawn:
        truth = training_dtype(device_type, bf16)
        got = fn(device_type, bf16)
        expect(exactly(got, truth), f"pick_training_dtype({device_type!r}, has_native_bf16={bf16}) "
               f"returned {got!r}, expected {truth} {DRAWN}",
               hint="fp32 on the CPU whatever it supports; on a GPU, CUDA or a Mac's MPS, bf16 "
                    "where it runs natively, else fp16")


def _bytes_per_param(fn, rng: random.Random) -> None:
    domain = [(o, p) for p in TABLE for o in OPTIMIZERS]
    drawn = list(BYTES_HELD_BACK) + rng.sample(domain, 3)
    rng.shuffle(drawn)
    for optimizer, precision in drawn:
        truth = bytes_per_param(optimizer, precision)
        got = fn(optimizer, precision)
        expect(_is_int(got) and exactly(got, truth),
               f"bytes_per_param({optimizer!r}, {precision!r}) "
               f"returned {got!r}, expected {truth} {DRAWN}",
               hint="weights + gradients + master copy (mixed recipes) + optimizer state, "
                    "each in its dtype")


def _tensor_nbytes(fn, rng: random.Random) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
              torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
    for _ in range(4):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        dtype = rng.choice(dtypes)
        truth = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        got = fn(shape, dtype)
        expect(exactly(got, truth), f"tensor_nbytes({shape}, {dtype}) returned {got!r}, expected "
               f"{truth} {DRAWN}", hint="elements = product of the shape, times the bytes per "
               "element of the dtype")


def _zero_bytes_per_device(fn, rng: random.Random) -> None:
    for _ in range(4):
        stage, N = rng.randint(0, 3), rng.randint(1, 512)
        P = N * rng.randint(10**4, 10**9)  # whole shards: no rounding to argue about
        a, b = ZERO[stage]
        truth = a * P + b * P // N
        got = fn(P, stage, N)
        expect(_is_int(got) and exactly(got, truth),
               f"zero_bytes_per_device({P}, zero_stage={stage}, "
               f"world_size={N}) returned {got!r}, expected {truth} {DRAWN}",
               hint="per device: stage 0 16P, stage 1 4P + 12P/N, stage 2 2P + 14P/N, stage 3 "
                    "16P/N, rounded down")


def _largest_model(fn, rng: random.Random) -> None:
    for _ in range(4):
        capacity = rng.randint(10**9, 2 * 10**11)
        optimizer, precision = rng.choice(OPTIMIZERS), rng.choice(list(TABLE))
        truth = capacity // bytes_per_param(optimizer, precision)
        got = fn(capacity, optimizer, precision)
        expect(_is_int(got) and exactly(got, truth), f"largest_model({capacity}, {optimizer!r}, "
               f"{precision!r}) returned {got!r}, expected {truth} {DRAWN}",
               hint="capacity // bytes per parameter")


def _gpus_needed(fn, rng: random.Random) -> None:
    for _ in range(4):
        P, capacity, stage = rng.randint(10**8, 10**11), rng.randint(10**9, 10**11), \
            rng.randint(0, 3)
        truth = fewest_gpus(P, capacity, stage)
        got = fn(P, capacity, stage)
        expect(_is_int(got) and exactly(got, truth) if truth is not None else got is None,
               f"gpus_needed({P:,}, {capacity:,}, zero_stage={stage}) returned {got!r}, "
               f"expected {truth!r} {DRAWN}",
               hint="the smallest N with a*P + b*P/N <= capacity, or None")


def _choose_every(fn, rng: random.Random) -> None:
    for _ in range(6):
        n, block = rng.randint(1, 30), rng.randint(20, 600)
        inp, fixed = rng.randint(1, block // 2), rng.randint(0, 2000)
        budget = rng.randint(fixed, fixed + n * block + block)
        truth = largest_every(n, block, inp, fixed, budget)
        got = fn(n, block, inp, fixed, budget)
        expect(exactly(got, truth),
               f"choose_every(n_layers={n}, block_bytes={block}, input_bytes={inp}, "
               f"fixed_bytes={fixed}, budget_bytes={budget}) returned {got!r}, expected "
               f"{truth!r} {DRAWN}", hint="the largest k whose peak fits, None if none")


def _pareto_front(fn, rng: random.Random) -> None:
    for _ in range(4):
        pairs = {(rng.randint(1, 20), rng.randint(1, 20) / 4) for _ in range(rng.randint(2, 12))}
        points = [(m, t, f"q{i}") for i, (m, t) in enumerate(sorted(pairs, key=str))]
        truth = front(points)
        got = fn(list(points))
        expect(isinstance(got, list) and exactly(got, truth),
               f"pareto_front({points}) returned {got!r}, expected {truth} {DRAWN}",
               hint="keep the points no other point dominates, sorted by memory")


def _step_peak(fn, rng: random.Random) -> None:
    for _ in range(4):
        resident, act, grads, scratch, K = (rng.randint(1, 5000), rng.randint(1, 3000),
                                            rng.randint(1, 3000), rng.randint(0, 3000),
                                            rng.randint(1, 9))
        truth = phases_peak(resident, act, grads, scratch, K)
        got = fn(resident, act, grads, scratch, K)
        expect(exactly(got, truth),
               f"step_peak({resident}, {act}, {grads}, {scratch}, {K}) returned "
               f"{got!r}, expected {truth} {DRAWN}", hint="the largest phase of the step")


def _largest_micro_batch(fn, rng: random.Random) -> None:
    for _ in range(3):
        base, per = rng.randint(10, 2000), rng.randint(1, 400)
        effective = rng.choice([6, 8, 12, 16, 18, 24, 32])

        def peak_of(b, base=base, per=per):
            return base + per * b + b * b

        fitting = [b for b in range(1, effective + 1) if effective % b == 0]
        budget = peak_of(rng.choice(fitting)) + rng.randint(0, per)
        truth = best_micro_batch(peak_of, budget, effective)
        got = fn(peak_of, budget, effective)
        expect(isinstance(got, tuple) and exactly(got, truth), f"largest_micro_batch(peak_of, "
               f"{budget}, {effective}) returned {got!r}, expected {truth} {DRAWN}",
               hint="the largest micro-batch that divides the effective batch and fits")


def _ddp_accumulation_plan(fn, rng: random.Random) -> None:
    for _ in range(4):
        N, micro, K, buckets = (rng.randint(1, 64), rng.randint(1, 32), rng.randint(1, 32),
                                rng.randint(1, 40))
        no_sync = rng.random() < 0.5
        truth = ddp_plan(N, micro, K, buckets, no_sync)
        got = fn(N, micro, K, buckets, no_sync)
        expect(isinstance(got, tuple | list) and exactly(got, truth),
               f"ddp_accumulation_plan({N}, {micro}, {K}, {buckets}, use_no_sync={no_sync}) "
               f"returned {got!r}, expected {truth} {DRAWN}",
               hint="(world x micro x accumulation, buckets x synchronising backwards)")


def _fsdp_local_numel(fn, rng: random.Random) -> None:
    for _ in range(4):
        shape = tuple(rng.randint(1, 300) for _ in range(rng.randint(1, 3)))
        N = rng.randint(1, 16)
        truth = fsdp_numels(shape, N)
        got = fn(shape, N)
        expect(isinstance(got, list | tuple) and exactly(got, truth),
               f"fsdp_local_numel({shape}, {N}) returned {got!r}, expected {truth} {DRAWN}",
               hint="ceil(rows / world_size) whole rows per rank, in turn")


def _quantized_state_bytes(fn, rng: random.Random) -> None:
    for _ in range(4):
        bits = rng.choice([8, 4])
        numel = rng.choice([rng.randint(1, 8000), LOW_BIT[bits][0] * rng.randint(1, 5000)])
        truth = quantized_bytes(numel, bits)
        got = fn(numel, bits)
        expect(exactly(got, truth), f"quantized_state_bytes({numel}, {bits}) = {got!r}, expected "
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
        ratios = [lv[1] / lv[2] for lv in levers if lv[1] > 0 and lv[2] > 0]
        if len(set(ratios)) != len(ratios) or len({(lv[2], lv[1]) for lv in free}) != len(free):
            continue  # a tie: more than one order is right
        truth = ladder_order(levers)
        got = fn([tuple(lv) for lv in levers])
        expect(isinstance(got, list | tuple) and exactly(got, truth),
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
        expect(exactly(got, truth),
               f"mlp_saved_bytes({b}, {seq}, {h}, {dtype}, dropout={p}) returned "
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
        expect(exactly(got, truth), f"for a Sequential of widths {widths} with {acts} on {batch} "
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
               and {str.__str__(n) for n in got} == truth,
               f"for a Sequential of {[k for _, k in layers]} you "
               f"returned {got!r}, expected {sorted(truth)} {DRAWN}",
               hint="test every leaf module by measurement")


def _largest_batch(fn, rng: random.Random) -> None:
    from course_lib.grading.lecture02 import SMALL
    from course_lib.prediction.predict import Step, predict

    for _ in range(2):
        gpu = rng.choice(["T4", "A100 40GB", "A100 80GB", "H100 80GB"])
        precision, seq = rng.choice(["fp32", "bf16-mixed", "fp16-mixed"]), rng.choice([16, 32])
        if gpu == "T4" and precision == "bf16-mixed":
            precision = "fp16-mixed"

        def need(b, seq=seq, precision=precision, gpu=gpu):
            return predict(Step(SMALL, b, seq_len=seq, precision=precision, gpu=gpu)).total

        capacity = need(rng.randint(1, 40)) + rng.randint(0, 50_000)
        truth = 0
        while need(truth + 1) <= capacity:
            truth += 1
        got = fn(SMALL, seq, capacity, precision, gpu)
        expect(exactly(got, truth), f"largest_batch(d_model={SMALL.d_model}, n_layers="
               f"{SMALL.n_layers}, seq_len={seq}, capacity={capacity:,}, {precision!r}, "
               f"gpu={gpu!r}) returned {got!r}, expected {truth} {DRAWN}",
               hint="the last batch whose predicted total fits the capacity")


def _choose_segments(fn, rng: random.Random) -> None:
    from course_lib.grading.lecture04 import SEGMENTS_BATCH, SEGMENTS_CONFIG

    peaks = sorted({nbytes for nbytes, _ in SEGMENT_COSTS.values()})
    for _ in range(2):
        budget = rng.randint(peaks[0] - 1000, peaks[-1] + 1000)
        truth = cheapest_segments(budget)
        got = fn(SEGMENTS_CONFIG, SEGMENTS_BATCH, budget)
        expect(exactly(got, truth), f"choose_segments(config, {SEGMENTS_BATCH}, budget={budget:,}) "
               f"returned {got!r}, expected {truth!r} {DRAWN}",
               hint="the fewest FLOPs among the segment counts that fit")


#: The drawn cases of each check, by the check's name (without ``check_``).
CASES: dict[str, Callable[..., None]] = {
    "pick_training_dtype": _pick_training_dtype, "bytes_per_param": _bytes_per_param,
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
