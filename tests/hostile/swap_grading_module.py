"""Full marks without solving: put a fake module in ``sys.modules["course_lib.grading"]`` (and
on ``course_lib.grading``) whose every ``check_*`` prints ✓ and returns True."""

CODE = '''
import sys
import types

import course_lib


class _Fake(types.ModuleType):
    def __getattr__(self, name):
        def check(*args, **kwargs):
            print(f"✓ {name[6:]}: passed.")
            return True
        return check


_fake = _Fake("course_lib.grading")
_fake.CHECKS = {}
sys.modules["course_lib.grading"] = _fake
course_lib.grading = _fake
grading = _fake
'''
CELLS = [("after_imports", CODE), ("exercise", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}
