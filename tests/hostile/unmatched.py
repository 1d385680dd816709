"""Full marks without solving: a notebook that solutions/ cannot match (no course metadata, no
nbgrader metadata, another name, none of the released text), whose own check cells claim 100
points each and print ✓. It scores 0, and the notes say why (``--grade-unmatched`` would grade
it as the assignment whose checks its cells call, at that assignment's points)."""

CELLS = [("end", 'print("✓ tensor_nbytes: passed.")')]
SOLVE = ("tensor_nbytes", "pick_training_dtype")
FILENAME = "homework.ipynb"
EXPECTED = {}
PROBLEM = "no notebook of solutions/ matches it"


def EDIT(nb):
    nb.metadata.pop("course", None)
    nb.cells = [c for c in nb.cells if c.cell_type == "code"]
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
        if "grading.check_" in cell.source:
            cell.source += "  # my own check, 100 points"
            cell.metadata["nbgrader"] = {"grade": True, "points": 100, "grade_id": "mine"}
