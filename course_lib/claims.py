"""Claim checks: a sentence learners meet, what the lecture measured, and the verdict.

Every lecture ends with a claim check: the statements about training memory that circulate in
articles and forum answers, each set against a figure the lecture's cells computed. A
:class:`Claim` holds the four parts, and :func:`check_claims` prints them in one layout and
fails on the first claim whose measurement does not support its verdict, so a lecture cannot
print a verdict its own numbers contradict (nbval re-runs every lecture in CI).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .validation import boolean, items, text


@dataclass(frozen=True)
class Claim:
    """One claim, its evidence and the verdict the evidence supports.

    Attributes:
        said (str): the claim, as learners meet it.
        measured (str): the evidence, formatted from figures the lecture computed.
        verdict (str): what the course concludes ("right", "wrong: ...", "half-true: ...").
        holds (bool): whether the measurement supports the verdict: the test of the figures
            that the verdict rests on.

    Raises:
        ValueError: ``said``, ``measured`` or ``verdict`` is not a ``str``, or ``holds`` is not
            a ``bool``.
    """

    said: str
    measured: str
    verdict: str
    holds: bool

    def __post_init__(self):
        for name in ("said", "measured", "verdict"):
            text(name, getattr(self, name))
        boolean("holds", self.holds)

    def report(self) -> str:
        """The claim in the course's layout.

        Returns:
            str: the claim, then indented ``measured:`` and ``verdict :`` lines.
        """
        return f"{self.said}\n    measured: {self.measured}\n    verdict : {self.verdict}\n"


def check_claims(claims: Iterable[Claim]) -> list[Claim]:
    """Print every claim with its evidence and verdict; fail if any measurement contradicts it.

    All claims are printed first, so the failing one is read in context.

    Args:
        claims (Iterable[Claim]): the lecture's claims, in the order to show them.

    Returns:
        list[Claim]: the claims, all of which hold.

    Raises:
        ValueError: ``claims`` is not a sequence of :class:`Claim`.
        AssertionError: naming each claim whose ``holds`` is False.

    Example::

        check_claims([Claim('"Adam stores two extra copies of the weights"',
                            f"m + v = {states:,} B = 2 x {weights:,} B", "right",
                            states == 2 * weights)])
    """
    claims = items("claims", claims, min_len=1)
    for claim in claims:
        if not isinstance(claim, Claim):
            raise ValueError(f"claims must hold Claim records, got {type(claim).__name__}")
    for claim in claims:
        print(claim.report())
    failed = [claim.said for claim in claims if not claim.holds]
    assert not failed, f"the measurements contradict the verdict of: {'; '.join(failed)}"
    return claims


__all__ = ["Claim", "check_claims"]
