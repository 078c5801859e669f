"""``Kind``: the optimizer kinds tiermem runs, as one enum that every part naming one imports.

A spec's ``kind`` (tiermem/config/specs.py), a state format's (tiermem/optim/formats.py) and the row
of tiermem/optim/families.py that says what each kind keeps and which kernel updates it are members
of this enum. ``Kind`` is a ``str`` as well (an ``enum.StrEnum``: ``str`` and ``enum.Enum``), so
``Kind.ADAM == "adam"`` and code that compares the name keeps working; ``str(kind)`` is the name and
``repr(kind)`` the name's repr, as messages printed the plain strings.
"""

from __future__ import annotations

import enum


class Kind(enum.StrEnum):
    """An optimizer kind: the kernel family that updates a parameter and the state it keeps."""

    ADAM = "adam"
    ADAMW = "adamw"
    ADAM8BIT = "adam8bit"
    ADAMW8BIT = "adamw8bit"
    SGD = "sgd"
    ADAGRAD = "adagrad"
    LION = "lion"
    ADAFACTOR = "adafactor"
    #: a torch optimizer tiermem has no kernel for, run by its own ``step()`` (NOTE [Generic optimizers])
    GENERIC = "generic"

    # printed as its name, as the plain strings it replaces were: in messages, lists and f-strings
    def __repr__(self) -> str:
        return repr(self.value)


#: every kind, by name
KINDS: tuple[str, ...] = tuple(k.value for k in Kind)

__all__ = ["KINDS", "Kind"]
