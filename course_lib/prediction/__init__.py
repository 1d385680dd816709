"""Prediction: what a step will hold and how long it will take, before it runs.

Its modules, in the order they build on one another (a module imports only the ones above it
here, the top modules of :mod:`course_lib` and the wings above this one):

====================  ==============================================================================
``formulas``          01-07: the precisions; the analytic bytes of training, ZeRO-3 during a step
``step``              02-08: one training step as a value (``Step``), made and checked once
``activations``       02: the course GPT's saved activations, op by op, on the CPU or a GPU
``checkpointed``      04-05: what a checkpointed step keeps and recomputes; its FLOPs
``engine``            02-06: the memory engine: one step's peak bytes, any precision, any target
``step_setup``        02-08: the real model and optimizer a prediction is for; its measured step
``time_model``        03-08: the one time model of a step: FLOPs, bytes, operators, transfers
``predict``           02-08: ``predict(step)``: a step's memory by moment and category, and its time
====================  ==============================================================================
"""
