"""course_lib.measurement.timing: the order of the runs, the clocks and the statistics, with fake steps."""

import time

import pytest
import torch

from course_lib.measurement.timing import _StepTimes, step_times, synchronize


def test_rounds_are_interleaved_and_rotated_after_the_warm_up():
    calls = []
    steps = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    before = []
    step_times(steps, repeats=4, warmup=2, before=before.append)
    assert calls[:6] == list("aabbcc")               # warm-up: each step, untimed
    assert "".join(calls[6:]) == "abc" "bca" "cab" "abc"  # one run each per round, rotated
    assert before == calls                            # before(name) precedes every run


def test_a_slower_step_is_measured_slower_on_both_clocks():
    def busy(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    times = step_times({"short": lambda: busy(0.002), "long": lambda: busy(0.02)}, repeats=3)
    for clock in ("wall", "cpu", "auto"):
        assert times.best(clock)["long"] > 5 * times.best(clock)["short"]
        assert times.median(clock)["long"] > 5 * times.median(clock)["short"]
    assert 5 < times.ratio("long", "short") < 20
    assert all(len(t) == 3 for t in (*times.wall.values(), *times.cpu.values()))


def test_statistics_against_hand_computed_values():
    times = _StepTimes(wall={"a": [3.0, 1.0, 2.0], "b": [1.0, 1.0, 4.0]},
                      cpu={"a": [6.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]}, device="cpu")
    assert times.median("wall") == {"a": 2.0, "b": 1.0}
    assert times.best("wall") == {"a": 1.0, "b": 1.0}
    assert times.median() == {"a": 4.0, "b": 2.0}        # auto on a CPU: the CPU time
    assert times.ratio("a", "b", "wall") == 1.0           # per round 3, 1, 0.5: median 1
    assert times.ratio("a", "b") == 2.0                   # per round 3, 1, 2: median 2
    assert _StepTimes(times.wall, times.cpu, "cuda").median() == times.median("wall")


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": {}}, "steps"), ({"steps": [lambda: None]}, "steps"),
    ({"steps": {"a": 1}}, r"steps\['a'\]"), ({"repeats": 0}, "repeats"),
    ({"warmup": -1}, "warmup"), ({"before": "x"}, "before"), ({"device": "gpu"}, "device"),
])
def test_bad_input_names_the_parameter(kwargs, match):
    args = {"steps": {"a": lambda: None}, **kwargs}
    with pytest.raises(ValueError, match=match):
        step_times(**args)


def test_bad_clock_or_name():
    times = _StepTimes({"a": [1.0]}, {"a": [1.0]}, "cpu")
    with pytest.raises(ValueError, match="clock"):
        times.median("gpu")
    with pytest.raises(ValueError, match="baseline"):
        times.ratio("a", "b")


@pytest.mark.parametrize("device, waited", [("cpu", []), ("cuda", ["cuda"]), ("mps", ["mps"])])
def test_synchronize_waits_for_the_gpu_queues_only(monkeypatch, device, waited):
    calls = []
    # the devices, present as far as the course's device check asks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("cuda"))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    synchronize(device)
    assert calls == waited
    times = step_times({"a": lambda: None}, repeats=2, warmup=0, device=device)
    assert calls == waited * 5  # and before and after each timed run
    assert times.median() == times.median("cpu" if device == "cpu" else "wall")


# --------------------------------------------------------------------------- time by kernel class

class _Event:
    """A profiler event as split_by_class reads it: a name, a parent, self times in µs."""

    def __init__(self, name, parent=None, cpu=0.0, device=0.0):
        self.name, self.cpu_parent = name, parent
        self.self_cpu_time_total, self.self_device_time_total = cpu, device


def test_kernel_class_names_each_class():
    from course_lib.measurement.timing import _kernel_class

    assert _kernel_class("aten::addmm") == _kernel_class("aten::linear") == "matmul"
    assert _kernel_class("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert _kernel_class("course::bias_gelu_backward") == "fused kernel"
    assert _kernel_class("Optimizer.step#AdamW.step") == "optimizer"
    assert _kernel_class("aten::gelu") is None and _kernel_class("AddmmBackward0") is None


def test_split_by_class_counts_self_time_under_the_outermost_class():
    from course_lib.measurement.timing import _KERNEL_CLASSES, _split_by_class

    linear = _Event("aten::linear", cpu=1)
    sdpa = _Event("aten::scaled_dot_product_attention", cpu=2)
    step = _Event("Optimizer.step#AdamW.step", cpu=3)
    node = _Event("autograd::engine::evaluate_function: AddmmBackward0", cpu=4)
    events = [linear, _Event("aten::mm", linear, cpu=10, device=7), sdpa,
              _Event("aten::bmm", sdpa, cpu=20),  # the math kernel's bmm: attention
              step, _Event("aten::mul_", step, cpu=30), node,
              _Event("course::bias_gelu", node, cpu=40),  # a rerun in the backward pass
              _Event("aten::add", cpu=50)]
    split = _split_by_class(events)
    assert tuple(split.seconds) == _KERNEL_CLASSES and split.clock == "cpu"
    assert {k: round(v * 1e6) for k, v in split.seconds.items()} == {
        "matmul": 11, "attention": 22, "fused kernel": 40, "other pointwise": 54, "optimizer": 33}
    assert split.total == pytest.approx(160e-6)
    assert split.shares()["fused kernel"] == pytest.approx(0.25)
    device = _split_by_class(events, device_time=True)
    assert device.clock == "device" and device.seconds["matmul"] == pytest.approx(7e-6)


def test_profile_step_splits_a_training_step_of_the_fused_gpt():
    pytest.importorskip("triton")
    from course_lib.measurement import timing
    from course_lib.model.gpt import GPTConfig, random_tokens
    from course_lib.prediction import step_setup
    from course_lib.training.loop import train

    config = GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_heads=4, n_layers=2,
                       fused_mlp=True)
    model, optimizer = step_setup.build(config, mode="recompute-kernel")
    x, y = random_tokens(config, 2)

    def step():
        train(model, optimizer, [(x, y)], micro_batch_size=2)

    step()
    split = timing.profile_step(step)
    assert split.clock == "cpu" and all(t > 0 for t in split.seconds.values()), split
    with pytest.raises(ValueError, match="step"):
        timing.profile_step("step")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_step_splits_the_device_time_on_a_gpu():
    from course_lib.measurement import timing
    from course_lib.model.gpt import GPTConfig, random_tokens
    from course_lib.prediction import step_setup
    from course_lib.training.loop import train

    config = GPTConfig(vocab_size=512, seq_len=256, d_model=256, n_heads=4, n_layers=2,
                       fused_mlp=True)
    precision = "autocast-bf16" if torch.cuda.get_device_capability()[0] >= 8 else "autocast-fp16"
    model, optimizer = step_setup.build(config, precision=precision, mode="recompute-kernel",
                                        device="cuda")
    data = [random_tokens(config, 4, device="cuda")]
    options = step_setup.train_options(precision, "cuda")

    def step():
        train(model, optimizer, data, micro_batch_size=4, **options)

    step()
    split = timing.profile_step(step, device="cuda")
    assert split.clock == "device" and all(t > 0 for t in split.seconds.values()), split
    assert split.seconds["matmul"] > split.seconds["fused kernel"]  # compiled: one pass over memory
