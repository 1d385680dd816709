"""The views of lecture 03: the trade-off explorer, the step-through and the playground."""

import numpy as np
import pytest
import torch

from course_lib.device import GPU
from course_lib.model.gpt import GPT, GPTConfig
from course_lib.model.toy_data import markov_tokens
from course_lib.prediction import time_model as tm
from course_lib.prediction.predict import Step
from course_lib.units import GiB
from course_lib.views import playground as pgm, step_views as sv

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
GPT2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)


@pytest.fixture(scope="module")
def recordings():
    torch.manual_seed(0)
    model = GPT(CFG).double()
    x, y = markov_tokens(8, CFG.seq_len, CFG.vocab_size, seed=1)
    return {mode: sv.record_accumulation_step(model, x, y, 2, mode) for mode in sv.LOOPS}


def test_the_right_loop_fills_the_buffer_to_the_whole_batch_gradient(recordings):
    rec = recordings["right"]
    K = rec.K
    assert K == 4 and len(rec.frames) == 2 * K + 3
    assert rec.groups == ("embeddings", "block 0 attention", "block 0 MLP",
                          "block 1 attention", "block 1 MLP", "LayerNorms")
    at_step = rec.frames[-2]
    assert LOOP_LINE(rec, at_step) == "optimizer.step()"
    assert np.allclose(at_step.grad, 1.0, atol=1e-10)  # float64: the whole batch's gradient
    # the weights stay where they were until optimizer.step(), then move
    assert all(max(f.moved) == 0 for f in rec.frames[:-2]) and min(at_step.moved) > 0
    assert rec.frames[-1].grad == (0.0,) * 6  # zero_grad empties the buffer
    # the buffer grows micro-batch by micro-batch (backward frames)
    filled = [max(f.grad) for f in rec.frames[2:-2:2]]
    assert filled == sorted(filled) and filled[0] < 0.5


def LOOP_LINE(rec, frame):
    return sv.LOOPS[rec.mode][frame.lines[0]].split("#")[0].strip()


def test_the_wrong_loops_end_elsewhere(recordings):
    no_k = recordings["no / K (bug)"].frames[-2].grad
    assert np.allclose(no_k, 4.0, atol=1e-10)  # K times the whole batch's gradient
    inside = recordings["zero_grad in the loop (bug)"]
    assert max(inside.frames[-2].grad) < 0.6  # only the last micro-batch's share survives
    assert all(f.grad == (0.0,) * 6 for f in inside.frames[1:-2:2])  # emptied before each forward
    assert {len(r.frames) for r in recordings.values()} == {11}


def test_step_through_widget_follows_the_frames(recordings):
    box = sv.step_through(recordings)
    frame, mode = box.view.controls["frame"], box.view.controls["mode"]
    # frames count from 1, as the caption does
    assert box.play.min == frame.min == 1 and box.play.max == frame.max == 11
    assert box.view.artists["caption"].get_text().startswith("frame 1/11:")
    first = box.view.image.value
    frame.value = 5
    assert box.view.image.value != first
    highlighted = [line for line in box.code.value.split("<div")[1:] if "#ffe9a8" in line]
    assert len(highlighted) == 1 and "backward()" in highlighted[0]
    # the code never wraps (a narrow page scrolls it) and sits above the figure, full width
    assert "white-space:pre" in box.code.value and box.children[1] is box.code
    assert max(len(line) for lines in sv.LOOPS.values() for line in lines) <= 60
    mode.value = "no / K (bug)"
    assert "BUG: not divided by K" in box.code.value and "c0392b" in box.code.value
    frame.value = 10  # optimizer.step()
    assert box.view.artists["verdict"].get_text().endswith("= 4.00 to 4.00")
    with pytest.raises(ValueError, match="same number of frames"):
        short = sv._StepRecording("right", ("a",), 2, 1, recordings["right"].frames[:3])
        sv.step_through({"right": short, "no / K (bug)": recordings["no / K (bug)"]})
    with pytest.raises(ValueError, match="mode must be"):
        sv.record_accumulation_step(GPT(CFG), *markov_tokens(4, 8, 32), 2, mode="wrong")
    with pytest.raises(ValueError, match="micro_batch_size must divide"):
        sv.record_accumulation_step(GPT(CFG), *markov_tokens(4, 8, 32), 3)


def test_step_through_asks_before_it_answers_and_keeps_its_reference_in_view(recordings):
    box = sv.step_through(recordings)
    frame, artists = box.view.controls["frame"], box.view.artists
    for shown in range(1, 10):  # before optimizer.step(), where .grad ends is not given away
        frame.value = shown
        assert "reads .grad at frame 10" in artists["verdict"].get_text()
        # the weights panel says why it has no bars: nothing moved yet
        assert "same weights" in artists["unmoved"].get_text()
    frame.value = 10
    assert artists["verdict"].get_text().endswith("= 1.00 to 1.00")
    assert artists["unmoved"].get_text() == ""
    # the reference line and its label are drawn after the bars, which pass 1 in the bug loops
    bars = max(bar.get_zorder() for bar in artists["grad"])
    for name in ("reference", "reference_label"):
        assert artists[name].get_animated() and artists[name].get_zorder() > bars


