"""Several devices: ranks on one machine and the workers of lecture 07.

Each module imports only the ones above it, the top modules and the wings above this one:

====================  ==============================================================================
``ranks``             07: start N ranks on gloo and collect their results
``workers``           07: the workers of lecture 07: DDP ``no_sync``, sharded states
====================  ==============================================================================
"""
