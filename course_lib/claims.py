"""Claim checks: a sentence learners meet, what the lecture measured, and the verdict.

Every lecture ends with the claims about training memory that circulate in articles and forum
answers, each set against a figure its cells computed. :func:`check_claims` shows them as one
table and fails on a claim whose measurement does not support its verdict, so a lecture cannot
show a verdict its own numbers contradict. Verdicts speak the lectures' words: **true**,
**false** or **half-true**, optionally followed by ``": "`` and the reason.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass

from .validation import WrongTypeError, boolean, items, text

_VERDICTS = ("true", "false", "half-true")


@dataclass(frozen=True)
class Claim:
    """One claim, its evidence and the verdict the evidence supports.

    Attributes:
        said (str): the claim, as learners meet it.
        measured (str): the evidence, formatted from figures the lecture computed.
        verdict (str): ``"true"``, ``"false"`` or ``"half-true"``, optionally followed by
            ``": "`` and the reason.
        holds (bool): whether the measurement supports the verdict (the test of its figures).
    Raises:
        ValueError: for a ``verdict`` whose first word is none of those three.
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
            word = f'<b style="color:{self._COLOURS[claim.word]}">{claim.word}</b>'
            reason = f"<br>{html.escape(claim.reason)}" if claim.reason else ""
            rows.append(f"<tr><td {cell}>{html.escape(claim.said)}</td>"
                        f"<td {cell}>{html.escape(claim.measured)}</td>"
                        f"<td {cell}>{word}{reason}</td></tr>")
        head = "".join(f"<th {cell}>{name}</th>" for name in ("claim", "measured here", "verdict"))
        return (f'<table style="border-collapse:collapse; max-width:100%"><thead><tr>{head}</tr>'
                f"</thead><tbody>{''.join(rows)}</tbody></table>")


def check_claims(claims: Iterable[Claim]) -> list[Claim]:
    """Show every claim with its evidence and verdict; fail if any measurement contradicts it.

    All claims are shown first (a table in a notebook, plain text elsewhere), so that the
    failing one is read in context.

    Args:
        claims (Iterable[Claim]): the lecture's claims, in the order to show them.

    Returns:
        list[Claim]: the claims, all of which hold.

    Raises:
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
