"""Full marks without solving: return objects that equal anything (``__eq__`` always True: an
object of its own, an ``int`` subclass), so that ``got == truth`` holds in every check. The
checks refuse results made of classes the notebook defined."""

EQUAL = '''
class _Equal(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


return _Equal(0)
'''
ANYTHING = '''
class _Anything:
    def __eq__(self, other):
        return True


return (_Anything(),)[0]
'''
CELLS = [("body:tensor_nbytes", EQUAL), ("body:pick_training_dtype", ANYTHING)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "failed", "pick_training_dtype": "failed"}
NOTES = ("class defined in the notebook (_Equal)", "class defined in the notebook (_Anything)")
