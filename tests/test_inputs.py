"""No silently wrong answers: every public function of these modules refuses a bad input with a
``ValueError`` (or ``TypeError``) that names the parameter, found by hypothesis over the values
that used to slip through: bools where ints are meant, NaN and the infinities, floats where ints
are meant (2.5, and whole ones such as 2.0), sizes past their stated maximum (2**63), strings,
None, containers, and device names torch does not know ("gpu").

Modules: validation, units, memory, models, toy_data, training, measure,
memory_timeline, policies, ranks, distributed, widgets. The others (activations, kernels, engine,
checkpointing, planner, fit, playground, device, model_zoo, levers, allocator, grading) are in
test_inputs_planning.py; the strategies are in input_strategies.py.
"""

import math

import ipywidgets
import pytest
import torch
from hypothesis import given, strategies as st
from input_strategies import (
    BOOLS,
    FRACTIONS,
    HUGE,
    NON_FINITE,
    NOT_A_BOOL,
    NOT_A_DEVICE,
    OTHERS,
    SETTINGS,
    WHOLE_FLOATS,
    not_a_number,
    not_an_int,
    not_one_of,
)

from course_lib import units, validation
from course_lib.distributed import ranks
from course_lib.measurement import memory
from course_lib.model import gpt, toy_data
from course_lib.planning import planner
from course_lib.prediction import formulas, step_setup
from course_lib.training import loop, policies
from course_lib.views import widgets

torch.manual_seed(0)
CFG = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=1)
MODEL = gpt.GPT(CFG)
X, Y = gpt.random_tokens(CFG, 4)

# --- (function of the value, the parameter it names, the values it must refuse) -------------


def _config_with(name):
    return lambda value: gpt.GPTConfig(**{name: value})


