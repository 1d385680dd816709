"""No silently wrong answers, continued: the prediction, planning and device modules refuse a bad
input with a ``ValueError`` (or ``TypeError``) whose message names the parameter, and still take
every good value up to the stated maxima.

Modules: activations, kernels, engine, checkpointing, planner, fit, playground, device,
model_zoo, levers, allocator and grading's helpers (the others are in test_inputs.py). Every bad
value is refused before any model is built or trained, so each call is cheap.
"""

import itertools
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st
from input_strategies import (
    BOOLS,
    INT64,
    NON_FINITE,
    NOT_A_BOOL,
    NOT_A_DEVICE,
    OTHERS,
    not_a_number,
    not_an_int,
    not_one_of,
    refused_naming,
)

from course_lib import device, grading
from course_lib.measurement import allocator
from course_lib.model import kernels, zoo
from course_lib.model.gpt import CONFIG_MAXIMUM, GPT, MAX_SEED, GPTConfig, random_tokens
from course_lib.planning import fit, fit_ladder, guard, planner
from course_lib.prediction import activations, checkpointed, engine, step_setup, time_model
from course_lib.prediction.formulas import MAX_WORLD_SIZE, PRECISIONS
from course_lib.prediction.predict import Step, predict
from course_lib.training import checkpointing, levers, mixed_precision
from course_lib.validation import MAX_BATCH, MAX_BYTES, MAX_COUNT
from course_lib.views import playground

SETTINGS = settings(max_examples=20, deadline=None)

torch.manual_seed(0)
CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=2)
MODEL = GPT(CFG)
X, Y = random_tokens(CFG, 2)
PLAYGROUND = playground.Playground(CFG, samples=8)
PLAYGROUND_MODES = playground.PLAYGROUND_MODES
READING = allocator._Reading(allocated=0, reserved=0, free=1, total=2)
PROBE = allocator._Probe(False, 2, (("CUDA initialised", READING),))
FLOAT_DTYPES = ("fp32", "float32", "fp16", "float16", "bf16", "bfloat16")
NOT_A_DTYPE = not_one_of(("fp32", "float32", "fp16", "float16", "bf16", "bfloat16", "fp64",
                          "float64", "int8", "bool"))

# --- more bad values ---------------------------------------------------------------------------

NOT_A_GPU = st.one_of(BOOLS, st.integers(), st.floats(), st.lists(st.integers(), max_size=1),
                      st.sampled_from(["V100", "gpu", "t4", "", "T4 ", "cuda:x"]))
NOT_A_CUDA_DEVICE = st.one_of(BOOLS, st.floats(), st.none(), st.integers(max_value=-1),
                              st.integers(min_value=1024),
                              st.sampled_from(["gpu", "cpu", "mps", "cuda:x", "", "tpu0"]))
NOT_A_CONFIG = st.one_of(OTHERS, st.integers(), BOOLS)
NOT_A_TENSOR = st.one_of(BOOLS, st.integers(), st.floats(), st.none(), st.text(max_size=3),
                         st.lists(st.integers(), max_size=2))
NOT_A_FLOAT_DTYPE = st.one_of(not_one_of(FLOAT_DTYPES),
                              st.sampled_from([torch.int64, torch.bool, "int8", "fp64"]))
NOT_A_CALLABLE = st.one_of(BOOLS, st.integers(), st.floats(), st.none(), st.text(max_size=3),
                           st.lists(st.integers(), max_size=2))
NOT_A_STR = st.one_of(BOOLS, st.integers(), st.floats(), st.none(),
                      st.lists(st.text(max_size=2), max_size=2))
NOT_A_LIST = st.one_of(BOOLS, st.integers(), st.floats(), st.none(), st.text(min_size=1,
                                                                             max_size=3))


def given_value(strategy):
    """``strategy`` without None: for parameters where None is a good value (the default)."""
    return strategy.filter(lambda v: v is not None)


def bad_point():
    """A (memory, time, label) point that pareto_front must refuse."""
    number = st.one_of(NON_FINITE, BOOLS, st.text(max_size=2), st.none())
    return st.one_of(st.tuples(number, st.floats(0, 10), st.just("a")),
                     st.tuples(st.floats(0, 10), number, st.just("b")),
                     st.tuples(st.integers(0, 9)), st.integers(), st.none())


def _step_with(name):
    return lambda v: Step(CFG, **{name: v})


def _llama_with(name):
    return lambda v: zoo._LlamaConfig(**{name: v})


def _gpu_with(name):
    base = dict(name="x", total_memory=2**30, capability=(8, 0))
    return lambda v: device.GPU(**(base | {name: v}))


def _step(**kwargs):
    return lambda v: Step(**({"config": CFG, "micro_batch_size": 1}
                             | {k: (v if w is None else w) for k, w in kwargs.items()}))


# --- (function of the value, the parameter it names, the values it must refuse) --------------

