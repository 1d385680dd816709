"""The accumulation playground: settings, cache, and memory predicted against measured."""

import functools

import pytest
import torch

from course_lib import playground as pgm
from course_lib import step_setup
from course_lib.models import GPT, GPTConfig, count_parameters
from course_lib.training import train

CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)


@pytest.fixture(scope="module")
def playground():
    return pgm.Playground(CFG, samples=32, lr=1e-2)


def test_effective_batch_and_steps():
    assert pgm.effective_batch(4, 8) == 32
    assert pgm.optimizer_steps(100, 4, 8) == 3
    with pytest.raises(ValueError, match="accumulation_steps"):
        pgm.effective_batch(4, 0)
    with pytest.raises(ValueError, match="samples"):
        pgm.optimizer_steps(0, 1, 1)


def test_resident_bytes_counts_weights_and_adam_state_once():
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    P = count_parameters(model)
    assert pgm.resident_bytes(model, opt) == 4 * P  # tied embedding counted once, no state yet
    x = torch.randint(0, 16, (2, 8))
    train(model, opt, [(x, x)], micro_batch_size=2)
    # + m and v (4 bytes each per parameter) + one step counter per parameter tensor
    n_tensors = len(list(model.parameters()))
    assert pgm.resident_bytes(model, opt) == 12 * P + 4 * n_tensors


def test_same_effective_batch_gives_the_same_curve_and_less_memory(playground):
    big = playground.run(4, 1)
    pieces = playground.run(1, 4)
    assert big.effective_batch == pieces.effective_batch == 4
    assert big.optimizer_steps == pieces.optimizer_steps == 8 == len(big.losses)
    assert big.samples_seen == tuple(range(4, 33, 4))
    assert max(abs(u - v) for u, v in zip(big.losses, pieces.losses)) < 1e-4
    assert pieces.measured_peak < big.measured_peak
    assert playground.cached(4, 1) is big and playground.run(4, 1) is big
    assert playground.cached(2, 2) is None


def test_memory_is_flat_in_k_and_predicted_by_the_engine(playground):
    one, two, four = playground.run(2, 1), playground.run(2, 2), playground.run(2, 4)
    assert two.measured_peak == four.measured_peak
    assert playground.predict_peak(2, 2) == playground.predict_peak(2, 4)
    assert one.predicted_peak == one.measured_peak               # one micro-batch: to the byte
    # from K = 2 on the engine bounds the pass's new gradients from above: a few bytes here
    assert 0 <= four.predicted_peak - four.measured_peak <= 0.005 * four.measured_peak
    # independent floor: 16 bytes per parameter of weights, gradients and AdamW's m and v
    assert four.measured_peak > 16 * count_parameters(GPT(CFG))


def test_checkpointing_lowers_the_peak_and_keeps_the_curve(playground):
    plain, ckpt = playground.run(4, 2), playground.run(4, 2, True)
    assert ckpt.measured_peak < plain.measured_peak
    assert playground.predict_peak(4, 2, True) < playground.predict_peak(4, 2)
    assert ckpt.measured_peak <= ckpt.predicted_peak              # an upper bound from K = 2 on
    assert max(abs(u - v) for u, v in zip(plain.losses, ckpt.losses)) < 1e-5


def test_on_step_reports_every_optimizer_step():
    seen = []
    run = pgm.Playground(CFG, samples=16).run(2, 2, on_step=lambda step, loss: seen.append((step, loss)))
    assert [step for step, _ in seen] == [1, 2, 3, 4]
    assert tuple(loss for _, loss in seen) == run.losses


def test_bad_settings(playground):
    with pytest.raises(ValueError, match="two optimizer steps"):
        playground.run(16, 2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        playground.run(0, 2)
    with pytest.raises(ValueError, match="config"):
        pgm.Playground({"d_model": 8})
    with pytest.raises(ValueError, match="lr"):
        pgm.Playground(CFG, lr=0)


# --------------------------------------------------------------------------- the trade-off

GPT2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)


