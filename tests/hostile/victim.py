"""Not an attack: a solved notebook that ``edit_victim`` tries to change. It keeps 2/2."""

CELLS = []
SOLVE = ("tensor_nbytes", "pick_training_dtype")
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "passed"}
