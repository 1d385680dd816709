"""The accumulation playground: settings, cache, and memory predicted against measured."""


import pytest
import torch

from course_lib.model.gpt import GPT, GPTConfig
from course_lib.prediction import time_model as tm
from course_lib.prediction.predict import Step, predict
from course_lib.training.loop import train
from course_lib.views import playground as pgm

CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)


@pytest.fixture(scope="module")
def playground():
    return pgm.Playground(CFG, samples=32, lr=1e-2)


def test_effective_batch_and_steps():
    assert pgm._effective_batch(4, 8) == 32
    with pytest.raises(ValueError, match="accumulation_steps"):
        pgm._effective_batch(4, 0)


def test_resident_bytes_counts_weights_and_adam_state_once(count_parameters):
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
    assert len(big.losses) == len(pieces.losses) == 8
    assert big.samples_seen == tuple(range(4, 33, 4))
    assert max(abs(u - v) for u, v in zip(big.losses, pieces.losses)) < 1e-4
    assert pieces.measured_peak < big.measured_peak
    assert playground.cached(4, 1) is big and playground.run(4, 1) is big
    assert playground.cached(2, 2) is None


def test_memory_is_flat_in_k_and_predicted_by_the_engine(playground, count_parameters):
    one, two, four = playground.run(2, 1), playground.run(2, 2), playground.run(2, 4)
    assert two.measured_peak == four.measured_peak
    assert playground.predict_peak(2, 2) == playground.predict_peak(2, 4)
    assert one.predicted_peak == one.measured_peak               # one micro-batch: to the byte
    # from K = 2 on too, to the loop's Python scalars
    assert abs(four.predicted_peak - four.measured_peak) <= 64
    # independent floor: 16 bytes per parameter of weights, gradients and AdamW's m and v
    assert four.measured_peak > 16 * count_parameters(GPT(CFG))


def test_checkpointing_lowers_the_peak_and_keeps_the_curve(playground):
    plain, ckpt = playground.run(4, 2), playground.run(4, 2, "blocks")
    assert ckpt.measured_peak < plain.measured_peak
    assert playground.predict_peak(4, 2, "blocks") < playground.predict_peak(4, 2)
    assert abs(ckpt.measured_peak - ckpt.predicted_peak) <= 64  # a later micro-batch replayed
    assert max(abs(u - v) for u, v in zip(plain.losses, ckpt.losses)) < 1e-5


def test_on_step_reports_every_optimizer_step():
    seen = []
    run = pgm.Playground(CFG, samples=16).run(2, 2, on_step=lambda step, loss: seen.append((step, loss)))
    assert [step for step, _ in seen] == [1, 2, 3, 4]
    assert tuple(loss for _, loss in seen) == run.losses


def test_a_run_needs_two_optimizer_steps(playground):  # other bad input: test_inputs_planning
    with pytest.raises(ValueError, match="two optimizer steps"):
        playground.run(16, 2)


# --------------------------------------------------------------------------- the trade-off

GPT2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)


def test_the_trade_offs_step_by_hand():
    """The compute term worked out by hand: the transformer's matmul count (Kaplan et al. 2020;
    the backward pass twice the forward), the blocks' rerun and flash attention's recomputed
    scores (Dao et al. 2022), at 40% of the A100's datasheet bf16 peak; the other terms add up to
    the total."""
    p = predict(Step(GPT2, 4, 8, mode="blocks", precision="bf16-mixed", gpu="A100 80GB"))
    t = p.time
    b, s, h, L, V, K = 4, 1024, 768, 12, 50257, 8
    block = 24 * b * s * h * h + 4 * b * s * s * h  # qkv, proj, fc, proj; scores and scores @ V
    forward = L * block + 2 * b * s * h * V  # and the head
    # each checkpointed block reruns all but its last matmul: the backward pass does not need
    # the MLP's output (no dropout after it), and the rerun stops before it
    rerun = L * (block - 8 * b * s * h * h)
    flash = L * 2 * b * s * s * h  # bf16 on an A100: flash attention's backward recomputes Q K^T
    assert t.flops == K * (3 * forward + rerun + flash)
    assert t.compute_seconds == pytest.approx(t.flops / (0.4 * 312e12))
    assert p.seconds == pytest.approx(t.compute_seconds + t.pointwise_seconds + t.launch_seconds
                                      + t.transfer_seconds + t.optimizer_seconds)
    # memory, a floor: the 14 bytes per parameter held between steps (bf16 weights, fp32 master
    # copy, m and v) and, in a micro-batch's backward, every checkpointed block's bf16 input
    assert p.total > 14 * 124_439_808 + L * b * s * h * 2


def test_smaller_micro_batches_cost_time_at_a_fixed_effective_batch_and_save_memory():
    steps = [Step(GPT2, 64 // K, K, precision="bf16-mixed", gpu="H100 80GB") for K in (1, 4, 16, 64)]
    costs = [predict(step) for step in steps]
    assert len({round(c.time.compute_seconds, 12) for c in costs}) == 1  # the same FLOPs
    assert [c.seconds for c in costs] == sorted(c.seconds for c in costs)
    assert costs[-1].seconds > 1.5 * costs[0].seconds  # micro-batches of 1 leave it under-filled
    # FLOPs per second over the H100's bf16 datasheet peak: model FLOPs utilisation
    mfu = [c.time.flops / c.seconds / 989e12 for c in costs]
    assert mfu[-1] < mfu[0] <= 0.4
    assert [c.total for c in costs] == sorted((c.total for c in costs), reverse=True)
    plain = predict(Step(GPT2, 8, 1, gpu="H100 80GB"))
    ckpt = predict(Step(GPT2, 8, 1, mode="blocks", gpu="H100 80GB"))
    assert ckpt.total < plain.total and ckpt.time.compute_seconds > plain.time.compute_seconds


def test_measured_speed_and_step_on_this_cpu():
    speed = tm._measure_speed("cpu", repeats=2, matmul_size=128)
    assert predict(Step(CFG, 2, 2), speed).time.utilisation == 1.0  # measured on a matmul
    run = pgm.measure_step_cost(Step(CFG, 2, 1), steps=1)
    assert run.peak_bytes == predict(Step(CFG, 2, 1)).total  # one micro-batch: to the byte
    assert run.seconds > 0
    on_cpu_time = pgm.measure_step_cost(Step(CFG, 2, 1), steps=1, clock="auto")  # CPU time
    assert on_cpu_time.peak_bytes == run.peak_bytes and on_cpu_time.seconds > 0
    with pytest.raises(ValueError, match="clock must be one of"):
        pgm.measure_step_cost(Step(CFG, 2, 1), clock="gpu")
    with pytest.raises(TypeError, match="step must be"):
        pgm.measure_step_cost(CFG)


@pytest.mark.parametrize("kwargs, match", [
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(accumulation_steps=1.5), "accumulation_steps"),
    (dict(mode="sqrt!"), "mode must be one of"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(gpu="V100"), "gpu must be"),
    (dict(config={"n_layers": 2}), "config must be a course_lib.model.gpt.GPTConfig"),
])
def test_a_step_from_the_widgets_controls_rejects_bad_input(kwargs, match):
    args = dict(config=GPT2, micro_batch_size=2, accumulation_steps=2, gpu="T4") | kwargs
    with pytest.raises(ValueError, match=match):
        Step(**args)
