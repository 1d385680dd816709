"""Planning: the choices that make a model fit, made from the predictions.

Each module imports only the ones above it, the top modules and the wings above this one:

====================  ==============================================================================
``planner``           05: the fastest checkpointing policy (predicted) that fits a memory budget
``fit``               06: the largest GPT, or batch, within a budget; the fastest setting that fits
``guard``             06: a memory budget enforced while a step runs
``fit_ladder``        08: every lever for one model and one GPU, ranked; the mix that fits
====================  ==============================================================================
"""
