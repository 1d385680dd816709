"""course_lib.planning.fit chooses by time: of the settings that fit, the fastest by the one time
model (course_lib.prediction.time_model), against a brute force over every setting, and not the
least recompute that it chose before."""

import itertools

import pytest

from course_lib.model.gpt import GPTConfig
from course_lib.planning import fit
from course_lib.planning.planner import recompute_fraction
from course_lib.prediction import time_model
from course_lib.prediction.predict import Step, predict
from course_lib.units import MiB

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(vocab_size=64, seq_len=64, d_model=64, n_heads=4, n_layers=4)
EFFECTIVE = 8
DIVISORS = (1, 2, 4, 8)
#: A CPU-like device, fixed so that the test does not depend on this machine's speed: each
#: operator costs 5 us, a checkpointed region its own hooks (a selective policy's dispatch most).
CPU_LIKE = time_model.DeviceSpeed(
    name="a CPU-like device", fp32_flops=1e11, fp16_flops=4e9, bf16_flops=1.5e11,
    memory_bandwidth=1.5e10, op_seconds=5e-6, measured=True, source="fixed for a test",
    region_seconds=(("blocks", 7e-4), ("selective", 1.7e-3), ("attention", 3e-4)))
SPEEDS = {"T4": time_model.device_speed("T4"), None: CPU_LIKE}


def _step(config, b, precision, gpu, mode, every, effective=EFFECTIVE):
    return Step(config, b, effective // b, precision=precision, mode=mode, every=every, gpu=gpu)


def _brute_force(config, budget, precision, gpu, policies=fit.FIT_POLICIES):
    """Every fitting (mode, every, b), fastest first, each Step built and predicted on its own,
    every micro-batch tried (no bisection, no floor)."""
    rows = []
    for (mode, every), b in itertools.product(policies, DIVISORS):
        step = _step(config, b, precision, gpu, mode, every)
        p = predict(step, SPEEDS[gpu])
        if p.total <= budget:
            rows.append((p.seconds, recompute_fraction(step), -b, mode, every, b))
    return [row[3:] for row in sorted(rows)]


def _by_flops(config, budget, precision, gpu):
    """What fit chose before: the policies by recompute (stable), the first with a fitting
    micro-batch, its largest."""
    for mode, every in sorted(fit.FIT_POLICIES, key=lambda p: recompute_fraction(
            _step(config, 1, precision, gpu, *p))):
        fitting = [b for b in DIVISORS
                   if predict(_step(config, b, precision, gpu, mode, every)).total <= budget]
        if fitting:
            return mode, every, max(fitting)
    return None


def _budgets(precision, gpu):
    """Budgets at which the set of fitting settings changes: every setting's own peak."""
    return sorted({predict(_step(CONFIG, b, precision, gpu, m, e)).total
                   for (m, e), b in itertools.product(fit.FIT_POLICIES, DIVISORS)})


@pytest.mark.parametrize("gpu", ["T4", None])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_settings_are_every_fitting_setting_fastest_first(precision, gpu):
    for budget in _budgets(precision, gpu)[::2]:
        got = fit.settings(Step(CONFIG, EFFECTIVE, precision=precision, gpu=gpu), budget,
                           speed=SPEEDS[gpu])
        assert [(f.step.mode, f.step.every, f.step.micro_batch_size) for f in got] == \
            _brute_force(CONFIG, budget, precision, gpu)
        for f in got:
            s = f.step
            assert f.peak_bytes <= budget and s.batch_size == EFFECTIVE
            assert f.seconds == predict(_step(CONFIG, s.micro_batch_size, precision, gpu,
                                              s.mode, s.every), SPEEDS[gpu]).seconds
        assert [f.seconds for f in got] == sorted(f.seconds for f in got)


@pytest.mark.parametrize("gpu", ["T4", None])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_choice_is_the_fastest_and_not_the_least_recompute(precision, gpu):
    """At some budgets the least recompute (with its largest micro-batch) is not the fastest
    setting: the choice is then a different, strictly faster one."""
    differ = 0
    for budget in _budgets(precision, gpu):
        got = fit.settings(Step(CONFIG, EFFECTIVE, precision=precision, gpu=gpu), budget,
                           speed=SPEEDS[gpu])
        fastest = _brute_force(CONFIG, budget, precision, gpu)
        if not got:
            assert not fastest
            continue
        chosen = got[0]
        assert (chosen.step.mode, chosen.step.every, chosen.step.micro_batch_size) == fastest[0]
        old = _by_flops(CONFIG, budget, precision, gpu)
        if old != fastest[0]:
            differ += 1
            mode, every, b = old
            assert chosen.seconds < predict(_step(CONFIG, b, precision, gpu, mode, every),
                                            SPEEDS[gpu]).seconds
    assert differ >= 2  # the FLOP order would fail this test


def test_fit_model_trains_its_model_with_the_fastest_fitting_setting():
    space = fit.search_space(seq_len=64, vocab_size=64, widths=range(16, 129, 16),
                             depths=range(1, 9), head_size=16, aspect_ratio=None)
    for budget in (3 * MiB, 5 * MiB):
        f = fit.fit_model(budget, space=space, effective_batch=EFFECTIVE, precisions=("bf16",),
                          gpu="T4")
        fastest = _brute_force(f.step.config, budget, "bf16", "T4")
        assert (f.step.mode, f.step.every, f.step.micro_batch_size) == fastest[0]
        assert f.prediction.time.basis == "from the datasheet"
        assert f"{f.seconds * 1e3:.1f} ms" in f.summary()


def test_measure_seconds_times_each_setting():
    small = GPTConfig(vocab_size=32, seq_len=16, d_model=16, n_heads=2, n_layers=2)
    fits = fit.settings(Step(small, 4), 64 * MiB, policies=(("none", 1), ("blocks", 1)),
                        speed=CPU_LIKE)
    seconds = fit.measure_seconds(fits[:2], repeats=1)
    assert len(seconds) == 2 and all(0 < s < 10 for s in seconds)
    with pytest.raises(ValueError, match="fits"):
        fit.measure_seconds([])
    with pytest.raises(TypeError, match="speed"):
        fit.settings(Step(small), MiB, speed="fast")
