"""course_lib.timing: the order of the runs, the clocks and the statistics, with fake steps."""

import time

import pytest
import torch

from course_lib.timing import StepTimes, step_times, synchronize


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
    times = StepTimes(wall={"a": [3.0, 1.0, 2.0], "b": [1.0, 1.0, 4.0]},
                      cpu={"a": [6.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]}, device="cpu")
    assert times.median("wall") == {"a": 2.0, "b": 1.0}
    assert times.best("wall") == {"a": 1.0, "b": 1.0}
    assert times.median() == {"a": 4.0, "b": 2.0}        # auto on a CPU: the CPU time
    assert times.ratio("a", "b", "wall") == 1.0           # per round 3, 1, 0.5: median 1
    assert times.ratio("a", "b") == 2.0                   # per round 3, 1, 2: median 2
    assert StepTimes(times.wall, times.cpu, "cuda").median() == times.median("wall")


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
    times = StepTimes({"a": [1.0]}, {"a": [1.0]}, "cpu")
    with pytest.raises(ValueError, match="clock"):
        times.median("gpu")
    with pytest.raises(ValueError, match="baseline"):
        times.ratio("a", "b")


@pytest.mark.parametrize("device, waited", [("cpu", []), ("cuda", ["cuda"]), ("mps", ["mps"])])
def test_synchronize_waits_for_the_gpu_queues_only(monkeypatch, device, waited):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("cuda"))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    synchronize(device)
    assert calls == waited
    times = step_times({"a": lambda: None}, repeats=2, warmup=0, device=device)
    assert calls == waited * 5  # and before and after each timed run
    assert times.median() == times.median("cpu" if device == "cpu" else "wall")
