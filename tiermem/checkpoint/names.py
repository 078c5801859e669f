"""The name a checkpoint gives each tensor it holds: :class:`StateName`, one type that every part of
:mod:`tiermem.checkpoint` builds and reads, so that no two places split or join the string their own way.

A name is ``<part>/<param>``: the part is one of a parameter's state format (``master``,
``exp_avg``, ``exp_avg_absmax``, ... NOTE [State formats]), ``frozen`` for a frozen parameter, or
``buffers`` for a buffer; the param is the module's name of the parameter or buffer. The string,
written into every checkpoint file and manifest, is the same as it has always been: old
checkpoints load and new files are byte-for-byte what earlier versions wrote.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional

from tiermem.config.kinds import Kind
from tiermem.optim.families import FAMILIES, PartOptions

MASTER = "master"
FROZEN = "frozen"
BUFFERS = "buffers"
#: the parts that are the module's own tensors (a DCP checkpoint holds them as ``model.<param>``);
#: every other part is optimizer state (``optim.state.<param>.<part>``: NOTE [Sharded values for DCP])
MODULE_PARTS = (MASTER, FROZEN, BUFFERS)

#: each 8-bit moment's part and the part holding its blocks' absmax (NOTE [8-bit state]), as the
#: 8-bit state format's parts say (``StatePart.scale``)
SCALES = {p.name: p.scale for p in FAMILIES[Kind.ADAM8BIT].parts(PartOptions()) if p.scale is not None}
_MOMENT_OF = {scale: moment for moment, scale in SCALES.items()}


class StateName(NamedTuple):
    """One tensor of a checkpoint: ``part`` of ``param`` (``str()`` gives ``<part>/<param>``)."""

    part: str
    param: str

    @classmethod
    def parse(cls, name: str) -> StateName:
        """The name ``<part>/<param>`` as a checkpoint writes it (the part ends at the first ``/``;
        a parameter's own name may hold more)."""
        part, _, param = name.partition("/")
        return cls(part, param)

    def __str__(self) -> str:
        return f"{self.part}/{self.param}"

    @property
    def of_module(self) -> bool:
        """The module's own tensor (master weights, a frozen parameter, a buffer), not optimizer state."""
        return self.part in MODULE_PARTS

    @property
    def scale(self) -> Optional[StateName]:
        """The absmax of this 8-bit moment (``exp_avg/<p>`` -> ``exp_avg_absmax/<p>``); None for any other part."""
        scale = SCALES.get(self.part)
        return None if scale is None else StateName(scale, self.param)

    @property
    def moment(self) -> Optional[StateName]:
        """The moment whose absmax this is (``exp_avg_absmax/<p>`` -> ``exp_avg/<p>``); None for any other part."""
        moment = _MOMENT_OF.get(self.part)
        return None if moment is None else StateName(moment, self.param)


def params_of(names: Iterable[str], part: str) -> set[str]:
    """The params of those of ``names`` (strings as a checkpoint writes them) that are ``part``."""
    return {n.param for n in map(StateName.parse, names) if n.part == part}