def test_tradeoff_compares_with_one_plain_batch_against_the_cards_memory():
    t = sv.tradeoff(Step(GPT2, 2, 8, mode="blocks", precision="fp16-mixed", gpu="T4"))
    assert t.capacity == 14930 * 2**20  # what PyTorch reports of a T4
    plain = t.plain.step
    assert (plain.micro_batch_size, plain.accumulation_steps, plain.mode) == (16, 1, "none")
    assert plain.precision == "fp16-mixed" and plain.gpu is t.accumulated.step.gpu
    # the lecture's opening: GPT-2 on a T4, one batch of 32 does not fit, 8 x 4 does
    story = sv.tradeoff(Step(GPT2, 4, 8, precision="fp16-mixed", gpu="T4"))
    assert story.fits and not story.plain_fits
    assert story.verdict() == ("8 micro-batches of 4: fits in the T4's 14.58 GiB;  "
                               "one batch of 32: does not fit")
    live = GPU("this card", 16 * GiB, (8, 0), free_memory=10 * GiB, live=True)
    on_live = sv.tradeoff(Step(GPT2, 4, 8, precision="fp16-mixed", gpu=live))
    assert on_live.capacity == 10 * GiB and "this card's 10.00 GiB free" in on_live.verdict()
    cpu = sv.tradeoff(Step(CFG, 2, 2), tm.DeviceSpeed("cpu", 1e10, 1e9, 1e9, 1e9, 1e-5, True, "x"))
    assert cpu.capacity is None and cpu.fits is None
    assert "no memory limit" in cpu.verdict()
    with pytest.raises(TypeError, match="step must be"):
        sv.tradeoff(GPT2)


def test_memory_top_is_fixed_for_a_card_and_above_the_cpus_largest_batch():
    t4 = sv.tradeoff(Step(GPT2, 4, 8, precision="fp16-mixed", gpu="T4"))
    assert sv._memory_top(t4) == 20 * GiB  # 1.25 x 14.58 GiB, rounded up to 1, 2 or 5
    small_b = sv.tradeoff(Step(GPT2, 1, 64, precision="fp16-mixed", gpu="T4"))
    assert sv._memory_top(small_b) == 20 * GiB
    cpu = sv.tradeoff(Step(CFG, 2, 2))
    # an independent floor: a batch of 64 holds its 16 bytes per parameter and its logits
    one = sv.tradeoff(Step(CFG, 64, 1)).accumulated.total
    assert 16 * 7_232 < one < sv._memory_top(cpu) <= 2 * 1.15 * one


@pytest.mark.parametrize("seconds, text", [(1860.0, "31.0 min"), (0.0421, "42.1 ms"),
                                           (1.86, "1.86 s"), (850e-6, "850 µs"),
                                           (7200.0, "2.0 h"), (0.0, "0.00 µs"),
                                           (0.9995, "1.00 s"), (59.9, "59.9 s"),
                                           (59.96, "1.0 min"), (9.996e-3, "10.0 ms"),
                                           (0.09996, "100 ms")])
def test_format_duration(seconds, text):
    assert sv._format_duration(seconds) == text


@pytest.fixture(scope="module")
def speed():
    # Stated, not measured: what the explorer predicts (and so declines) must not depend on
    # how busy the machine is. 10 GFLOP/s, a slow core's fp32 matmuls.
    return tm.DeviceSpeed("cpu", 1e10, 1e10, 1e10, 1e10, 1e-5, True, "stated for the test")


def test_tradeoff_explorer_redraws_and_measures(speed, monkeypatch):
    # a loaded machine may run the tiny model's step many times slower than predicted: the
    # limit is raised so that only the prediction (GPT-2: minutes a step) declines
    monkeypatch.setattr(sv, "MEASURE_LIMIT_SECONDS", 600.0)
    models = {"tiny": CFG, "GPT-2 124M": GPT2}
    box = sv.tradeoff_explorer(models, speed=speed)
    controls, image = box.view.controls, box.view.image
    assert "mode" not in controls  # lecture 04 teaches it
    assert all(c.style.description_width == "initial" for c in controls.values())
    seen = {image.value}
    for name, value in (("accumulation_steps", 8), ("micro_batch_size", 1), ("gpu", "A100 80GB"),
                        ("precision", "mixed"), ("model", "GPT-2 124M")):
        controls[name].value = value
        assert image.value not in seen, name
        seen.add(image.value)
    assert "GPT-2 124M, bf16-mixed, on A100 80GB" in box.view.artists["title"].get_text()
    box.measure()  # GPT-2 at 1024 tokens is far too slow for this CPU: declined, said why
    assert not box.measured and controls["gpu"].value == speed.name
    controls["model"].value = "tiny"
    box.measure()
    [(key, run)] = box.measured.items()
    assert key[0] == "tiny" and run.peak_bytes > 0
    assert np.isfinite(box.view.artists["time_measured"].get_ydata()).all()
    with pytest.raises(ValueError, match="gpu must be one of"):
        sv.tradeoff_explorer(models, speed=speed, gpu="V100")
    with pytest.raises(ValueError, match="micro_batch_size must be one of"):
        sv.tradeoff_explorer(models, speed=speed, micro_batch_size=3)
    with pytest.raises(ValueError, match="models must map"):
        sv.tradeoff_explorer({}, speed=speed)
    with pytest.raises(ValueError, match=r"models\['tiny'\] must be a course_lib.model.gpt.GPTConfig"):
        sv.tradeoff_explorer({"tiny": {"n_layers": 2}}, speed=speed)


