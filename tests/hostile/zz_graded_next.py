"""Not an attack: an unsolved notebook graded after ``rewrite_course_lib`` (the old grader gave
it full marks, from the rewritten course_lib)."""

CELLS = []
SOLVE = ()
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}
