"""Full marks without solving, from inside its own function (which the check must call): make
the check's ``expect`` (and ``torch.equal``) accept anything, then return a wrong answer. The
check runs in a process of its own, which the learner's code cannot reach: "failed", 0."""

CODE = '''
import sys

import torch

for _name, _module in list(sys.modules.items()):
    if _name.startswith("course_lib.grading") and hasattr(_module, "expect"):
        _module.expect = lambda *args, **kwargs: None
torch.equal = lambda *args, **kwargs: True
return 0
'''
CELLS = [("body:tensor_nbytes", CODE)]
SOLVE = ("pick_training_dtype",)
EXPECTED = {"tensor_nbytes": "failed", "pick_training_dtype": "passed"}
NOTES = ("tensor_nbytes((2, 3), torch.float32) returned 0, expected 24",)
