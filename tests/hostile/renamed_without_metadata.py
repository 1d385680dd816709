"""Full marks without solving: delete ``metadata.course.generated_from``, rename the file, give
each check cell 100 points and print ✓ in them (the old grader then graded printed output with
the learner's points: 100/100). Its cells still carry their grade ids, so it is matched with
00_setup.ipynb and graded on its real answers, at the points of solutions/."""

CODE = '''
print("✓ tensor_nbytes: passed.")
print("✓ pick_training_dtype: passed.")
'''
CELLS = [("end", CODE)]
SOLVE = ()
FILENAME = "my_homework.ipynb"
EXPECTED = {"tensor_nbytes": "not done", "pick_training_dtype": "not done"}


def EDIT(nb):
    del nb.metadata["course"]["generated_from"]
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader")
        if meta and meta.get("grade"):
            meta["points"] = 100
