"""Several devices: ranks on one machine and the workers of lecture 07.

Its modules, in the order they build on one another (a module imports only the ones above it
here, the top modules of :mod:`course_lib` and the wings above this one):

====================  ==============================================================================
``ranks``             07: start N ranks on gloo and collect their results
``workers``           07: the workers of lecture 07: DDP ``no_sync``, sharded states
====================  ==============================================================================
"""
