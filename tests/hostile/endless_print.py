"""Stopping the class's grading: print without end (the old grader kept 1.4 GB of it at
``--cell-timeout 15``), in a cell of its own and inside an exercise's function. The cell is
interrupted and its output cut (noted); the check that prints without end times out."""

CODE = '''
while True:
    print("x" * 10000)
'''
CELLS = [("after_imports", CODE), ("body:pick_training_dtype", CODE)]
SOLVE = ("tensor_nbytes",)
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "timeout"}
NOTES = ("output cut in cells", "interrupted at the cell time limit")
