"""Full marks without solving (issue 20): answers that lie about their value. An object array
of ``mock.ANY`` (equal to anything), a ``functools.partial`` in place of the function (only
plain notebook functions used to be vetted), a class of the notebook registered into
``collections`` under a library module's name, wrapped in a ``torch.return_types`` structseq and
nested below the depth the old filter looked at. Only plain values cross to the check: each is
refused, and the check fails."""

CODE = '''
import collections
import functools
from unittest import mock

import numpy as np
import torch


class _Equal:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


_Equal.__module__ = "collections"
_Equal.__qualname__ = "_Equal"
collections._Equal = _Equal


def _lie(*args, **kwargs):
    return np.array(mock.ANY, dtype=object)


def _deep(*args, **kwargs):
    inner = torch.return_types.max((_Equal(), _Equal()))
    return [[[[[[inner]]]]]][0][0][0][0][0][0][0]


tensor_nbytes = functools.partial(_lie)
pick_training_dtype = functools.partial(_deep)
'''
CELLS = [("exercise", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "failed", "pick_training_dtype": "failed"}
NOTES = ("numpy array of dtype object", "returned an object of type collections._Equal")