def _counted_ops(config, precision, mode):
    """``(per micro-batch, per optimizer step)`` operators of a real step of ``config``'s depth,
    counted on a tiny model of its structure (widths change no operator): steps of one and of
    two micro-batches differ by one micro-batch's forward and backward."""
    counts = []
    for K in (1, 2):
        model, optimizer = step_setup.build(config, precision=precision, mode=mode)
        x = torch.zeros(K, config.seq_len, dtype=torch.long)
        step = functools.partial(train, model, optimizer, [(x, x)], micro_batch_size=1,
                                 accumulation_steps=K, **step_setup.train_options(precision))
        step()  # AdamW's state exists from here on
        with pgm._OpCounter() as counter:  # counted at the config's own widths
            step()
        counts.append(counter.ops)
    return counts[1] - counts[0], 2 * counts[0] - counts[1]


def test_optimizer_step_cost_from_the_transformer_count_the_datasheet_and_counted_ops():
    cost = pgm.optimizer_step_cost(GPT2, 4, 8, checkpointing="blocks", precision="bf16-mixed",
                                   gpu="A100 80GB")
    assert cost.effective_batch == 32
    b, s, h, L, V, K = 4, 1024, 768, 12, 50257, 8
    # FLOPs as FlopCounterMode counts them: a block's linears 24bsh^2 and its attention core
    # 4bs^2h (the whole square) forward; backward twice the linears and 2.5 times a fused core,
    # which recomputes the scores; the head 2bshV, three times. Checkpointed blocks rerun their
    # forward but the MLP's output projection, whose output no backward needs without dropout.
    linears, core, head = 24 * b * s * h * h, 4 * b * s * s * h, 2 * b * s * h * V
    recompute = L * (linears - 8 * b * s * h * h + core)
    flops = L * (3 * linears + core + 5 * core // 2) + 3 * head + recompute
    assert (cost.flops, cost.recompute_flops) == (K * flops, K * recompute)
    # at half the A100's 312 TFLOP/s of bf16 tensor cores (its datasheet)
    compute = K * flops / (0.5 * 312e12)
    # AdamW per parameter: reads the fp32 weight, gradient, m and v, writes weight, m and v
    # (28 bytes), casts the bf16 gradient to fp32 (2 + 4) and the weight back (4 + 2); GPT-2
    # small's 124,439,808 parameters over the A100 80GB's 2,039 GB/s (its datasheet)
    per_micro_batch, per_step = _counted_ops(
        GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=L), "bf16-mixed",
        "blocks")
    optimizer = 40 * 124_439_808 / 2039e9 + per_step * pgm.OP_SECONDS
    overhead = K * per_micro_batch * pgm.OP_SECONDS
    assert cost.compute_seconds == pytest.approx(compute)
    assert cost.overhead_seconds == pytest.approx(overhead)
    assert cost.optimizer_seconds == pytest.approx(optimizer)
    assert cost.seconds == pytest.approx(compute + overhead + optimizer)
    # memory, a floor: the 14 bytes per parameter held between steps (bf16 weights, fp32 master
    # copy, m and v) and, in a micro-batch's backward, every checkpointed block's bf16 input
    assert cost.peak_bytes > 14 * 124_439_808 + L * b * s * h * 2


def test_flops_of_a_micro_batch_match_the_transformer_count():
    explicit = GPTConfig(vocab_size=100, seq_len=16, d_model=32, n_heads=4, n_layers=3,
                         attention="explicit")
    b, s, h, L, V = 2, 16, 32, 3, 100
    forward = L * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * V
    assert pgm.micro_batch_flops(explicit, 2) == (3 * forward, 0)  # backward = 2 forwards


