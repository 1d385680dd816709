"""The exercise round trip: exercises/ is generated from solutions/ and is up to date;
every check accepts the solution, rejects the unfilled stub and typical wrong answers."""

import pytest
from notebook_tools import EXERCISES, ROOT, SOLUTIONS, check_calls, definitions
from wrong_answers import WRONG

from course_lib import grading
from course_tools import authoring

CALLS = [(path.name, name, args) for path in SOLUTIONS for name, args in check_calls(path)]


def test_every_solution_has_an_exercise_and_checks():
    assert SOLUTIONS, "solutions/ holds no notebook"
    assert [p.name for p in SOLUTIONS] == [p.name for p in EXERCISES]
    for path in SOLUTIONS:
        assert check_calls(path), f"{path.name} has no check cell"


def test_exercises_are_not_stale():
    stale = authoring.generate(ROOT / "solutions", ROOT / "exercises", write=False)
    assert not stale, f"run `make exercises`: stale {[str(p) for p in stale]}"


@pytest.mark.parametrize("notebook,check,args", CALLS, ids=[f"{n}:{c}" for n, c, _ in CALLS])
def test_check_accepts_solution_and_rejects_stub(notebook, check, args):
    solution = definitions(ROOT / "solutions" / notebook)
    exercise = definitions(ROOT / "exercises" / notebook)
    fn = grading.CHECKS[check]
    assert fn(*[solution[a] for a in args], quiet=True), f"{check} rejects the solution"
    assert not fn(*[exercise[a] for a in args], quiet=True), f"{check} accepts the unfilled stub"


@pytest.mark.parametrize("notebook,check,args", CALLS, ids=[f"{n}:{c}" for n, c, _ in CALLS])
def test_check_rejects_typical_wrong_answers(notebook, check, args):
    assert WRONG.get(check), f"tests/wrong_answers/ lists no wrong answer for {check}"
    solution = definitions(ROOT / "solutions" / notebook)
    for mistake, replaced in WRONG[check]:
        values = [replaced.get(a, solution[a]) for a in args]
        assert not grading.CHECKS[check](*values, quiet=True), f"{check} accepts: {mistake}"


def test_every_registered_check_is_used_by_a_notebook():
    used = {check for _, check, _ in CALLS}
    assert set(grading.CHECKS) == used


def test_stub_prints_not_done_yet(capsys):
    exercise = definitions(EXERCISES[0])
    name, args = check_calls(EXERCISES[0])[0]
    grading.CHECKS[name](*[exercise[a] for a in args])
    assert "not done yet" in capsys.readouterr().out
