"""Stopping the class's grading: replace every file the grader might read (``progress.json``
of the old grader, the run's notebook and job, the scores) with a named pipe, so that a reader
blocks forever (the old grader did, past ``--timeout``, and wrote no CSV for anyone)."""

CODE = '''
import os as _os

for _folder in (_os.getcwd(), "/tmp", _os.path.expanduser("~"), "/job", "@@SUBMISSIONS@@"):
    for _name in ("progress.json", "executed.ipynb", "graded.ipynb", "runner.log", "job.json",
                  "notebook.ipynb", "scores.csv"):
        _path = _os.path.join(_folder, _name)
        try:
            _os.unlink(_path)
        except OSError:
            pass
        try:
            _os.mkfifo(_path)
        except OSError:
            pass
try:
    _os.unlink("@@SCORES@@")
    _os.mkfifo("@@SCORES@@")
except OSError:
    pass
'''
CELLS = [("after_imports", CODE), ("exercise", CODE)]
SOLVE = ("tensor_nbytes",)
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "not done"}
