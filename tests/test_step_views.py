"""The two views of lecture 03: the trade-off explorer and the step-through of one step."""

import numpy as np
import pytest
import torch

from course_lib import memory
from course_lib import playground as pgm
from course_lib import step_views as sv
from course_lib.models import GPT, GPTConfig
from course_lib.toy_data import markov_tokens

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
    assert box.play.max == frame.max == 10
    first = box.view.image.value
    frame.value = 4
    assert box.view.image.value != first
    highlighted = [line for line in box.code.value.split("<div")[1:] if "#ffe9a8" in line]
    assert len(highlighted) == 1 and "backward()" in highlighted[0]
    mode.value = "no / K (bug)"
    assert "BUG: not divided by K" in box.code.value and "c0392b" in box.code.value
    assert box.view.artists["verdict"].get_text().endswith("= 4.00 to 4.00")
    with pytest.raises(ValueError, match="same number of frames"):
        short = sv.StepRecording("right", ("a",), 2, 1, recordings["right"].frames[:3])
        sv.step_through({"right": short, "no / K (bug)": recordings["no / K (bug)"]})
    with pytest.raises(ValueError, match="mode must be"):
        sv.record_accumulation_step(GPT(CFG), *markov_tokens(4, 8, 32), 2, mode="wrong")
    with pytest.raises(ValueError, match="micro_batch_size must divide"):
        sv.record_accumulation_step(GPT(CFG), *markov_tokens(4, 8, 32), 3)


def test_tradeoff_compares_with_one_plain_batch():
    t = sv.tradeoff(GPT2, 2, 8, checkpointing="blocks", precision="mixed", gpu="T4")
    assert t.precision == "fp16-mixed" and t.capacity == 14930 * 2**20
    assert (t.plain.micro_batch_size, t.plain.accumulation_steps, t.plain.checkpointing) == (
        16, 1, "none")
    assert sv.tradeoff(GPT2, 2, 8, precision="mixed", gpu="H100 80GB").precision == "bf16-mixed"
    assert memory.mixed_precision_for(None) == "bf16-mixed"


@pytest.fixture(scope="module")
def speed():
    # The best of three: one run on a loaded machine can be many times slow, and the explorer
    # would then decline to measure even the tiny model.
    return pgm.measure_device_speed("cpu", repeats=3, matmul_size=128)


def test_tradeoff_explorer_redraws_and_measures(speed):
    models = {"tiny": CFG, "GPT-2 124M": GPT2}
    box = sv.tradeoff_explorer(models, speed=speed)
    controls, image = box.view.controls, box.view.image
    seen = {image.value}
    for name, value in (("accumulation_steps", 8), ("micro_batch_size", 1),
                        ("checkpointing", "every block"), ("gpu", "A100 80GB"),
                        ("precision", "mixed"), ("model", "GPT-2 124M")):
        controls[name].value = value
        assert image.value not in seen, name
        seen.add(image.value)
    assert "GPT-2 124M, bf16-mixed, on A100 80GB" in box.view.artists["title"].get_text()
    box.measure()  # GPT-2 at 1024 tokens is far too slow for this CPU: declined, said why
    assert not box.measured and controls["gpu"].value.startswith("this device")
    controls["model"].value = "tiny"
    box.measure()
    [(key, run)] = box.measured.items()
    assert key[0] == "tiny" and run.peak_bytes > 0
    assert np.isfinite(box.view.artists["time_measured"].get_ydata()).all()
    with pytest.raises(ValueError, match="gpu must be one of"):
        sv.tradeoff_explorer(models, speed=speed, gpu="V100")
    with pytest.raises(ValueError, match="models must map"):
        sv.tradeoff_explorer({}, speed=speed)
    with pytest.raises(ValueError, match=r"models\['tiny'\] must be a course_lib.models.GPTConfig"):
        sv.tradeoff_explorer({"tiny": {"n_layers": 2}}, speed=speed)


def test_tradeoff_figure_is_static_and_drawn():
    t = sv.tradeoff(GPT2, 4, 16, checkpointing="blocks", precision="mixed", gpu="A100 80GB")
    fig = sv.tradeoff_figure(t, "README")
    assert not fig.findobj(lambda a: a.get_animated())  # a plain figure: savefig draws it all
    heights = [bar.get_height() for bar in fig.axes[0].patches[:2]]
    assert heights[0] == 1.0 and heights[1] == pytest.approx(t.step.peak_bytes / t.plain.peak_bytes)
