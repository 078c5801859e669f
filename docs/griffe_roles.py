"""A griffe extension for the docs build: the docstrings' Sphinx roles (``:class:`~tiermem.Tier```,
``:mod:`tiermem.train.step.trainable```, ``:meth:`save```) rendered as inline code holding the name
(``Tier``, ``tiermem.train.step.trainable``, ``save``), as mkdocstrings' Google style shows no roles.
Loaded by mkdocs.yml; nothing in the library imports it."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def plain(text: str) -> str:
    """``text`` with every Sphinx role replaced by inline code of its target."""
    return _ROLE.sub(_code, text.replace("``", "`"))


class SphinxRoles(griffe.Extension):
    """Rewrites each object's docstring as it is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
