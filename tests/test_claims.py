"""course_lib.claims: one verdict vocabulary, the table, and a contradicted verdict fails."""

import pytest

from course_lib.claims import Claim, _ClaimTable, check_claims


def test_prints_every_claim_in_the_course_layout(capsys):
    claims = [Claim('"A"', "1 + 1 = 2", "true", True), Claim('"B"', "x", "false: y", True)]
    assert check_claims(claims) == claims
    assert capsys.readouterr().out == ('"A"\n    measured: 1 + 1 = 2\n    verdict : true\n\n'
                                       '"B"\n    measured: x\n    verdict : false: y\n\n')


def test_the_table_escapes_and_splits_word_and_reason():
    table = _ClaimTable([Claim('"<b>x</b>"', "1 < 2", "half-true: only with <K>", True)])
    html = table._repr_html_()
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "1 &lt; 2" in html and "<b>x</b>" not in html
    assert ">half-true</b><br>only with &lt;K&gt;</td>" in html
    assert html.count("<tr>") == 2  # the header and one claim


def test_a_contradicted_verdict_fails_after_all_are_printed(capsys):
    claims = [Claim("first", "m", "true", False), Claim("second", "m", "true", True),
              Claim("third", "m", "false", False)]
    with pytest.raises(AssertionError, match="first; third"):
        check_claims(claims)
    assert "second" in capsys.readouterr().out


@pytest.mark.parametrize("fields, match", [
    ((1, "m", "true", True), "said"), (("s", None, "true", True), "measured"),
    (("s", "m", "true", 1), "holds"), (("s", "m", "true", "yes"), "holds"),
    (("s", "m", "right", True), "verdict"), (("s", "m", "wrong: x", True), "verdict"),
    (("s", "m", "True", True), "verdict"), (("s", "m", "truest", True), "verdict"),
])
def test_bad_claim_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        Claim(*fields)


@pytest.mark.parametrize("claims", [[], "claim", [("s", "m", "true", True)]])
def test_bad_claims(claims):
    with pytest.raises(ValueError, match="claims"):
        check_claims(claims)
