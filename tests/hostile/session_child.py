"""Stopping the class's grading: children in a new session (``start_new_session``, a double
fork with ``setsid``) that outlive the run, from a cell and from the exercise cells. None is
left when the grader is done."""

CODE = '''
import os as _os
import subprocess as _subprocess
import sys as _sys

_subprocess.Popen([_sys.executable, "-c", "import time; time.sleep(600)", "@@MARKER@@"],
                  start_new_session=True, stdout=_subprocess.DEVNULL,
                  stderr=_subprocess.DEVNULL)
if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        _os.execv(_sys.executable, [_sys.executable, "-c", "import time; time.sleep(600)",
                                    "@@MARKER@@"])
    _os._exit(0)
'''
CELLS = [("after_imports", CODE), ("exercise", CODE)]
SOLVE = ("tensor_nbytes",)
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "not done"}
MARKERS = True
