import pytest

from course_lib import grading
from course_lib.grading import CHECKS, expect, grader


@grader
def check_double(fn):
    expect(fn(2) == 4, f"double(2) returned {fn(2)!r}", hint="multiply by two")


CHECKS.pop("check_double")  # a test's own check, not one of the course's


def test_pass_fail_todo_and_crash_are_reported_never_raised(capsys):
    def stub(x):
        raise NotImplementedError("Exercise: replace this line with your code")

    assert check_double(lambda x: 2 * x) is True
    assert "✓ double: passed" in capsys.readouterr().out
    assert check_double(lambda x: x + 1) is False  # 2 + 1 == 3
    out = capsys.readouterr().out
    assert "✗ double" in out and "Hint: multiply by two" in out
    assert check_double(stub) is False
    assert "not done yet" in capsys.readouterr().out
    assert check_double(lambda x: 1 / 0) is False
    assert "ZeroDivisionError" in capsys.readouterr().out
    assert check_double(lambda x: x * 2, quiet=True) is True
    assert capsys.readouterr().out == ""


def test_a_wrong_type_fails_instead_of_raising(capsys):
    assert check_double(lambda x: None) is False
    assert check_double(None) is False  # not even callable
    assert "TypeError" in capsys.readouterr().out


def test_lecture_checks_are_registered_and_exported():
    assert "check_tensor_nbytes" in CHECKS
    assert grading.check_tensor_nbytes is CHECKS["check_tensor_nbytes"]
    for name, check in CHECKS.items():
        assert check.is_check and name.startswith("check_")


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_check_has_a_docstring(name):
    assert CHECKS[name].__doc__, f"{name} needs a docstring saying what it expects"


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def _exits(x):
    exit(3)


def _unprintable(x):
    raise _Unprintable()


def _surrogate(x):
    raise ValueError("\ud800")


@pytest.mark.parametrize("fn, shown", [(_exits, "SystemExit: 3"),
                                       (_unprintable, "_Unprintable: <its message could not"),
                                       (_surrogate, "ValueError: \\ud800")])
def test_no_learner_exception_escapes_a_check(capsys, fn, shown):
    assert check_double(fn) is False
    out = capsys.readouterr().out
    assert shown in out and "✗ double" in out


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_course_check_keeps_exit_and_a_broken_exception_inside(name, capsys):
    """All the course's checks: a learner function that calls exit() or raises an exception
    whose __str__ fails gets a False, never an exception out of the check."""
    def hostile(*args, **kwargs):
        raise _Unprintable()

    for fn in (_exits, hostile):
        assert CHECKS[name](fn, quiet=True) is False
