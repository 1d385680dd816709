"""The model: the course GPT, its presets, its toy data, and how PyTorch runs it.

Each module imports only the ones above it, the top modules and the wings above this one:

====================  ==============================================================================
``fused``             05: the course's own Triton kernels (bias-dropout-add, bias + GELU), one op to a policy
``gpt``               01-08: the course GPT (nanoGPT-style), its parameter count, token data
``zoo``               01: GPT-2 and Llama presets, counted on the ``meta`` device
``toy_data``          03: a toy language with a known loss floor, to train on
``kernels``           02-06: which attention kernel, dtypes and block sizes PyTorch uses where
====================  ==============================================================================
"""
