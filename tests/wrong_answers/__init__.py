"""Typical wrong answers to each exercise: every check must reject every one of them.

One module per lecture (``lecture00.py`` ...), each defining ``WRONG``: check name ->
list of ``(what the mistake is, {argument name: wrong function})``; arguments not
named keep the solution's function. They are merged here.
"""

import importlib
import pkgutil

WRONG: dict = {}
for _info in pkgutil.iter_modules(__path__):
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _check, _answers in _module.WRONG.items():
        WRONG.setdefault(_check, []).extend(_answers)
