"""Full marks without solving (issue 20): the exercise cells reach into the checks' own code
objects: a check wrapper's closure cell (``body``) gets a body that does nothing, and a check
body's ``__code__`` is replaced, the stubs left as released. The checks run in a process where
no learner code has run: neither change reaches them, the stubs are "not done"."""

CODE = '''
import course_lib.grading as _grading
from course_lib.grading import lecture00 as _lecture


def _nothing(*args, **kwargs):
    return None


for _check in (_grading.check_tensor_nbytes, _grading.CHECKS["check_tensor_nbytes"]):
    for _cell in _check.__closure__ or ():
        if callable(_cell.cell_contents) and getattr(_cell.cell_contents, "__name__", "") \\
                .startswith("check_"):
            _cell.cell_contents = _nothing
_lecture.check_pick_training_dtype.__wrapped__.__code__ = _nothing.__code__
'''
CELLS = [("exercise", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}
