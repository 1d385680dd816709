"""Companion package of the course "Training bigger models on smaller GPUs".

Four modules at the top, which the whole package uses, then one wing (a subpackage) per concern,
in the order they build on one another. A module imports only the top modules above it, the
wings above its own, and the modules above it in its wing's index (each wing's ``__init__``);
``tests/test_repo.py`` checks it, function bodies included:

=====================  ==========================================================================
``validation``         all: the shared input checks (``ValueError`` naming the parameter)
``units``              all: byte counts (of distinct storages too) and their human-readable form
``claims``             01-08: a claim, the lecture's measurement of it, and the verdict
``device``             00: which device and training dtype this kernel uses; the GPU presets
``model``              the course GPT, its presets, its toy data, and how PyTorch runs it
``measurement``        what a step really holds and how long it really takes
``training``           the ways to train: precision, the loop, accumulation, checkpointing, levers
``distributed``        07: several devices: ranks on gloo and the lecture's workers
``prediction``         what a step will hold and take: states, activations, the engine, the time model
``planning``           the choices that make a model fit: the planner, the fit, the guard, the ladder
``views``              each lecture's figures and widgets, thin views over the wings above
``grading``            all: the checks of the graded exercises
=====================  ==========================================================================

The code behind each lecture, as its notebooks import it (``tests/test_repo.py`` checks this
table against the notebooks):

======  ==========================================================================================
lecture modules its notebooks import (the lecture, its companion, its exercises)
======  ==========================================================================================
00      device, grading, units, views.widgets
01      claims, device, grading, measurement.memory, model.gpt, model.zoo, prediction.formulas,
        training.mixed_precision, units, views.calculator
02      claims, device, grading, measurement.memory, model.gpt, model.kernels,
        prediction.activations, prediction.engine, prediction.formulas, prediction.predict,
        prediction.step_setup, units, views.activation_views
03      claims, device, grading, measurement.memory, measurement.timing, model.gpt,
        model.toy_data, model.zoo, prediction.predict, prediction.time_model, training.loop,
        units, views.playground, views.step_views
04      claims, device, grading, measurement.memory, measurement.timeline, measurement.timing,
        model.gpt, prediction.checkpointed, prediction.predict, training.checkpointing,
        training.loop, units, views.checkpoint_views
05      claims, device, grading, measurement.memory, measurement.timing, model.fused, model.gpt,
        model.kernels, planning.planner, prediction.activations, prediction.checkpointed,
        prediction.formulas, prediction.predict, prediction.step_setup, prediction.time_model,
        training.checkpointing, training.loop, training.policies, units, views.policy_views
06      claims, device, grading, measurement.allocator, measurement.memory, measurement.timeline,
        model.gpt, model.toy_data, planning.fit, planning.guard, prediction.formulas,
        prediction.predict, prediction.step_setup, training.checkpointing, training.loop, units,
        views.fit_views
07      claims, distributed.ranks, distributed.workers, grading, model.gpt, prediction.formulas,
        units
08      claims, device, grading, measurement.memory, measurement.timing, model.gpt,
        model.toy_data, planning.fit_ladder, prediction.activations, prediction.checkpointed,
        prediction.predict, prediction.step_setup, prediction.time_model, training.levers,
        training.loop, units, views.ladder_view
======  ==========================================================================================

This package is the learner's runtime (what Colab pip-installs). The instructor's and the
maintainer's tools (the exercise generator, the sandboxed grader) are ``course_tools``, run
from a checkout of the course.
"""

__version__ = "0.1.0"

#: GitHub ``owner/name`` of the course; Colab badges and the bootstrap cell use it.
COURSE_REPO = "bigger-models-smaller-gpus/course"
