"""Harm to others: write outside its temporary folder: into the course, the submissions, the
grader's machine's temporary folder, the root."""

CODE = '''
import os as _os

for _path in ("@@COURSE@@/owned.txt", "@@COURSE@@/solutions/owned.ipynb",
              "@@SUBMISSIONS@@/owned.ipynb", "@@HOSTTMP@@/owned-@@MARKER@@", "/owned",
              "/usr/owned", "/course/owned", "/job/owned"):
    try:
        _os.makedirs(_os.path.dirname(_path), exist_ok=True)
        with open(_path, "w") as _f:
            _f.write("owned")
    except OSError:
        pass
'''
CELLS = [("after_imports", CODE), ("exercise", CODE)]
SOLVE = ("tensor_nbytes",)
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "not done"}
OUTSIDE = ("@@COURSE@@/owned.txt", "@@COURSE@@/solutions/owned.ipynb",
           "@@SUBMISSIONS@@/owned.ipynb", "@@HOSTTMP@@/owned-@@MARKER@@")
