"""Full marks without solving: find the solutions notebook (next to ``course_lib``, at the
course's known path, through ``course_lib.authoring.ROOT``, anywhere near ``/``) and exec its
solution cells, from a cell of its own and from the exercise cells."""

CODE = '''
import json as _json
import os as _os
import pathlib as _pathlib

import course_lib as _course_lib

_roots = [_pathlib.Path(_course_lib.__file__).resolve().parents[1], _pathlib.Path("@@COURSE@@")]
try:
    from course_lib import authoring as _authoring
    _roots.append(_authoring.ROOT)
except ImportError:
    pass
for _top in ("/", "/work", "/root", "/home", "/tmp", "/course", "/job", "/grader"):
    for _folder, _dirs, _files in _os.walk(_top):
        if _folder.count("/") > 4 or _folder.startswith(("/proc", "/sys", "/usr", "/dev")):
            _dirs[:] = []
        if _os.path.basename(_folder) == "solutions":
            _roots.append(_pathlib.Path(_folder).parent)
for _root in _roots:
    try:
        _nb = _json.loads((_root / "solutions" / "00_setup.ipynb").read_text())
    except (OSError, ValueError):
        continue
    for _cell in _nb["cells"]:
        _source = "".join(_cell["source"])
        if _cell["cell_type"] == "code" and "BEGIN SOLUTION" in _source:
            exec(_source, globals())
'''
CELLS = [("after_imports", CODE), ("exercise", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}
