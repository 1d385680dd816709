"""Companion package of the course "Training bigger models on smaller GPUs".

One module per idea, in lecture order:

=====================  =========================================================
``device``             00: which device and training dtype this kernel uses
``units``              byte counts and their human-readable form
``memory``             01: analytic bytes of params, grads, optimizer, activations
``model_zoo``          01: GPT-2 and Llama presets, counted on the ``meta`` device
``models``             01-06: the course GPT (nanoGPT-style) and small MLPs
``measure``            02: peak memory, saved tensors, categorised breakdowns
``accumulation``       03: gradient accumulation and its bugs
``checkpointing``      04-05: activation checkpointing modes and the planner
``widgets``            thin ipywidgets views over the pure functions above
``grading``            the checks of the graded exercises
``authoring``          maintainers: generate exercises/, refresh outputs
=====================  =========================================================
"""

__version__ = "0.1.0"

#: GitHub ``owner/name`` of the course; Colab badges and the bootstrap cell use it.
COURSE_REPO = "bigger-models-smaller-gpus/course"
