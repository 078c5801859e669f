"""Arguments documented once for every callable that takes them: the optimizer specs' shared fields
(``params``, ``no_decay``, ...), the functional entries' shared keywords (``grad_scale``, ``out``,
``check_finite``, ...). The text lives beside what shares it; :func:`shares_args` joins it to each
docstring when the module is imported, so ``help()`` and ``inspect.getdoc`` show every argument and
nothing is added to a call.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, TypeVar

T = TypeVar("T")


def shares_args(shared: str) -> Callable[[T], T]:
    """Decorator: ``shared`` (Google-style lines as a cleaned docstring holds them: a section at column
    0, its items indented by 4) joined to the end of a function's docstring, whose last section must be
    its own ``Args:``; for a class, to the docstring of its own ``__init__`` (for a dataclass, to the
    class's: its generated ``__init__`` has none).

    Args:
        shared: the lines every callable decorated with it documents alike.
    """

    def join(obj: T) -> T:
        # a dataclass's generated __init__ has no docstring of its own: its class's is where its fields are
        own_init = isinstance(obj, type) and not dataclasses.is_dataclass(obj)
        target = obj.__dict__["__init__"] if own_init else obj
        own, lines = inspect.cleandoc(target.__doc__ or ""), shared.strip("\n")
        target.__doc__ = f"{own}\n{lines}" if own else lines
        return obj

    return join