CASES = {
    # activations
    "total_bytes.items": (lambda v: activations.total_bytes(v), "items",
                          st.one_of(BOOLS, st.integers(), st.none(), st.text(max_size=3),
                                    st.lists(st.integers(), min_size=1, max_size=2))),
    "total_bytes.kinds": (lambda v: activations.total_bytes([], v), "kinds",
                          st.one_of(BOOLS, st.integers(), st.none(), st.lists(
                              st.text(max_size=4).filter(lambda t: t not in activations.KINDS),
                              min_size=1, max_size=2))),
    "total_bytes.gpu": (lambda v: activations.total_bytes([], gpu=v), "gpu", NOT_A_GPU),
    "block_saved.config": (lambda v: activations.block_saved(v, 1), "config", NOT_A_CONFIG),
    "block_saved.batch_size": (lambda v: activations.block_saved(CFG, v), "batch_size",
                               not_an_int(1, MAX_BATCH)),
    "block_saved.seq_len": (lambda v: activations.block_saved(CFG, 1, v), "seq_len",
                            given_value(not_an_int(1, CFG.seq_len))),
    "block_saved.dtype": (lambda v: activations.block_saved(CFG, 1, None, v), "dtype",
                          NOT_A_FLOAT_DTYPE),
    "block_saved.gpu": (lambda v: activations.block_saved(CFG, 1, gpu=v), "gpu", NOT_A_GPU),
    "block_saved.autocast": (lambda v: activations.block_saved(CFG, 1, None, "bf16",
                                                               autocast=v), "autocast",
                             NOT_A_BOOL),
    "attention_core_saved.b": (lambda v: activations.attention_core_saved(CFG, v, 4, "fp32"),
                               "b", not_an_int(1, MAX_BATCH)),
    "attention_core_saved.s": (lambda v: activations.attention_core_saved(CFG, 1, v, "fp32"),
                               "s", not_an_int(1, CFG.seq_len)),
    "predict_saved_bytes.seq_len": (lambda v: activations.predict_saved_bytes(CFG, 1, v),
                                    "seq_len", given_value(not_an_int(1, CFG.seq_len))),
    # kernels
    "mask_dtype.dtype": (lambda v: kernels.mask_dtype(v), "dtype", NOT_A_DTYPE),
    "mask_dtype.gpu": (lambda v: kernels.mask_dtype("fp32", v), "gpu", NOT_A_GPU),
    "stats_dtype.gpu": (lambda v: kernels.stats_dtype("bf16", v), "gpu", NOT_A_GPU),
    "allocated.nbytes": (lambda v: kernels.allocated(v, "T4"), "nbytes", not_an_int(0)),
    "allocated.gpu": (lambda v: kernels.allocated(1, v), "gpu", NOT_A_GPU),
    "optimizer_steps_on_device.gpu": (lambda v: kernels.optimizer_steps_on_device(v), "gpu",
                                      NOT_A_GPU),
    "autocast_softmax_dtype.gpu": (lambda v: kernels.autocast_softmax_dtype("bf16", v), "gpu",
                                   NOT_A_GPU),
    "kernels.sdpa_kernel.config": (lambda v: kernels.sdpa_kernel(v, "fp32"), "config",
                                   NOT_A_CONFIG),
    "kernels.sdpa_kernel.dtype": (lambda v: kernels.sdpa_kernel(CFG, v), "dtype",
                                  NOT_A_FLOAT_DTYPE),
    "kernels.sdpa_kernel.gpu": (lambda v: kernels.sdpa_kernel(CFG, "fp32", v), "gpu", NOT_A_GPU),
    "attention_kernel.config": (lambda v: kernels.attention_kernel(v, "fp32"), "config",
                                NOT_A_CONFIG),
    # engine
    "precision_of.precision": (lambda v: engine.precision_of(v), "precision",
                               st.one_of(not_one_of(engine.PRECISIONS),
                                         st.lists(st.text(max_size=2), max_size=2))),
    "breakdown_rows.memory": (lambda v: engine.breakdown_rows(v), "memory", OTHERS),
    "adamw_scratch_bytes.param_bytes": (
        lambda v: engine.adamw_scratch_bytes(v), "param_bytes",
        st.one_of(BOOLS, st.integers(), st.none(), st.text(max_size=2), st.just([]),
                  st.lists(not_an_int(0, MAX_BYTES), min_size=1, max_size=2))),
    "Step.config": (_step(config=None), "config", NOT_A_CONFIG),
    "Step.micro_batch_size": (_step(micro_batch_size=None), "micro_batch_size",
                                             not_an_int(1, MAX_BATCH)),
    "Step.accumulation_steps": (_step(accumulation_steps=None),
                                               "accumulation_steps", not_an_int(1, MAX_BATCH)),
    "Step.precision": (_step(precision=None), "precision",
                                      not_one_of(engine.PRECISIONS)),
    "Step.mode": (_step(mode=None), "mode", not_one_of(engine.MODES)),
    "Step.every": (_step(mode="blocks", every=None), "every",
                                  not_an_int(1, MAX_COUNT)),
    "Step.segments": (_step(mode="sqrt", segments=None), "segments",
                                     given_value(not_an_int(1, CFG.n_layers))),
    "Step.seq_len": (_step(seq_len=None), "seq_len",
                                    given_value(not_an_int(1, CFG.seq_len))),
    "Step.gpu": (_step(gpu=None), "gpu", NOT_A_GPU),
    "Step.first_step": (_step(first_step=None), "first_step", NOT_A_BOOL),
    "Step.foreach": (_step(foreach=None), "foreach",  # None: PyTorch's default
                                    NOT_A_BOOL.filter(lambda v: v is not None)),
    "Step.loss_chunk": (_step(loss_chunk=None), "loss_chunk",
                                       given_value(not_an_int(1, MAX_COUNT))),
    "predict.step": (lambda v: predict(v), "step", OTHERS),
    # checkpointing
    "sqrt_segments.n_layers": (lambda v: checkpointing.sqrt_segments(v), "n_layers",
                               not_an_int(1, checkpointing.MAX_LAYERS)),
    "enable_checkpointing.model": (lambda v: checkpointing.enable_checkpointing(v), "model",
                                   st.one_of(OTHERS, st.just(torch.nn.Linear(2, 2)))),
    "enable_checkpointing.mode": (lambda v: checkpointing.enable_checkpointing(MODEL, v), "mode",
                                  not_one_of(checkpointing.MODES)),
    "enable_checkpointing.every": (lambda v: checkpointing.enable_checkpointing(MODEL, "blocks",
                                                                                v), "every",
                                   not_an_int(1, MAX_COUNT)),
    "enable_checkpointing.policy": (
        lambda v: checkpointing.enable_checkpointing(MODEL, "selective", policy=v), "policy",
        st.one_of(BOOLS, st.integers(), st.floats(), st.lists(st.integers(), min_size=1,
                                                              max_size=2))),
    "kept_by_block.batch_size": (lambda v: checkpointed.kept_by_block(CFG, v, "blocks"),
                                 "batch_size", not_an_int(1, MAX_BATCH)),
    "kept_by_block.config": (lambda v: checkpointed.kept_by_block(v, 1), "config", NOT_A_CONFIG),
    "predict_kept_bytes.mode": (lambda v: checkpointed.predict_kept_bytes(CFG, 1, v), "mode",
                                not_one_of(checkpointing.MODES)),
    "predict_kept_bytes.gpu": (lambda v: checkpointed.predict_kept_bytes(CFG, 1, gpu=v), "gpu",
                               NOT_A_GPU),
    "step_flops.every": (lambda v: checkpointed.step_flops(CFG, 1, "blocks", v), "every",
                         not_an_int(1, MAX_COUNT)),
    "step_flops.autocast": (lambda v: checkpointed.step_flops(CFG, 1, dtype="bf16",
                                                               autocast=v), "autocast",
                            NOT_A_BOOL),
    "checkpoint_cost.batch_size": (lambda v: checkpointed.checkpoint_cost(CFG, v), "batch_size",
                                   not_an_int(1, MAX_BATCH)),
    "measure_kept_bytes.model": (lambda v: checkpointing.measure_kept_bytes(v, X, Y), "model",
                                 OTHERS),
    "measure_kept_bytes.inputs": (lambda v: checkpointing.measure_kept_bytes(MODEL, v, Y),
                                  "inputs", st.one_of(NOT_A_TENSOR, st.just(X.float()),
                                                      st.just(X[0]))),
    "measure_kept_bytes.targets": (lambda v: checkpointing.measure_kept_bytes(MODEL, X, v),
                                   "targets", st.one_of(NOT_A_TENSOR, st.just(Y.float()),
                                                        st.just(Y[:, :2]))),
    # planner
    "candidates.step": (lambda v: planner.candidates(v), "step", st.one_of(OTHERS, NOT_A_CONFIG)),
    "candidates.modes": (lambda v: planner.candidates(Step(CFG, 1), modes=v), "modes",
                         st.one_of(BOOLS, st.integers(), st.none(), st.just(()), st.lists(
                             st.text(max_size=4).filter(lambda t: t not in planner.PLAN_MODES),
                             min_size=1, max_size=2))),
    "pareto_front.points": (lambda v: planner.pareto_front(v), "points",
                            st.one_of(BOOLS, st.integers(), st.none(),
                                      st.lists(bad_point(), min_size=1, max_size=3))),
    "plan_checkpointing.budget_bytes": (lambda v: planner.plan_checkpointing(Step(CFG, 1), v),
                                        "budget_bytes", not_an_int(1, MAX_BYTES)),
    "plan_checkpointing.step": (lambda v: planner.plan_checkpointing(v, 10**9), "step",
                                st.one_of(OTHERS, NOT_A_CONFIG)),
    # fit
    "largest_batch.step": (lambda v: fit.largest_batch(v, 10**6), "step",
                           st.one_of(OTHERS, NOT_A_CONFIG)),
    "largest_batch.budget_bytes": (lambda v: fit.largest_batch(Step(CFG), v), "budget_bytes",
                                   not_an_int(1, MAX_BYTES)),
    "largest_batch.policies": (
        lambda v: fit.largest_batch(Step(CFG), 10**6, policies=v), "policies",
        st.one_of(BOOLS, st.integers(), st.none(), st.text(max_size=3), st.just(()),
                  st.lists(st.tuples(st.sampled_from(["blocks", "none"]),
                                     not_an_int(1, MAX_COUNT)), min_size=1, max_size=2),
                  st.lists(st.tuples(not_one_of(checkpointing.MODES), st.just(1)), min_size=1,
                           max_size=2))),
    "search_space.widths": (lambda v: fit.search_space(widths=v), "widths",
                            st.one_of(NOT_A_LIST, st.just([]),
                                      st.just(list(range(64, 64 * (fit.MAX_SEARCH_VALUES + 2),
                                                         64))),
                                      st.lists(not_an_int(1, CONFIG_MAXIMUM["d_model"]),
                                               min_size=1, max_size=2))),
    "search_space.depths": (lambda v: fit.search_space(depths=v), "depths",
                            st.one_of(NOT_A_LIST, st.just([]),
                                      st.lists(not_an_int(1, CONFIG_MAXIMUM["n_layers"]),
                                               min_size=1, max_size=2))),
    "search_space.head_size": (lambda v: fit.search_space(head_size=v), "head_size",
                               not_an_int(1, CONFIG_MAXIMUM["d_model"])),
    "search_space.aspect_ratio": (
        lambda v: fit.search_space(aspect_ratio=v), "aspect_ratio",
        st.one_of(BOOLS, st.integers(), st.text(max_size=2), st.just((64, 32)),
                  st.just((1, 2, 3)), st.just([32, 128]),
                  st.tuples(not_a_number(0.0).filter(lambda v: not isinstance(v, str)),
                            st.just(128)),
                  st.tuples(st.just(1), st.one_of(NON_FINITE, BOOLS, st.none())))),
    "search_space.seq_len": (lambda v: fit.search_space(seq_len=v), "seq_len",
                             not_an_int(1, CONFIG_MAXIMUM["seq_len"])),
    "search_space.vocab_size": (lambda v: fit.search_space(vocab_size=v), "vocab_size",
                                not_an_int(1, CONFIG_MAXIMUM["vocab_size"])),
    "fit_model.budget_bytes": (lambda v: fit.fit_model(v), "budget_bytes",
                               not_an_int(1, MAX_BYTES)),
    "fit_model.effective_batch": (lambda v: fit.fit_model(2**30, effective_batch=v),
                                  "effective_batch", not_an_int(1, fit.MAX_EFFECTIVE_BATCH)),
    "fit_model.precisions": (lambda v: fit.fit_model(2**30, precisions=v), "precisions",
                             st.one_of(NOT_A_LIST, st.just(()),
                                       st.lists(not_one_of(PRECISIONS), min_size=1,
                                                max_size=2))),
    "fit_model.max_accumulation_steps": (
        lambda v: fit.fit_model(2**30, max_accumulation_steps=v), "max_accumulation_steps",
        given_value(not_an_int(1, fit.MAX_EFFECTIVE_BATCH))),
    "fit_model.space": (lambda v: fit.fit_model(2**30, space=v), "space",
                        st.one_of(OTHERS.filter(lambda v: v is not None), st.just([]),
                                  st.lists(st.integers(), min_size=1, max_size=2))),
    "fit_model.gpu": (lambda v: fit.fit_model(2**30, gpu=v), "gpu", NOT_A_GPU),
    **{f"Step.{name}": (_step_with(name), name, strategy) for name, strategy in {
        "in_backward": NOT_A_BOOL,
        "state_bits": st.one_of(BOOLS, st.sampled_from([8.0, 32.0, 4.5, 16, 0, "8"]),
                                NON_FINITE, st.none()),
        "offload_activations": NOT_A_BOOL,
        "offload_optimizer": NOT_A_BOOL,
        "lora_rank": given_value(not_an_int(1, CFG.d_model)),
        "zero_stage": not_an_int(0, 3),
        "world_size": not_an_int(1, MAX_WORLD_SIZE),
    }.items()},
    "ladder.gpu": (lambda v: fit_ladder.ladder(CFG, v), "gpu",
                   st.one_of(not_one_of(device.GPUS), st.lists(st.integers(), max_size=1))),
    "ladder.batch_size": (lambda v: fit_ladder.ladder(CFG, "T4", batch_size=v), "batch_size",
                          not_an_int(1, MAX_BATCH)),
    "ladder.budget_bytes": (lambda v: fit_ladder.ladder(CFG, "T4", budget_bytes=v), "budget_bytes",
                            given_value(not_an_int(1, MAX_BYTES))),
    "ladder.loss_chunk": (lambda v: fit_ladder.ladder(CFG, "T4", loss_chunk=v), "loss_chunk",
                          not_an_int(1, MAX_COUNT)),
    "ladder.lora_rank": (lambda v: fit_ladder.ladder(CFG, "T4", lora_rank=v), "lora_rank",
                         not_an_int(1, CFG.d_model).filter(lambda v: v is not None)),
    "ladder.world_size": (lambda v: fit_ladder.ladder(CFG, "T4", world_size=v), "world_size",
                          not_an_int(1, MAX_WORLD_SIZE)),
    "ladder.utilization": (lambda v: fit_ladder.ladder(CFG, "T4", utilization=v), "utilization",
                           st.one_of(not_a_number(0.0, 1.0), st.just(0.0)).filter(
                               lambda v: v is not None)),  # None: the time model's figure
    "build.config": (lambda v: step_setup.build(v), "config", NOT_A_CONFIG),
    "build.precision": (lambda v: step_setup.build(CFG, precision=v), "precision",
                        not_one_of(PRECISIONS)),
    "build.mode": (lambda v: step_setup.build(CFG, mode=v), "mode", not_one_of(checkpointing.MODES)),
    "build.every": (lambda v: step_setup.build(CFG, mode="blocks", every=v), "every",
                    not_an_int(1, MAX_COUNT)),
    "build.device": (lambda v: step_setup.build(CFG, device=v), "device", NOT_A_DEVICE),
    "build.lr": (lambda v: step_setup.build(CFG, lr=v), "lr", not_a_number(0.0)),
    "build.seed": (lambda v: step_setup.build(CFG, seed=v), "seed", not_an_int(0, MAX_SEED)),
    "train_options.precision": (lambda v: step_setup.train_options(v), "precision",
                                not_one_of(PRECISIONS)),
    "train_options.device": (lambda v: step_setup.train_options("fp16-mixed", v), "device",
                             NOT_A_DEVICE),
    "measure_step_memory.step": (lambda v: step_setup.measure_step_memory(v), "step",
                                 st.one_of(OTHERS, NOT_A_CONFIG)),
    "measure_step_memory.device": (lambda v: step_setup.measure_step_memory(Step(CFG, 1), device=v),
                                   "device", NOT_A_DEVICE),
    "BudgetTracker.budget_bytes": (lambda v: guard.BudgetTracker(v), "budget_bytes",
                                   not_an_int(1, MAX_BYTES)),
    "BudgetTracker.what": (lambda v: guard.BudgetTracker(10, v), "what", NOT_A_STR),
    "run_within_budget.fn": (lambda v: guard.run_within_budget(v, 10), "fn", NOT_A_CALLABLE),
    "run_within_budget.budget_bytes": (lambda v: guard.run_within_budget(lambda: None, v),
                                       "budget_bytes", not_an_int(1, MAX_BYTES)),
    "run_within_budget.device": (lambda v: guard.run_within_budget(lambda: None, 10, device=v),
                                 "device", given_value(NOT_A_DEVICE)),
    "run_within_budget.what": (lambda v: guard.run_within_budget(lambda: None, 10, what=v), "what",
                               NOT_A_STR),
    "MasterWeightAdamW.params": (lambda v: mixed_precision.MasterWeightAdamW(v), "params",
                                 st.one_of(BOOLS, st.integers(), st.none(), st.text(max_size=3),
                                           st.lists(st.integers(), max_size=2))),
    # playground
    "effective_batch.micro_batch_size": (lambda v: playground._effective_batch(v, 1),
                                         "micro_batch_size", not_an_int(1, MAX_BATCH)),
    "effective_batch.accumulation_steps": (lambda v: playground._effective_batch(1, v),
                                           "accumulation_steps", not_an_int(1, MAX_BATCH)),
    "Playground.config": (lambda v: playground.Playground(v), "config",
                          given_value(NOT_A_CONFIG)),
    "Playground.samples": (lambda v: playground.Playground(CFG, samples=v), "samples",
                           not_an_int(1, playground.MAX_SAMPLES)),
    "Playground.lr": (lambda v: playground.Playground(CFG, lr=v), "lr",
                      st.one_of(not_a_number(0.0), st.just(0.0))),
    "Playground.seed": (lambda v: playground.Playground(CFG, seed=v), "seed",
                        not_an_int(0, MAX_SEED)),
    "Playground.device": (lambda v: playground.Playground(CFG, device=v), "device",
                          NOT_A_DEVICE),
    # time_model
    "Playground.run.micro_batch_size": (lambda v: PLAYGROUND.run(v, 1), "micro_batch_size",
                                        not_an_int(1, MAX_BATCH)),
    "Playground.run.mode": (lambda v: PLAYGROUND.run(1, 1, v), "mode",
                            not_one_of(PLAYGROUND_MODES)),
    "Playground.run.on_step": (lambda v: PLAYGROUND.run(1, 1, on_step=v), "on_step",
                               given_value(NOT_A_CALLABLE)),
    "Playground.cached.accumulation_steps": (lambda v: PLAYGROUND.cached(1, v),
                                             "accumulation_steps", not_an_int(1, MAX_BATCH)),
    "Playground.cached.mode": (lambda v: PLAYGROUND.cached(1, 1, v), "mode",
                               not_one_of(PLAYGROUND_MODES)),
    "Playground.predict_peak.mode": (lambda v: PLAYGROUND.predict_peak(1, 1, v),
                                     "mode", not_one_of(PLAYGROUND_MODES)),
    # device
    "pick_device.prefer": (lambda v: device.pick_device(v), "prefer",
                           given_value(st.one_of(not_one_of(("cuda", "mps", "cpu")),
                                                 st.lists(st.integers(), max_size=1)))),
    "GPU.name": (_gpu_with("name"), "name", NOT_A_STR),
    "GPU.total_memory": (_gpu_with("total_memory"), "total_memory", not_an_int(1, MAX_BYTES)),
    "GPU.capability": (_gpu_with("capability"), "capability",
                       st.one_of(BOOLS, st.integers(), st.none(), st.just([8, 0]), st.just((8,)),
                                 st.tuples(not_an_int(0, 99), st.just(0)))),
    "GPU.free_memory": (_gpu_with("free_memory"), "free_memory",
                        given_value(not_an_int(0, 2**30))),
    "GPU.live": (_gpu_with("live"), "live", NOT_A_BOOL),
    "live_gpu.device": (lambda v: device.live_gpu(v), "device", NOT_A_CUDA_DEVICE),
    "resolve_gpu.gpu": (lambda v: device.resolve_gpu(v), "gpu", NOT_A_GPU),
    "_cuda_has_native_bf16.device": (lambda v: device._cuda_has_native_bf16(v), "device",
                                    NOT_A_CUDA_DEVICE),
    "pick_dtype.device": (lambda v: device.pick_dtype(v), "device", NOT_A_DEVICE),
    "needs_grad_scaler.dtype": (lambda v: device.needs_grad_scaler(v), "dtype", NOT_A_DTYPE),
    # model_zoo
    **{f"LlamaConfig.{name}": (_llama_with(name), name, not_an_int(1, maximum))
       for name, maximum in zoo.LLAMA_MAXIMUM.items()},
    "LlamaConfig.rope_base": (_llama_with("rope_base"), "rope_base",
                              st.one_of(not_a_number(0.0, zoo.MAX_ROPE_BASE), st.just(0.0))),
    "LlamaConfig.tie_embeddings": (_llama_with("tie_embeddings"), "tie_embeddings", NOT_A_BOOL),
    "build_model.config": (lambda v: zoo.build_model(v), "config", OTHERS),
    "build_model.device": (lambda v: zoo.build_model(CFG, device=v), "device",
                           NOT_A_DEVICE),
    "build_model.dtype": (lambda v: zoo.build_model(CFG, dtype=v), "dtype",
                          st.one_of(OTHERS, st.just(torch.int64), st.just("fp32"))),
    # levers
    "chunked_cross_entropy.chunk_size": (
        lambda v: levers.chunked_cross_entropy(torch.ones(2, 4), torch.ones(3, 4),
                                               torch.zeros(2, dtype=torch.long), v),
        "chunk_size", not_an_int(1, levers.MAX_TOKENS)),
    "chunked_cross_entropy.ignore_index": (
        lambda v: levers.chunked_cross_entropy(torch.ones(2, 4), torch.ones(3, 4),
                                               torch.zeros(2, dtype=torch.long), 1, v),
        "ignore_index", not_an_int(*INT64)),
    "chunked_cross_entropy.hidden": (
        lambda v: levers.chunked_cross_entropy(v, torch.ones(3, 4),
                                               torch.zeros(2, dtype=torch.long), 1),
        "hidden", st.one_of(NOT_A_TENSOR, st.just(torch.ones(2, dtype=torch.long)))),
    "chunked_cross_entropy.targets": (
        lambda v: levers.chunked_cross_entropy(torch.ones(2, 4), torch.ones(3, 4), v, 1),
        "targets", st.one_of(NOT_A_TENSOR, st.just(torch.zeros(2)), st.just(torch.zeros(
            3, dtype=torch.long)))),
    "use_chunked_loss.model": (lambda v: levers.use_chunked_loss(v, 4), "model", OTHERS),
    "use_chunked_loss.chunk_size": (lambda v: levers.use_chunked_loss(MODEL, v), "chunk_size",
                                    given_value(not_an_int(1, levers.MAX_TOKENS))),
    "transfer_seconds.nbytes": (lambda v: time_model.transfer_seconds(v, 1e9), "nbytes",
                                not_an_int(0, MAX_BYTES)),
    "transfer_seconds.bytes_per_second": (lambda v: time_model.transfer_seconds(8, v),
                                          "bytes_per_second",
                                          st.one_of(not_a_number(0.0), st.just(0.0))),
    "optimizer_state_bytes.optimizer": (lambda v: levers.optimizer_state_bytes(v), "optimizer",
                                        OTHERS),
    "low_bit_state_bytes.numels": (lambda v: levers.low_bit_state_bytes(v, 8), "numels",
                                   st.one_of(NOT_A_LIST, st.lists(not_an_int(1, MAX_COUNT),
                                                                  min_size=1, max_size=2))),
    "low_bit_state_bytes.bits": (lambda v: levers.low_bit_state_bytes([8], v), "bits",
                                 st.one_of(BOOLS, NON_FINITE, st.none(),
                                           st.sampled_from([8.0, 4.0, 32.0, 16, 2, "8"]))),
    "low_bit_state_bytes.param_bytes": (lambda v: levers.low_bit_state_bytes([8], 8,
                                                                             param_bytes=v),
                                        "param_bytes", not_an_int(1, 8)),
    "low_bit_adamw.bits": (lambda v: levers.low_bit_adamw(v), "bits",
                           st.one_of(BOOLS, NON_FINITE, st.none(),
                                     st.sampled_from([8.0, 4.0, 32, 16, "8"]))),
    "lora_parameter_count.config": (lambda v: levers.lora_parameter_count(v, 2), "config",
                                    OTHERS),
    "lora_parameter_count.rank": (lambda v: levers.lora_parameter_count(CFG, v), "rank",
                                  not_an_int(1, CFG.d_model)),
    "lora_parameter_count.targets": (
        lambda v: levers.lora_parameter_count(CFG, 2, v), "targets",
        st.one_of(BOOLS, st.integers(), st.none(), st.just(()), st.text(max_size=8),
                  st.lists(st.text(max_size=4), min_size=1, max_size=2))),
    "frozen_linear_flops.n_tokens": (lambda v: levers.frozen_linear_flops(CFG, v), "n_tokens",
                                     not_an_int(1, levers.MAX_TOKENS)),
    # allocator
    "_not_on_cuda.device": (lambda v: allocator._not_on_cuda(v), "device",
                           st.one_of(BOOLS, st.floats(), st.integers(max_value=-1),
                                     st.integers(min_value=1024),
                                     st.lists(st.integers(), max_size=1),
                                     st.sampled_from(["gpu", "cuda:x", "", "tpu0"]))),
    "read.device": (lambda v: allocator._read(v), "device",
                    st.one_of(BOOLS, st.floats(), st.sampled_from(["gpu", "cuda:x", ""]))),
    "Probe.stage.name": (lambda v: PROBE.stage(v), "name",
                         st.one_of(NOT_A_STR, st.text(max_size=4))),
    "probe.expandable_segments": (lambda v: allocator.probe(v), "expandable_segments",
                                  NOT_A_BOOL),
    "probe.device": (lambda v: allocator.probe(device=v), "device",
                     st.one_of(BOOLS, st.floats(), st.none(), st.text(max_size=3),
                               st.integers(max_value=-1))),
    "probe.sizes_mib": (lambda v: allocator.probe(sizes_mib=v), "sizes_mib",
                        st.one_of(NOT_A_LIST, st.just(()),
                                  st.lists(not_an_int(1, allocator.MAX_PROBE_MIB), min_size=1,
                                           max_size=2))),
    "probe.timeout": (lambda v: allocator.probe(timeout=v), "timeout",
                      st.one_of(not_a_number(0.0, allocator.MAX_PROBE_SECONDS), st.just(0))),
    # grading's helpers
    "check.quiet": (lambda v: grading.CHECKS[min(grading.CHECKS)](lambda *a: None, quiet=v),
                    "quiet", NOT_A_BOOL),
}


