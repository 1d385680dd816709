"""Stopping the class's grading: SIGSTOP to the parent (the old grader's runner) and to every
process it can see. Its notebook's run stops (noted); its checks run in a fresh sandbox and
score its real answers."""

CODE = '''
import os as _os
import signal as _signal

for _pid in [p for p in _os.listdir("/proc") if p.isdigit()] + [str(_os.getppid()), "1"]:
    if int(_pid) != _os.getpid():
        try:
            _os.kill(int(_pid), _signal.SIGSTOP)
        except OSError:
            pass
'''
CELLS = [("after_imports", CODE)]
SOLVE = ("tensor_nbytes",)
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "not done"}
NOTES = ("run: stopped at cell",)