CASES = {
    # validation
    "integer": (lambda v: validation.integer("n", v, minimum=0, maximum=10), "n",
                not_an_int(0, 10)),
    "number": (lambda v: validation.number("x", v, minimum=0.0, below=1.0), "x",
               not_a_number(0.0, 1.0)),
    "boolean": (lambda v: validation.boolean("flag", v), "flag", NOT_A_BOOL),
    "device": (lambda v: validation.device("where", v), "where", NOT_A_DEVICE),
    # units
    "dtype_bytes.dtype": (lambda v: units.dtype_bytes(v), "dtype", not_one_of(())),
    "format_bytes.n": (lambda v: units.format_bytes(v), "n", not_a_number()),
    "format_bytes.precision": (lambda v: units.format_bytes(10, v), "precision",
                               not_an_int(0, 12)),
    # memory
    "training_memory.n_params": (lambda v: formulas.training_memory(v), "n_params",
                                 st.one_of(BOOLS, NON_FINITE, FRACTIONS, OTHERS,
                                           st.integers(max_value=0),
                                           st.integers(min_value=formulas.MAX_PARAMS + 1))),
    "training_memory.world_size": (lambda v: formulas.training_memory(10, world_size=v),
                                   "world_size", st.one_of(BOOLS, NON_FINITE, FRACTIONS, OTHERS,
                                                           st.integers(max_value=0), HUGE)),
    "training_memory.zero_stage": (lambda v: formulas.training_memory(10, zero_stage=v),
                                   "zero_stage", not_an_int(0, 3)),
    "training_memory.optimizer": (lambda v: formulas.training_memory(10, optimizer=v), "optimizer",
                                  not_one_of(formulas.OPTIMIZERS)),
    "training_memory.fp32_grad_buffer": (
        lambda v: formulas.training_memory(10, fp32_grad_buffer=v), "fp32_grad_buffer",
        NOT_A_BOOL),
    "transformer_activation_bytes.n_layers": (
        lambda v: formulas.transformer_activation_bytes(4, 2, 8, 2, v), "n_layers",
        not_an_int(1, validation.MAX_COUNT)),
    # models
    **{f"GPTConfig.{name}": (_config_with(name), name, not_an_int(1, maximum))
       for name, maximum in gpt.CONFIG_MAXIMUM.items() if name != "n_heads"},
    "GPTConfig.dropout": (lambda v: gpt.GPTConfig(dropout=v), "dropout",
                          st.one_of(not_a_number(0.0), st.floats(min_value=1.0,
                                                                 allow_infinity=False))),
    "GPTConfig.bias": (lambda v: gpt.GPTConfig(bias=v), "bias", NOT_A_BOOL),
    "GPTConfig.attention": (lambda v: gpt.GPTConfig(attention=v), "attention",
                            not_one_of(gpt.ATTENTION_KINDS)),
    "random_tokens.batch_size": (lambda v: gpt.random_tokens(CFG, v), "batch_size",
                                 not_an_int(1, 2**20)),
    "random_tokens.seq_len": (lambda v: gpt.random_tokens(CFG, 2, v), "seq_len",
                              st.one_of(BOOLS, NON_FINITE, FRACTIONS, WHOLE_FLOATS,
                                        st.integers(max_value=0),
                                        st.integers(min_value=CFG.seq_len + 1))),
    "random_tokens.seed": (lambda v: gpt.random_tokens(CFG, 2, seed=v), "seed",
                           not_an_int(0, gpt.MAX_SEED)),
    "random_tokens.device": (lambda v: gpt.random_tokens(CFG, 2, device=v), "device",
                             NOT_A_DEVICE),
    "gpt_param_count.config": (lambda v: gpt.gpt_param_count(v), "config", OTHERS),
    # toy_data
    "markov_tokens.seed": (lambda v: toy_data.markov_tokens(2, 4, seed=v), "seed",
                           not_an_int(0, gpt.MAX_SEED)),
    "markov_tokens.device": (lambda v: toy_data.markov_tokens(2, 4, device=v), "device",
                             NOT_A_DEVICE),
    "markov_tokens.n_sequences": (lambda v: toy_data.markov_tokens(v, 4), "n_sequences",
                                  not_an_int(1, 2**24)),
    "markov_tokens.branching": (lambda v: toy_data.markov_tokens(2, 4, 8, branching=v),
                                "branching", not_an_int(1, 8)),
    "markov_entropy.branching": (lambda v: toy_data.markov_entropy(v), "branching",
                                 not_an_int(1, validation.MAX_COUNT)),
    # training
    "batches_of.batch_size": (lambda v: loop.batches_of(X, Y, v), "batch_size",
                              st.one_of(BOOLS, NON_FINITE, FRACTIONS, OTHERS,
                                        st.integers(max_value=0), st.integers(min_value=5))),
    "make_grad_scaler.device_type": (lambda v: loop.make_grad_scaler(v), "device_type",
                                     not_one_of(("cuda", "cpu"))),
    # measure, memory_timeline, policies
    "peak_memory.device": (lambda v: memory.peak_memory(lambda: None, device=v), "device",
                           NOT_A_DEVICE.filter(lambda v: v is not None)),
    "saved_bytes.include_parameters": (
        lambda v: memory.saved_bytes((torch.ones(2, requires_grad=True) * 2).sum(),
                                      include_parameters=v), "include_parameters", NOT_A_BOOL),
    "policy_name.policy": (lambda v: policies._policy_name(v), "policy",
                           st.one_of(BOOLS, st.integers(), st.floats(), st.none())),
    "SelectiveContext.ops": (lambda v: policies.SelectiveContext(v), "ops",
                             st.one_of(BOOLS, st.integers(), st.floats(), st.none(),
                                       st.lists(st.integers(), min_size=1, max_size=2))),
    # ranks
    "Ranks.timeout": (lambda v: ranks.Ranks(2, timeout=v), "timeout",
                      not_a_number(0.0, ranks.MAX_SECONDS).filter(lambda v: v != 0.0)),
    "Ranks.world_size": (lambda v: ranks.Ranks(v), "world_size",
                         not_an_int(1, ranks.MAX_WORLD_SIZE)),
    # widgets
    "live_plot.columns": (lambda v: widgets.live_plot(lambda fig, n: None,
                                                      {"n": ipywidgets.IntSlider()}, columns=v),
                          "columns", not_an_int(1, 12)),
    "live_plot.figsize": (lambda v: widgets.live_plot(lambda fig, n: None,
                                                      {"n": ipywidgets.IntSlider()},
                                                      figsize=(v, 3)),
                          "figsize", not_a_number(0.0, widgets.MAX_INCHES)),
    "live_plot.draw": (lambda v: widgets.live_plot(v, {"n": ipywidgets.IntSlider()}), "draw",
                       st.one_of(BOOLS, st.integers(), st.text(max_size=3), st.none())),
    "live_plot.controls": (lambda v: widgets.live_plot(lambda fig: None, v), "controls",
                           st.one_of(BOOLS, st.integers(), st.text(max_size=3),
                                     st.lists(st.integers(), max_size=2))),
}


