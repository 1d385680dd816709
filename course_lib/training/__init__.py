"""Training: the ways to train the model, each a tool a learner applies.

Its modules, in the order they build on one another (a module imports only the ones above it
here, the top modules of :mod:`course_lib` and the wings above this one):

====================  ==============================================================================
``mixed_precision``   01: AdamW on fp32 master weights of a 16-bit model
``accumulation``      03: gradient accumulation and its bugs
``loop``              03-07: the shared training loop (accumulation, AMP, no_sync)
``checkpointing``     04-05: the checkpointing modes and segment counts, applied to a model
``policies``          05: op-level selective-checkpointing policies and what they really keep
``levers``            08: the chunked loss, low-bit optimizer states, LoRA's parameters and FLOPs
====================  ==============================================================================
"""
