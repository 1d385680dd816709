"""CSV: a check of its own, named ``submission`` (the old grader added it as a second
``submission`` column). Checks and their columns come from solutions/ only."""

CODE = '''
@grading.grader
def check_submission(fn):
    pass


grading.check_submission(tensor_nbytes)
'''
CELLS = [("end", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}