@pytest.mark.parametrize("case", sorted(CASES))
@SETTINGS
@given(data=st.data())
def test_bad_values_are_refused_naming_the_parameter(case, data):
    call, name, bad = CASES[case]
    value = data.draw(bad, label=name)
    with pytest.raises((ValueError, TypeError)) as info:
        call(value)
    assert name in str(info.value), (case, value, str(info.value))


# --- the values the issue found, one by one ---------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [({"bias": "no"}, "bias"), ({"n_layers": 2**63},
                                                                     "n_layers"),
                                         ({"dropout": False}, "dropout")])
def test_gpt_config_refuses_what_it_used_to_take(kwargs, name):
    with pytest.raises(ValueError, match=name):
        gpt.GPTConfig(**kwargs)


@pytest.mark.parametrize("call", [lambda: gpt.random_tokens(CFG, 2, device="gpu"),
                                  lambda: toy_data.markov_tokens(2, 4, device="gpu")])
def test_a_device_torch_does_not_know_is_a_value_error_naming_it(call):
    with pytest.raises(ValueError, match="device"):
        call()


# --- good values still work ------------------------------------------------------------------

@SETTINGS
@given(value=st.one_of(st.integers(0, 10), st.integers(0, 10).map(torch.tensor)))
def test_integer_accepts_ints_and_integer_scalars(value):
    assert validation.integer("n", value, minimum=0, maximum=10) == int(value)


# --- what were known gaps, in fit and planner -------------------------------------------------

def test_fit_build_refuses_a_fractional_seed():
    with pytest.raises(ValueError, match="seed"):
        step_setup.build(CFG, seed=1.5)


def test_pareto_front_refuses_nan_points():
    with pytest.raises(ValueError, match="points"):
        planner.pareto_front([(1.0, 2.0, "a"), (math.nan, 1.0, "n"), (2.0, 1.0, "b")])


def test_pareto_front_does_not_depend_on_the_input_order():
    points = [(1.0, 1.0, "a"), (1.0, 1.0, "b")]
    assert planner.pareto_front(points) == planner.pareto_front(points[::-1])


@pytest.mark.parametrize("call,wrong_type", [
    (lambda: gpt.GPTConfig(n_layers=2.0), True),          # a float for a size
    (lambda: gpt.GPTConfig(bias="no"), True),             # a str for a bool
    (lambda: gpt.random_tokens(CFG, True), True),         # a bool for a batch size
    (lambda: gpt.random_tokens(CFG, 0), False),           # an int out of range
    (lambda: gpt.GPTConfig(n_layers=-1), False),
    (lambda: gpt.random_tokens(CFG, 2, device="gpu"), False),  # a str torch does not parse
])
def test_a_wrong_type_is_a_type_error_a_wrong_value_is_not(call, wrong_type):
    """As PyTorch: TypeError for the wrong type, ValueError for a wrong value of the right type.
    The type error is a ValueError too, so a widget that shows ValueErrors shows it."""
    with pytest.raises(ValueError) as caught:
        call()
    assert isinstance(caught.value, TypeError) == wrong_type
