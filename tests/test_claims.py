"""course_lib.claims: the layout, and a verdict that its measurement contradicts fails."""

import pytest

from course_lib.claims import Claim, check_claims


def test_prints_every_claim_in_the_course_layout(capsys):
    claims = [Claim('"A"', "1 + 1 = 2", "right", True), Claim('"B"', "x", "wrong", True)]
    assert check_claims(claims) == claims
    assert capsys.readouterr().out == ('"A"\n    measured: 1 + 1 = 2\n    verdict : right\n\n'
                                       '"B"\n    measured: x\n    verdict : wrong\n\n')


def test_a_contradicted_verdict_fails_after_all_are_printed(capsys):
    claims = [Claim("first", "m", "v", False), Claim("second", "m", "v", True),
              Claim("third", "m", "v", False)]
    with pytest.raises(AssertionError, match="first; third"):
        check_claims(claims)
    assert "second" in capsys.readouterr().out


@pytest.mark.parametrize("fields, match", [
    ((1, "m", "v", True), "said"), (("s", None, "v", True), "measured"),
    (("s", "m", "v", 1), "holds"), (("s", "m", "v", "yes"), "holds"),
])
def test_bad_claim_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        Claim(*fields)


@pytest.mark.parametrize("claims", [[], "claim", [("s", "m", "v", True)]])
def test_bad_claims(claims):
    with pytest.raises(ValueError, match="claims"):
        check_claims(claims)
