"""Companion package of the course "Training bigger models on smaller GPUs".

One module per idea, in lecture order:

=====================  =========================================================
``device``             00: which device and training dtype this kernel uses
``units``              byte counts and their human-readable form
``validation``         the shared input checks (``ValueError`` naming the parameter)
``kernels``            02-06: which attention kernel, dtypes and block sizes PyTorch uses where
``memory``             01: analytic bytes of params, grads, optimizer, activations
``model_zoo``          01: GPT-2 and Llama presets, counted on the ``meta`` device
``models``             01-07: the course GPT (nanoGPT-style), its parameter count, token data
``activations``        02: the course GPT's saved activations, op by op, on the CPU or a GPU
``measure``            02: peak memory, saved tensors, categorised breakdowns
``accumulation``       03: gradient accumulation and its bugs
``toy_data``           03: a toy language with a known loss floor, to train on
``training``           03-07: the shared training loop (accumulation, AMP, no_sync)
``playground``         03: the accumulation playground; one step's cost, memory and time
``step_views``         03: the trade-off explorer and the step-through of one step
``checkpointing``      04: five checkpointing modes; kept bytes and FLOPs predicted
``engine``             02-06: the memory engine: one step's peak bytes, any precision, any target
``policies``           05: op-level selective-checkpointing policies and their cost
``planner``            05: the cheapest checkpointing policy that fits a memory budget
``fit``                06, 08: the largest GPT that trains within a budget; the guard; the fit ladder
``memory_timeline``    04: memory over one step (CUDA snapshots, or the tracker elsewhere)
``allocator``          06: what nvidia-smi shows beside the prediction (cache, context, cuBLAS)
``ranks``              07: start N ranks on gloo and collect their results
``distributed``        07: the workers of lecture 07: DDP ``no_sync``, sharded states
``levers``             08: optimizer in backward, chunked loss, offloading, low-bit states, LoRA
``widgets``            thin ipywidgets views over the pure functions above
``grading``            the checks of the graded exercises
=====================  =========================================================

This package is the learner's runtime (what Colab pip-installs). The instructor's and the
maintainer's tools (the exercise generator, the sandboxed grader) are ``course_tools``, run
from a checkout of the course.
"""

__version__ = "0.1.0"

#: GitHub ``owner/name`` of the course; Colab badges and the bootstrap cell use it.
COURSE_REPO = "bigger-models-smaller-gpus/course"
