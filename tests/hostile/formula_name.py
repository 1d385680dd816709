"""CSV: a file name that a spreadsheet runs as a formula (``=1+1+cmd|calc!A0.ipynb``). The
cell is written as text, behind a ``'``."""

CELLS = []
SOLVE = ("tensor_nbytes",)
FOLDER = ""
FILENAME = "=1+1+cmd|calc!A0.ipynb"
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "not done"}
