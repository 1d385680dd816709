"""Benchmark 4: what each checkpointing mode costs in time and FLOPs, and saves in memory.

    python benchmarks/checkpoint_cost.py                 # CPU, fp32, 11 interleaved rounds
    python benchmarks/checkpoint_cost.py --quick         # 2 rounds, modes none and blocks only
    python benchmarks/checkpoint_cost.py --device cuda   # GPU-sized model in bf16 (fp16 on a T4)

For each attention kind of the course GPT (explicit, sdpa) one model is switched between the
policies of ``course_lib.training.checkpointing.enable_checkpointing``: none; ``blocks`` with every block,
every 2nd and every 3rd; ``sqrt`` (round(sqrt(n)) segments); ``selective`` (matmul outputs
kept); ``attention`` (the attention core recomputed, Korthikanti et al.'s "selective"). Per
policy, one forward + backward of a batch (the part checkpointing changes; the optimizer step is
the same in every mode and left out):

* **time**: wall-clock seconds (``torch.cuda.synchronize`` around each step on CUDA), after two
  warm-up steps per policy (the first ``checkpoint`` call in a process imports ``torch._dynamo``).
  The policies are timed in turn, in a rotated order, for ``rounds`` rounds; the **time ratio**
  is the median over rounds of (the policy's time / the plain model's time in the same round),
  so that a change in the machine's load hits both sides of each ratio; the printout gives its
  interquartile range over the rounds too. On the CPU the same is done with the process's CPU
  time (``time.process_time``), which does not count waiting for a core: on a machine shared
  with other work it is the steadier of the two clocks.
* **FLOPs**: ``torch.utils.flop_counter.FlopCounterMode`` over one step (2 per multiply-add,
  matmuls and attention kernels), recomputation included; checked against
  ``course_lib.prediction.checkpointed.step_flops``. ``FlopCounterMode`` has no formula for the CPU's
  flash-attention kernel (it counts 0), so for ``sdpa`` on the CPU the **FLOP ratio** comes
  from ``step_flops(..., gpu="A100 80GB")`` (a GPU preset of ``course_lib.device.GPUS``), which
  counts the fused kernel as a GPU does (forward
  ``4*b*s^2*h``, backward 2.5 times that); elsewhere it is the counted ratio. Theory for
  recomputing every block: one more forward pass, 4/3, a little less in fact: the LM head is
  not recomputed and, without dropout, neither is each block's last matmul (``step_flops``).
* **memory**: activations kept from forward to backward (``checkpointing.measure_kept_bytes``,
  exact tensor bytes on every device) and the peak of the forward + backward above what was live
  before it (parameters and their existing ``.grad``; ``course_lib.measurement.memory.peak_memory``: the
  live-tensor tracker on the CPU, the CUDA allocator on a GPU); **saved** is ``1 - policy / none``.

CPU: vocabulary 256, d_model 128, 4 heads, 8 layers, sequence 128, batch 4, fp32, no dropout,
one torch thread. CUDA: vocabulary 8192, d_model 1024, 16 heads, 12 layers, sequence 1024,
batch 8, in the dtype ``course_lib.device.pick_dtype`` chooses (bf16; fp16 on a T4, which has no
bf16 fused attention kernel). Results: benchmarks/results/checkpoint_cost.json, ``runs[device]``.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

import torch
from bench_common import table
from bench_device import arguments, save, setup
from torch.utils.flop_counter import FlopCounterMode

from course_lib.device import pick_dtype
from course_lib.measurement import timing
from course_lib.measurement.memory import peak_memory
from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.prediction import checkpointed
from course_lib.training import checkpointing as ckpt
from course_lib.units import MiB

#: ``(mode, every)`` per policy, the plain model first.
POLICIES = (("none", 1), ("blocks", 1), ("blocks", 2), ("blocks", 3), ("sqrt", 1),
            ("selective", 1), ("attention", 1))
ATTENTIONS = ("explicit", "sdpa")
SETUP = {"cpu": dict(model=dict(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=8),
                     batch=4, dtype=torch.float32, rounds=11),
         "cuda": dict(model=dict(vocab_size=8192, seq_len=1024, d_model=1024, n_heads=16,
                                 n_layers=12),
                      batch=8, dtype=torch.bfloat16, rounds=20)}
WARM_UP_STEPS = 2
#: The GPU preset whose fused attention kernel counts the FLOPs of ``sdpa`` on the CPU.
FUSED_KERNEL_GPU = "A100 80GB"


def label(mode: str, every: int) -> str:
    return f"{mode}/{every}" if every > 1 else mode


def _step(model, x, y) -> None:
    model(x, y)[1].backward()


def _counted_flops(model, x, y) -> int:
    with FlopCounterMode(display=False) as counter:
        _step(model, x, y)
    return counter.get_total_flops()


def memory(model, x, y, device: str) -> tuple[int, int]:
    """``(kept, peak)`` bytes of one forward + backward, with ``.grad`` already there."""
    _step(model, x, y)
    kept = ckpt.measure_kept_bytes(model, x, y)
    return kept, peak_memory(lambda: _step(model, x, y), device=device)


def step_times(model, x, y, policies, device: str, rounds: int):
    """Seconds of one forward + backward per policy and round (``course_lib.measurement.timing``: warmed
    up, synchronized, policies interleaved in an order rotated every round)."""
    by_label = {label(*p): p for p in policies}

    def switch(name: str) -> None:
        ckpt.enable_checkpointing(model, *by_label[name])
        model.zero_grad(set_to_none=True)

    times = timing.step_times({name: lambda: _step(model, x, y) for name in by_label},
                              repeats=rounds, warmup=WARM_UP_STEPS, before=switch, device=device)
    model.zero_grad(set_to_none=True)
    return times


def _quartiles(values: list[float]) -> list[float]:
    """The 25th and 75th percentiles (the values themselves when there are fewer than 2)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def evaluate(config: GPTConfig, batch: int, dtype, device: str = "cpu", rounds: int = 11,
             policies=POLICIES) -> list[dict]:
    """One row per policy: time, FLOPs and memory, each also as a ratio to the first policy."""
    torch.manual_seed(0)
    model = GPT(config).to(device, dtype)
    x, y = random_tokens(config, batch, device=device)
    times = step_times(model, x, y, policies, device, rounds)
    kernel_counted = config.attention == "explicit" or device != "cpu"
    gpu = None if device == "cpu" else "cuda"  # the live GPU's kernels on CUDA
    fused_gpu = gpu or FUSED_KERNEL_GPU
    rows = []
    for mode, every in policies:
        ckpt.enable_checkpointing(model, mode, every)
        counted = _counted_flops(model, x, y)
        predicted, recomputed = checkpointed.step_flops(config, batch, mode, every, dtype=dtype, gpu=gpu)
        gpu_count = checkpointed.step_flops(config, batch, mode, every, dtype=dtype, gpu=fused_gpu)[0]
        kept, peak = memory(model, x, y, device)
        rows.append({"policy": label(mode, every), "mode": mode, "every": every,
                     "seconds": times.wall[label(mode, every)],
                     "cpu_seconds": times.cpu[label(mode, every)],
                     "flops_counted": counted, "flops_predicted": predicted,
                     "flops_recomputed": recomputed, "flops_fused_kernel_counted": gpu_count,
                     "flop_source": ("FlopCounterMode" if kernel_counted
                                     else f"step_flops(gpu={FUSED_KERNEL_GPU!r})"),
                     "kept_bytes": kept, "peak_bytes": peak})
        model.zero_grad(set_to_none=True)
    base = rows[0]
    flops_of = "flops_counted" if kernel_counted else "flops_fused_kernel_counted"
    for row in rows:
        for clock in ("", "cpu_"):
            ratios = [t / t0 for t, t0 in zip(row[f"{clock}seconds"], base[f"{clock}seconds"])]
            row[f"{clock}median_s"] = statistics.median(row[f"{clock}seconds"])
            row[f"{clock}time_ratio"] = statistics.median(ratios)
            row[f"{clock}time_ratio_quartiles"] = _quartiles(ratios)
        row["flop_ratio"] = row[flops_of] / base[flops_of]
        row["kept_saved"] = 1 - row["kept_bytes"] / base["kept_bytes"]
        row["peak_saved"] = 1 - row["peak_bytes"] / base["peak_bytes"]
    return rows


