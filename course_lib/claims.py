"""Claim checks: a sentence learners meet, what the lecture measured, and the verdict.

Every lecture ends with a claim check: the statements about training memory that circulate in
articles and forum answers, each set against a figure the lecture's cells computed. A
:class:`Claim` holds the four parts, and :func:`check_claims` shows them as one table and fails
on the first claim whose measurement does not support its verdict, so a lecture cannot show a
verdict its own numbers contradict (nbval re-runs every lecture in CI).

Verdicts speak one vocabulary, the words the lectures' prose uses: **true**, **false** or
**half-true**, optionally followed by ``": "`` and the reason (``"false: it changes only the
communication"``).
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass

from course_lib.validation import WrongTypeError

from .validation import boolean, items, text

_VERDICTS = ("true", "false", "half-true")


@dataclass(frozen=True)
class Claim:
    """One claim, its evidence and the verdict the evidence supports.

    Attributes:
        said (str): the claim, as learners meet it.
        measured (str): the evidence, formatted from figures the lecture computed.
        verdict (str): ``"true"``, ``"false"`` or ``"half-true"``, optionally followed by
            ``": "`` and the reason.
        holds (bool): whether the measurement supports the verdict: the test of the figures
            that the verdict rests on.

    Raises:
        ValueError: ``said``, ``measured`` or ``verdict`` is not a ``str``, ``verdict`` does
            not start with one of the three words, or ``holds`` is not a ``bool``.
    """

    said: str
    measured: str
    verdict: str
    holds: bool

    def __post_init__(self):
        for name in ("said", "measured", "verdict"):
            text(name, getattr(self, name))
        if self.word not in _VERDICTS:
            raise ValueError(f"verdict must be one of {_VERDICTS}, optionally followed by ': ' "
                             f"and the reason, got {self.verdict!r}")
        boolean("holds", self.holds)

    @property
    def word(self) -> str:
        """The verdict's first word: ``"true"``, ``"false"`` or ``"half-true"``."""
        return self.verdict.split(":", 1)[0].strip()

    @property
    def reason(self) -> str:
        """What follows the verdict's word (``""`` if nothing does)."""
        return self.verdict.split(":", 1)[1].strip() if ":" in self.verdict else ""

    def report(self) -> str:
        """The claim as plain text.

        Returns:
            str: the claim, then indented ``measured:`` and ``verdict :`` lines.
        """
        return f"{self.said}\n    measured: {self.measured}\n    verdict : {self.verdict}\n"


class _ClaimTable:
    """Claims shown as a table: an HTML table in a notebook, the plain-text layout elsewhere."""

    _COLOURS = {"true": "#1a7f37", "false": "#cf222e", "half-true": "#9a6700"}

    def __init__(self, claims: list[Claim]):
        self.claims = claims

    def __repr__(self) -> str:
        return "\n".join(claim.report() for claim in self.claims)

    def _repr_html_(self) -> str:
        cell = 'style="text-align:left; vertical-align:top; padding:4px 8px"'
        rows = []
        for claim in self.claims:
            word = (f'<b style="color:{self._COLOURS[claim.word]}">{claim.word}</b>')
            reason = f"<br>{html.escape(claim.reason)}" if claim.reason else ""
            rows.append(f"<tr><td {cell}>{html.escape(claim.said)}</td>"
                        f"<td {cell}>{html.escape(claim.measured)}</td>"
                        f"<td {cell}>{word}{reason}</td></tr>")
        head = "".join(f"<th {cell}>{name}</th>" for name in ("claim", "measured here", "verdict"))
        return (f'<table style="border-collapse:collapse; max-width:100%"><thead><tr>{head}</tr>'
                f"</thead><tbody>{''.join(rows)}</tbody></table>")


def check_claims(claims: Iterable[Claim]) -> list[Claim]:
    """Show every claim with its evidence and verdict; fail if any measurement contradicts it.

    All claims are shown first (a table in a notebook, plain text elsewhere), so the failing
    one is read in context.

    Args:
        claims (Iterable[Claim]): the lecture's claims, in the order to show them.

    Returns:
        list[Claim]: the claims, all of which hold.

    Raises:
        ValueError: ``claims`` is not a sequence of :class:`Claim`.
        AssertionError: naming each claim whose ``holds`` is False.

    Example:
        >>> weights = 4  # bytes of one fp32 weight
        >>> held = check_claims([Claim('"Adam keeps two extra copies of the weights"',
        ...                            f"m + v = {2 * weights} B per weight", "true", True)])
        "Adam keeps two extra copies of the weights"
            measured: m + v = 8 B per weight
            verdict : true
    """
    claims = items("claims", claims, min_len=1)
    for claim in claims:
        if not isinstance(claim, Claim):
            raise WrongTypeError(f"claims must hold Claim records, got {type(claim).__name__}")
    table = _ClaimTable(claims)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython ships with every notebook
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(table)
    else:
        print(repr(table))
    failed = [claim.said for claim in claims if not claim.holds]
    assert not failed, f"the measurements contradict the verdict of: {'; '.join(failed)}"
    return claims


__all__ = ["Claim", "check_claims"]
