"""The generic path's step: a torch optimizer's own ``step()`` over one bucket's master weights, its
state entries pointed at the bucket's part buffers (NOTE [Generic optimizers] in
tiermem/config/generic_optim.py)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from tiermem.config.generic_optim import fresh_copy
from tiermem.errors import TierMemError
from tiermem.optim.formats import StateFormat
from tiermem.plan.buckets import Bucket, Slot


class GenericRunner:
    """One TieredModel's copy of its generic optimizer, and one leaf tensor per parameter (the
    optimizer's ``state`` is keyed by it) that each step points at the parameter's master slice."""

    def __init__(self, fmt: StateFormat):
        self.template = fmt.options["optimizer"]
        self.inner = fresh_copy(self.template, [])
        self.leaves: dict[str, torch.Tensor] = {}

    def _leaf(self, name: str) -> torch.Tensor:
        if name not in self.leaves:
            self.leaves[name] = torch.empty(0)
        return self.leaves[name]

    def step(
        self,
        b: Bucket,
        slots: Sequence[tuple[int, Slot, Mapping[str, Any], int]],
        state: Sequence[torch.Tensor],
        grads: torch.Tensor,
        *,
        multiplier: float,
    ) -> None:
        """Update each of ``slots`` (slot index, slot, its group's hyperparameters, its step count
        including this update) of bucket ``b`` with the optimizer's ``step()``: one call per group.
        ``state`` holds the bucket's parts (master first), ``grads`` its gradients; ``multiplier``
        (the clip coefficient over the loss scale) is applied to a copy of the gradient when not 1."""
        parts = b.state.parts[1:]
        by_group: dict[int, tuple[Mapping[str, Any], list[tuple[torch.Tensor, list[torch.Tensor], Slot]]]] = {}
        for i, s, hyper, step in slots:
            pieces = b.pieces(tuple(state), i)
            leaf = self._leaf(s.name)
            leaf.data = pieces[0].view(s.shape)
            g = grads[s.offset : s.offset + s.numel].view(s.shape)
            if g.dtype != torch.float32 or multiplier != 1.0:
                g = g.float() * multiplier if multiplier != 1.0 else g.float()
            leaf.grad = g
            held = self.inner.state[leaf]
            if step == 1:  # a first update: the optimizer makes its state, then it moves to the parts
                held.clear()
            else:
                for part, piece in zip(parts, pieces[1:]):
                    held[part.name] = _shaped(piece, part.per_parameter, s.shape)
            by_group.setdefault(id(hyper), (hyper, []))[1].append((leaf, pieces[1:], s))
        try:
            for hyper, members in by_group.values():
                self.inner.param_groups = [{**hyper, "params": [leaf for leaf, _, _ in members]}]
                self.inner.step()
                for leaf, pieces, s in members:
                    self._keep(leaf, parts, pieces, s)
        finally:
            for _, members in by_group.values():
                for leaf, _, _ in members:
                    leaf.grad = None
            self.inner.param_groups = []

    def _keep(self, leaf: torch.Tensor, parts: Sequence[Any], pieces: Sequence[torch.Tensor], s: Slot) -> None:
        """After a step: each state entry's value in its part (copied where the optimizer made or
        rebound the tensor), and the entry pointed at the part again."""
        held = self.inner.state[leaf]
        if set(held) != {p.name for p in parts}:
            raise TierMemError(
                f"tiermem: {type(self.template).__qualname__} made state entries {sorted(held)} for "
                f"{s.name}, not the {sorted(p.name for p in parts)} its probe found; the generic path "
                f"needs state of one layout for every parameter and step: run this optimizer outside "
                f"tiermem, or pick one of tiermem.optimizers()"
            )
        for part, piece in zip(parts, pieces):
            value = held[part.name]
            if value.data_ptr() != piece.data_ptr():
                piece.copy_(value.reshape(-1))
                held[part.name] = _shaped(piece, part.per_parameter, s.shape)


def _shaped(piece: torch.Tensor, per_parameter: bool, shape: torch.Size) -> torch.Tensor:
    """A part's piece as the optimizer keeps the entry: the parameter's shape, or one element (0-d)."""
    return piece.view(()) if per_parameter else piece.view(shape)
