"""Companion package of the course "Training bigger models on smaller GPUs".

One module per idea, in lecture order. A module imports only modules above it in this table
(``tests/test_repo.py`` checks it), so where an early lecture's view needs a later tool (the
trade-off explorer of lecture 03 predicts checkpointing), it sits below that tool, with its
lecture named:

=====================  =========================================================
``validation``         the shared input checks (``ValueError`` naming the parameter)
``docstrings``         docstring pieces that several functions share, written once
``units``              byte counts (of distinct storages too) and their human-readable form
``claims``             01-07: a claim, the lecture's measurement of it, and the verdict
``device``             00: which device and training dtype this kernel uses; the GPU presets
``fused``              05: the course's own Triton kernel (bias + GELU), one op to a policy
``models``             01-08: the course GPT (nanoGPT-style), its parameter count, token data
``model_zoo``          01: GPT-2 and Llama presets, counted on the ``meta`` device
``memory``             01: the precisions; analytic bytes of params, grads, optimizer, activations
``mixed_precision``    01: AdamW on fp32 master weights of a 16-bit model
``kernels``            02-06: which attention kernel, dtypes and block sizes PyTorch uses where
``activations``        02: the course GPT's saved activations, op by op, on the CPU or a GPU
``measure``            02: peak memory, saved tensors, categorised breakdowns
``timing``             03-05: step times, warmed up, synchronized and interleaved
``accumulation``       03: gradient accumulation and its bugs
``toy_data``           03: a toy language with a known loss floor, to train on
``training``           03-07: the shared training loop (accumulation, AMP, no_sync)
``widgets``            01-08: ``live_plot``, the thin ipywidgets view every widget uses
``calculator``         01: the model states against GPU memory: lecture 01's figures and calculator
``checkpointing``      04-05: the checkpointing modes; kept bytes, FLOPs, segment counts
``memory_timeline``    04: memory over one step (CUDA snapshots, or the tracker elsewhere)
``engine``             02-06: the memory engine: one step's peak bytes, any precision, any target
``checkpoint_views``   04: the lecture's figures and its explorer (memory and compute bars)
``step_setup``         02-08: the real model and optimizer a prediction is for; its measured step
``time_model``         03-08: the one time model of a step: FLOPs, bytes, operators, transfers
``activation_views``   02: lecture 02's figures and its out-of-memory widget
``playground``         03: the accumulation playground; one step's cost, memory and time
``step_views``         03: the trade-off explorer, the step-through of one step, the playground view
``policies``           05: op-level selective-checkpointing policies and their cost
``planner``            05: the fastest checkpointing policy (predicted) that fits a memory budget
``policy_views``       05: the figures of lecture 05 and its planner widget
``fit``                06: the largest GPT, or the largest batch, that trains within a budget
``guard``              06: a budget checked before a step runs and enforced while it runs
``allocator``          06: what nvidia-smi shows beside the prediction (cache, context, cuBLAS)
``fit_views``          06: a step's memory by category against a budget; the GPU explorer
``ranks``              07: start N ranks on gloo and collect their results
``distributed``        07: the workers of lecture 07: DDP ``no_sync``, sharded states
``levers``             08: optimizer in backward, chunked loss, offloading, low-bit states, LoRA
``fit_ladder``         08: every lever for one model and one GPU, ranked; the mix that fits
``ladder_view``        08: where a step's bytes are, and the fit ladder's chart and widget
``grading``            the checks of the graded exercises
=====================  =========================================================

This package is the learner's runtime (what Colab pip-installs). The instructor's and the
maintainer's tools (the exercise generator, the sandboxed grader) are ``course_tools``, run
from a checkout of the course.
"""

__version__ = "0.1.0"

#: GitHub ``owner/name`` of the course; Colab badges and the bootstrap cell use it.
COURSE_REPO = "bigger-models-smaller-gpus/course"
