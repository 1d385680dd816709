"""Measurement: what a step really holds and how long it really takes.

Its modules, in the order they build on one another (a module imports only the ones above it
here, the top modules of :mod:`course_lib` and the wings above this one):

====================  ==============================================================================
``memory``            02: peak memory, saved tensors, categorised breakdowns
``timing``            03-05: step times, warmed up, synchronized and interleaved
``timeline``          04: memory over one step (CUDA snapshots, or the tracker elsewhere)
``allocator``         06: what nvidia-smi shows beside the prediction (cache, context, cuBLAS)
====================  ==============================================================================
"""
