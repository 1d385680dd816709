"""The bad values of the input tests (tests/test_inputs*.py), as hypothesis strategies.

What used to slip through the public API: bools where ints are meant, NaN and the infinities,
floats where ints are meant (2.5, and whole ones such as 2.0), sizes past their stated maximum
(2**63), strings, None, containers, and device names torch does not know ("gpu").
"""

import math
import re

import pytest
from hypothesis import HealthCheck, settings, strategies as st

SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

BOOLS = st.booleans()
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
FRACTIONS = st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer())
WHOLE_FLOATS = st.integers(-10**6, 10**6).map(float)
HUGE = st.integers(min_value=2**63, max_value=2**70)
OTHERS = st.one_of(st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2),
                   st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


def not_an_int(low=None, high=None):
    """Values an int parameter in ``[low, high]`` must refuse."""
    out = [BOOLS, NON_FINITE, FRACTIONS, WHOLE_FLOATS, OTHERS]
    if low is not None:
        out.append(st.integers(max_value=low - 1, min_value=low - 10**6))
    if high is not None:
        out.append(st.integers(min_value=high + 1, max_value=high + 2**70))
    return st.one_of(out)


def not_a_number(low=None, high=None):
    out = [BOOLS, NON_FINITE, OTHERS]
    if low is not None:
        out.append(st.floats(max_value=low, exclude_max=True, allow_nan=False,
                             allow_infinity=False))
    if high is not None:
        out.append(st.floats(min_value=high, exclude_min=True, allow_nan=False,
                             allow_infinity=False))
    return st.one_of(out)


def not_one_of(options):
    return st.one_of(BOOLS, st.integers(), st.floats(), st.none(),
                     st.text(max_size=8).filter(lambda t: t not in options))


NOT_A_BOOL = st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.none())
NOT_A_DEVICE = st.one_of(BOOLS, st.integers(), st.floats(), st.none(),
                         st.sampled_from(["gpu", "GPU", "cuda:x", "", "tpu0", "cpu cpu"]))
INT64 = (-(2**63), 2**63 - 1)


def refused_naming(call, name, value):
    """``call(value)`` raises ValueError or TypeError whose message names ``name`` as a word."""
    with pytest.raises((ValueError, TypeError)) as info:
        call(value)
    message = str(info.value)
    assert re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message), (name, value, message)
