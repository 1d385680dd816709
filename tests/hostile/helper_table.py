"""A correct learner (issue 20): the bytes per element kept in a table in a cell of its own
(its keys are torch dtypes, not literals), used by the exercise. The grader defines the
notebook's assignments, as the notebook does: 2/2 (the old grader scored 1/2, NameError)."""

TABLE = '''
BYTES_PER_ELEMENT = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8,
                     torch.int8: 1, torch.int16: 2, torch.int32: 4, torch.int64: 8,
                     torch.uint8: 1, torch.bool: 1, torch.complex64: 8}
'''
BODY = '''
count = 1
for n in shape:
    count *= n
return count * BYTES_PER_ELEMENT[dtype]
'''
CELLS = [("after_imports", TABLE), ("body:tensor_nbytes", BODY)]
SOLVE = ("pick_training_dtype",)
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "passed"}