@pytest.mark.parametrize("case", sorted(CASES))
@SETTINGS
@given(data=st.data())
def test_bad_values_are_refused_naming_the_parameter(case, data):
    call, name, bad = CASES[case]
    refused_naming(call, name, data.draw(bad, label=name))


# --- the values the issue found ----------------------------------------------------------------

@pytest.mark.parametrize("effective_batch", [10**7 * 2, 2**63, 2**24 + 1, 1.5, True, 0])
def test_fit_model_refuses_an_effective_batch_past_its_maximum_at_once(effective_batch):
    with pytest.raises(ValueError, match="effective_batch"):
        fit.fit_model(2**30, effective_batch=effective_batch)


@pytest.mark.parametrize("seed", [1.5, True, -1, 2**63, math.nan, "0"])
def test_fit_build_refuses_a_seed_that_is_not_an_int(seed):
    with pytest.raises(ValueError, match="seed"):
        step_setup.build(CFG, seed=seed)


@pytest.mark.parametrize("point", [(math.nan, 1.0, "n"), (1.0, math.inf, "i"),
                                   (-math.inf, 1.0, "i"), (True, 1.0, "b"), ("1", 1.0, "s")])
def test_pareto_front_refuses_a_point_that_is_not_finite(point):
    with pytest.raises(ValueError, match="points"):
        planner.pareto_front([(1.0, 2.0, "a"), point])


