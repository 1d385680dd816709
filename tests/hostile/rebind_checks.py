"""Full marks without solving: rebind ``course_lib.grading.check_*`` (the package's names, the
lecture modules' names and the ``CHECKS`` registry) to functions that print ✓ and return True,
from a cell of its own and from the exercise cells."""

CODE = '''
import sys

import course_lib.grading as _grading


def _always(*args, **kwargs):
    print("✓ tensor_nbytes: passed.")
    print("✓ pick_training_dtype: passed.")
    return True


for _name in list(_grading.CHECKS):
    _grading.CHECKS[_name] = _always
    for _module in [m for n, m in list(sys.modules.items()) if n.startswith("course_lib.grading")]:
        if hasattr(_module, _name):
            setattr(_module, _name, _always)
grading = _grading
'''
CELLS = [("after_imports", CODE), ("exercise", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}