def test_the_accumulated_bar_refuses_to_budge_and_the_card_line_is_labelled(speed):
    box = sv.tradeoff_explorer({"GPT-2 124M": GPT2}, speed=speed, gpu="T4", precision="mixed",
                               micro_batch_size=4, accumulation_steps=2)
    a, K = box.view.artists, box.view.controls["accumulation_steps"]
    heights, limits = [], []
    for value in (2, 8, 64):
        K.value = value
        heights.append([bar.get_height() for bar in a["mem_bars"]])
        limits.append(a["mem"].get_ylim())
    assert len(set(limits)) == 1 and limits[0] == (0, 20)  # GiB: the axis stays put
    assert heights[0][1] == heights[1][1] == heights[2][1]  # the accumulated bar stays put
    assert heights[0][0] < heights[1][0] <= heights[2][0]  # the one batch grows (then is cut)
    assert a["cap"].get_ydata()[0] == pytest.approx(14930 / 1024)
    assert a["cap_text"].get_text() == "T4: 14.58 GiB as PyTorch reports it\n(nvidia-smi: 15,360 MiB)"
    assert "does not fit" in a["verdict"].get_text()
    assert "↑" in a["mem_labels"][0].get_text()  # the cut bar says so
    with_ckpt = sv.tradeoff_explorer({"tiny": CFG}, speed=speed, checkpointing_menu=True)
    menu = with_ckpt.view.controls["mode"]
    assert [value for _, value in menu.options] == list(sv.CHECKPOINT_CHOICES)
    assert [label for label, _ in menu.options] == ["none", "every block", "selective"]


def test_tradeoff_figure_is_static_and_drawn():
    t = sv.tradeoff(Step(GPT2, 4, 8, precision="fp16-mixed", gpu="T4"))
    fig = sv.tradeoff_figure(t, "README")
    assert not fig.findobj(lambda a: a.get_animated())  # a plain figure: savefig draws it all
    heights = [bar.get_height() for bar in fig.axes[0].patches[:2]]
    assert heights[1] == pytest.approx(t.accumulated.total / GiB)  # absolute bytes, in GiB
    assert heights[0] == pytest.approx(20)  # one batch of 32: cut at the panel's top
    assert fig.axes[0].get_ylim() == (0, 20)


@pytest.fixture
def small_playground():
    return pgm.Playground(CFG, samples=16, lr=1e-2)


def test_playground_view_draws_runs_and_trains_on_the_button(small_playground):
    small_playground.run(2, 2)
    box = sv.playground_view(small_playground, sizes=(1, 2, 4), steps=(1, 2, 4),
                             micro_batch_size=2, accumulation_steps=2)
    controls, a = box.view.controls, box.view.artists
    assert set(controls) == {"micro_batch_size", "accumulation_steps"}  # no checkpointing
    assert len(a["run"].get_xdata()) == 4 and a["missing"].get_text() == ""
    assert a["labels"][1].get_text() != "?"  # measured
    controls["micro_batch_size"].value = 1
    assert a["missing"].get_text().startswith("not trained yet")
    assert a["labels"][1].get_text() == "?" and a["labels"][0].get_text() != "?"
    box.train()
    assert small_playground.cached(1, 2) is not None and a["missing"].get_text() == ""
    assert box.status.value.startswith("step 8/8") and "trained in" in box.status.value
    controls["accumulation_steps"].value = 4
    controls["micro_batch_size"].value = 4  # 16 per step: one step in 16 samples
    box.train()
    assert "two optimizer steps" in box.status.value
    checked = sv.playground_view(small_playground, sizes=(1, 2), steps=(1, 2),
                                 micro_batch_size=2, accumulation_steps=2, mode="none")
    assert checked.view.controls["every_block"].value is False
    for kwargs, match in ((dict(sizes=(2, 1)), "sizes"), (dict(steps=()), "steps"),
                          (dict(micro_batch_size=3), "sizes"), (dict(mode="sqrt"),
                                                                "mode")):
        with pytest.raises(ValueError, match=match):
            sv.playground_view(small_playground, **kwargs)
    with pytest.raises(ValueError, match="playground must be"):
        sv.playground_view("playground")