@pytest.mark.parametrize("call", [lambda: step_setup.build(CFG, device="gpu"),
                                  lambda: zoo.build_model(CFG, device="gpu")])
def test_a_device_torch_does_not_know_is_a_value_error_naming_it(call):
    with pytest.raises(ValueError, match="device"):
        call()


# --- good values still work --------------------------------------------------------------------

def _dominated(p, points) -> bool:
    return any(q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)


POINTS = st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.5, 1.0, 1.5, 2.0]),
                            st.sampled_from(["a", "b", "c"])), max_size=10)


@settings(max_examples=40, deadline=None)
@given(points=POINTS, data=st.data())
def test_pareto_front_is_the_non_dominated_points_in_one_order_whatever_the_input_order(points,
                                                                                       data):
    front = planner.pareto_front(points)
    shuffled = data.draw(st.permutations(points))
    assert planner.pareto_front(shuffled) == front
    assert planner.pareto_front(iter(points)) == front  # any iterable
    assert sorted(front) == sorted(p for p in points if not _dominated(p, points))
    assert front == sorted(front)  # memory, then time, then label


def test_pareto_front_orders_ties_by_label_and_keeps_other_labels():
    points = [(1, 1.0, None), (1, 1.0, "b"), (1, 1.0, "a"), (1, 1.0, 3), (2, 0.5, "x")]
    assert planner.pareto_front(points) == [(1, 1.0, "a"), (1, 1.0, "b"), (1, 1.0, 3),
                                            (1, 1.0, None), (2, 0.5, "x")]
    assert planner.pareto_front([(2**70, 1), [1, 2**70]]) == [[1, 2**70], (2**70, 1)]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5000), cap=st.one_of(st.none(), st.integers(1, 5000)))
