"""Marks for a wrong answer (issue 20): patch ``torch.UntypedStorage.nbytes``, from which the
check measures its truth, so that it agrees with the wrong answer 7, and put a fake module in
``sys.modules`` for a course module a check might import later. The truth is measured in the
check's own process: failed."""

CODE = '''
import sys
import types

import torch

torch.UntypedStorage.nbytes = lambda self: 7
_fake = types.ModuleType("course_lib.training.policies")
_fake.policy_cost = lambda *args, **kwargs: None
sys.modules["course_lib.training.policies"] = _fake
sys.modules["course_lib.grading.lecture00"] = _fake
return 7
'''
CELLS = [("body:tensor_nbytes", CODE)]
SOLVE = ("pick_training_dtype",)
EXPECTED = {"tensor_nbytes": "failed", "pick_training_dtype": "passed"}
NOTES = ("returned 7, expected 24",)
