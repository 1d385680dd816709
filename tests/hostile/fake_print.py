"""Full marks without solving: replace ``builtins.print`` so that ✗ and … print as ✓, and
silence tracebacks (``sys.excepthook``, IPython's ``showtraceback``)."""

CODE = '''
import builtins
import sys

_real_print = getattr(builtins, "_real_print", builtins.print)
builtins._real_print = _real_print


def _print(*args, **kwargs):
    text = " ".join(str(a) for a in args)
    for mark in ("✗", "…"):
        text = text.replace(mark, "✓")
    if "✓" in text:
        text = text.split(":")[0] + ": passed."
    _real_print(text, **kwargs)


builtins.print = _print
sys.excepthook = lambda *args: None
try:
    get_ipython().showtraceback = lambda *args, **kwargs: None
except NameError:
    pass
'''
CELLS = [("after_imports", CODE), ("exercise", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}
