"""Docstring pieces that several functions share, written once.

Functions with the same parameters (the shape arguments of the activation counts, the
checkpointing arguments, a grading check's ``quiet``) describe them in the same words. PyTorch
writes such pieces once (``common_args`` in ``torch/_torch_docs.py``) and formats them into each
docstring; :func:`fill_doc` does the same here: a docstring line that holds only ``{name}`` is
replaced by the piece, indented as that line. ``help()`` and the rendered docs show the whole
text.
"""

from __future__ import annotations

import re
import textwrap

from course_lib.validation import WrongTypeError


def fill_doc(**pieces: str):
    """Decorator: replace each docstring line ``{name}`` by ``pieces[name]``, indented as it."""
    for name, text in pieces.items():
        if not isinstance(text, str):
            raise WrongTypeError(f"piece {name} must be a str, got {type(text).__name__}")

    def fill(obj):
        doc = obj.__doc__
        if doc is None:  # python -OO strips docstrings: nothing to fill
            return obj
        for name, text in pieces.items():
            line = re.compile(rf"^( *)\{{{name}\}}$", re.M)
            if not line.search(doc):
                raise ValueError(f"the docstring of {obj.__qualname__} has no line {{{name}}}")
            block = textwrap.dedent(text).strip("\n")
            doc = line.sub(lambda m, block=block: textwrap.indent(block, m.group(1)), doc)
        obj.__doc__ = doc
        return obj

    return fill


__all__ = ["fill_doc"]