def test_smaller_micro_batches_cost_time_at_a_fixed_effective_batch_and_save_memory():
    costs = [pgm.optimizer_step_cost(GPT2, 64 // K, K, precision="bf16-mixed", gpu="H100 80GB")
             for K in (1, 4, 16, 64)]
    assert len({round(c.compute_seconds, 12) for c in costs}) == 1  # the same FLOPs
    assert [c.seconds for c in costs] == sorted(c.seconds for c in costs)
    assert costs[-1].seconds > 1.5 * costs[0].seconds  # micro-batches of 1 leave it under-filled
    assert costs[-1].achieved_utilisation < costs[0].achieved_utilisation <= 0.5
    assert [c.peak_bytes for c in costs] == sorted((c.peak_bytes for c in costs), reverse=True)
    plain = pgm.optimizer_step_cost(GPT2, 8, 1, gpu="H100 80GB")
    ckpt = pgm.optimizer_step_cost(GPT2, 8, 1, checkpointing="blocks", gpu="H100 80GB")
    assert ckpt.peak_bytes < plain.peak_bytes and ckpt.compute_seconds > plain.compute_seconds


def test_device_speed_of_the_presets():
    t4, a100 = pgm.device_speed("T4"), pgm.device_speed("A100 80GB")
    assert t4.flops(torch.float16) == 65e12 and t4.flops(torch.bfloat16) == 8.1e12  # no bf16 cores
    assert a100.flops(torch.bfloat16) == a100.flops(torch.float16) == 312e12
    assert a100.flops(torch.float32) == 19.5e12 and not a100.measured
    from course_lib.device import GPU

    live = GPU("NVIDIA A100-SXM4-40GB", 40 * 2**30, (8, 0), live=True)
    assert pgm.device_speed(live).memory_bandwidth == 1555e9  # the preset of the same chip
    with pytest.raises(ValueError, match="no datasheet"):
        pgm.device_speed(GPU("NVIDIA RTX 4090", 24 * 2**30, (8, 9)))
    with pytest.raises(ValueError, match="measure_device_speed"):
        pgm.device_speed(None)


def test_step_ops_are_counted_and_linear_in_depth():
    per_layer = [pgm._ops(n, False, "sdpa", True, "blocks", "fp32") for n in (1, 2, 3)]
    assert per_layer[2][0] - per_layer[1][0] == per_layer[1][0] - per_layer[0][0] > 0
    assert per_layer[2][1] - per_layer[1][1] == per_layer[1][1] - per_layer[0][1] > 0
    three = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=3)
    assert pgm.step_ops(three, "blocks") == per_layer[2]
    # checkpointing reruns forward operators; AdamW runs the same ones either way
    plain = pgm.step_ops(three)
    assert pgm.step_ops(three, "blocks")[0] > plain[0]
    assert pgm.step_ops(three, "blocks")[1] == plain[1]


def test_adamw_bytes_moved():
    assert pgm.adamw_bytes_moved(10) == 280           # 7 fp32 values per parameter
    assert pgm.adamw_bytes_moved(10, "bf16") == 140   # 7 bf16 values
    assert pgm.adamw_bytes_moved(10, "bf16-mixed") == 400  # + casts of grads and weights


def test_measured_speed_and_step_on_this_cpu():
    speed = pgm.measure_device_speed("cpu", repeats=2, matmul_size=128)
    assert speed.measured and speed.fp32_flops > 0 and speed.op_seconds > 0
    assert dict(speed.region_seconds).keys() == {"blocks", "selective", "attention"}
    cost = pgm.optimizer_step_cost(CFG, 2, 2, speed=speed)
    assert cost.utilisation == 1.0  # measured on a matmul: already what it achieves
    run = pgm.measure_step_cost(CFG, 2, 1, steps=1)
    assert run.peak_bytes == pgm.optimizer_step_cost(CFG, 2, 1, speed=speed).peak_bytes
    assert run.seconds > 0
    on_cpu_time = pgm.measure_step_cost(CFG, 2, 1, steps=1, clock="auto")  # process CPU time
    assert on_cpu_time.peak_bytes == run.peak_bytes and on_cpu_time.seconds > 0
    with pytest.raises(ValueError, match="clock must be one of"):
        pgm.measure_step_cost(CFG, 2, 1, clock="gpu")


@pytest.mark.parametrize("kwargs, match", [
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(accumulation_steps=1.5), "accumulation_steps"),
    (dict(checkpointing="sqrt"), "checkpointing must be one of"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(gpu=None), "needs speed"),
    (dict(gpu="V100"), "gpu must be"),
    (dict(utilisation=1.5), "utilisation"),
    (dict(speed="fast"), "speed must be"),
    (dict(config={"n_layers": 2}), "config must be a course_lib.models.GPTConfig"),
])
def test_optimizer_step_cost_rejects_bad_input(kwargs, match):
    args = dict(config=GPT2, micro_batch_size=2, accumulation_steps=2, gpu="T4") | kwargs
    with pytest.raises(ValueError, match=match):
        pgm.optimizer_step_cost(args.pop("config"), args.pop("micro_batch_size"),
                                args.pop("accumulation_steps"), **args)
