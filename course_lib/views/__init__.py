"""Views: each lecture's figures and widgets, thin views over the wings above.

Each module imports only the ones above it, the top modules and the wings above this one:

====================  ==============================================================================
``widgets``           01-08: ``live_plot``, the thin ipywidgets view every widget uses
``calculator``        01: the model states against GPU memory: lecture 01's figures and calculator
``activation_views``  02: lecture 02's figures and its out-of-memory widget
``checkpoint_views``  04: the lecture's figures and its explorer (memory and compute bars)
``playground``        03: the accumulation playground; one step's cost, memory and time
``step_views``        03: the trade-off explorer, the step-through of one step, the playground view
``policy_views``      05: the figures of lecture 05 and its planner widget
``fit_views``         06: a step's memory by category against a budget; the GPU explorer
``ladder_view``       08: where a step's bytes are, and the fit ladder's chart and widget
====================  ==============================================================================
"""