def test_micro_batches_are_the_divisors_within_the_accumulation_cap(n, cap):
    K = n if cap is None else cap
    assert fit._micro_batches(n, cap) == [d for d in range(1, n + 1) if n % d == 0 and n // d <= K]


@pytest.mark.parametrize("effective_batch", [10**7, fit.MAX_EFFECTIVE_BATCH])
def test_fit_model_takes_a_large_effective_batch(effective_batch):
    # The micro-batches are the divisors, found without walking 1 .. effective_batch.
    space = fit.search_space(seq_len=32, vocab_size=64, widths=[64, 128], depths=[1, 2],
                             head_size=32, aspect_ratio=None)
    result = fit.fit_model(2**40, space=space, effective_batch=effective_batch,
                           max_accumulation_steps=8)
    step = result.step
    assert step.batch_size == effective_batch
    assert effective_batch % step.micro_batch_size == 0 and step.accumulation_steps <= 8


@pytest.mark.parametrize("call", [
    lambda: activations.block_saved(CFG, MAX_BATCH, CFG.seq_len, "bf16", "T4", autocast=True),
    lambda: kernels.allocated(2**70, "H100 80GB"),
    lambda: predict(Step(CFG, MAX_BATCH, MAX_BATCH, every=MAX_COUNT, loss_chunk=MAX_COUNT,
                         mode="blocks", gpu="T4")).total,
    lambda: checkpointing.checkpointed_regions(checkpointing.MAX_LAYERS, "blocks", MAX_COUNT),
    lambda: checkpointing.sqrt_segments(checkpointing.MAX_LAYERS),
    lambda: planner.plan_checkpointing(Step(CFG, 1), MAX_BYTES),
    lambda: predict(Step(CFG, 1, MAX_BATCH, every=MAX_COUNT, loss_chunk=MAX_COUNT, gpu="H200",
                         lora_rank=CFG.d_model, zero_stage=3, world_size=MAX_WORLD_SIZE)).seconds,
    lambda: fit.largest_batch(Step(CFG), MAX_BYTES),
    lambda: step_setup.build(CFG, lr=0, seed=MAX_SEED),
    lambda: playground._effective_batch(MAX_BATCH, 1),
    lambda: device.GPU("big", MAX_BYTES, (99, 99), free_memory=MAX_BYTES),
    lambda: zoo._LlamaConfig(d_ff=zoo.LLAMA_MAXIMUM["d_ff"], rope_base=0.5),
    lambda: time_model.transfer_seconds(MAX_BYTES, 1),
    lambda: levers.low_bit_state_bytes([MAX_COUNT], 4, param_bytes=8),
    lambda: allocator._Reading(allocated=2**70, reserved=2**70, free=0, total=0),
], ids=itertools.count())
def test_the_stated_maxima_are_accepted(call):
    call()


@SETTINGS
@given(n=st.integers(0, 2**40), name=st.sampled_from([None, "cpu", "T4", "H200"]))
def test_allocated_rounds_to_512_bytes_on_a_gpu_only(n, name):
    assert kernels.allocated(n, name) == (n if name in (None, "cpu") else -(-n // 512) * 512)


@SETTINGS
@given(b=st.integers(1, 4), K=st.integers(1, 3), mode=st.sampled_from(engine.MODES),
       gpu=st.sampled_from([None, "T4", "A100 80GB"]))
def test_the_engine_takes_every_good_setting(b, K, mode, gpu):
    step = Step(CFG, b, K, mode=mode, gpu=gpu)
    # the peak holds at least what the backward pass starts from (states, kept activations)
    assert predict(step).total >= engine.floor(step)
    assert planner.candidates(replace(step, accumulation_steps=1))