CLOCKS = {"": "time", "cpu_": "CPU-time"}


def _ratio(row: dict, clock: str) -> str:
    return "x{:.2f} ({:.2f}-{:.2f})".format(row[f"{clock}time_ratio"],
                                            *row[f"{clock}time_ratio_quartiles"])


def print_report(results: dict, info: dict) -> None:
    # The CPU time of a CUDA step is mostly the host waiting for the GPU: not a useful clock there.
    clocks = ("", "cpu_") if info["device"] == "cpu" else ("",)
    for attention, result in results.items():
        c = result["config"]
        print(f"\n{attention} attention: vocabulary {c['vocab_size']}, d_model {c['d_model']}, "
              f"{c['n_heads']} heads, {c['n_layers']} layers, sequence {c['seq_len']}, batch "
              f"{result['batch']}, {result['dtype']}, {result['rounds']} rounds, {info['device']} "
              f"({info.get('gpu', info['processor'])}, {info['torch_threads']} thread(s))")
        body = [[r["policy"], f"{1000 * r['median_s']:.1f}",
                 *(_ratio(r, clock) for clock in clocks),
                 f"x{r['flop_ratio']:.3f}", f"{r['kept_bytes'] / MiB:.2f}",
                 f"{r['kept_saved']:.0%}", f"{r['peak_bytes'] / MiB:.2f}",
                 f"{r['peak_saved']:.0%}",
                 "yes" if r["flops_counted"] == r["flops_predicted"] else "NO"]
                for r in result["rows"]]
        print(table(body, ["policy", "median ms", *(f"{CLOCKS[c]} ratio (IQR)" for c in clocks),
                           "FLOP ratio", "kept MiB", "kept saved", "peak MiB", "peak saved",
                           "step_flops = counted"]))
        print(f"FLOP ratio from {result['rows'][0]['flop_source']}")


def main(argv=None) -> int:
    args = arguments(__doc__, argv)
    info = setup(args.device)
    spec = dict(SETUP[args.device])
    if args.device == "cuda":
        spec["dtype"] = pick_dtype(torch.device("cuda"))
    rounds = 2 if args.quick else spec["rounds"]
    policies = POLICIES[:2] if args.quick else POLICIES
    results = {}
    for attention in ATTENTIONS:
        config = GPTConfig(**spec["model"], attention=attention)
        rows = evaluate(config, spec["batch"], spec["dtype"], args.device, rounds, policies)
        results[attention] = {"config": asdict(config), "batch": spec["batch"],
                              "dtype": str(spec["dtype"]), "rounds": rounds, "rows": rows}
    print_report(results, info)
    run = {"machine": info, "quick": args.quick, "what": "one forward + backward per policy",
           "results": results}
    path = save("checkpoint_cost", args.device, run, args.out, args.quick)
    print(f"\nwritten: {path}" if path else "\nquick run: nothing written (pass --out to write)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
