"""Where Adam writes a bucket's new low-precision weights, and how they reach their home.

Four cases, decided once per bucket from its homes:

- the weights are rounded from the master whenever read (NOTE [A chunk rounded from its master]):
  Adam writes none;
- the weights live where Adam runs (state and weights on the device): Adam writes them in place;
- overlap_step: into the bucket's own ``param_out`` buffer at the tier where Adam runs, sent home
  by the next step (:meth:`Outputs.land_background`);
- otherwise: into one of two staging buffers per tier where Adam runs (each as large as the
  largest bucket there), sent home while Adam runs on the next bucket; a buffer is reused once
  its previous transfer has finished. Host memory stays at 16 bytes per parameter plus two
  buckets of staging.
"""

from __future__ import annotations

from typing import Optional

import torch

from tiermem.handles import Handle, wait_all, wait_all_quietly
from tiermem.observe.trace import Tracer
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.bucket_homes import Homes
from tiermem.train.homes.store_keys import Part, StoreKey, bucket_key
from tiermem.train.homes.update_runs import Runs
from tiermem.types import TensorClass, Tier


class Outputs:
    """The buffers Adam writes new weights into, allocated once for the life of the model."""

    def __init__(
        self, buckets: list[Bucket], homes: Homes, stores: dict, dtype: torch.dtype, *, overlap: bool, tracer: Tracer
    ):
        self.homes, self.tracer, self.overlap = homes, tracer, overlap
        self.stores, self.dtype = stores, dtype
        self.param_out: dict[int, torch.Tensor] = {}
        self.staging: dict[Tier, list[torch.Tensor]] = {}
        self._staged: dict[Tier, list[int]] = {}  # the sizes of the buckets staged at each tier
        self.add(buckets)

    def add(self, buckets: list[Bucket]) -> None:
        """Buffers for ``buckets`` too (at construction; later, for buckets of parameters unfrozen
        since: NOTE [Freezing and unfreezing]). A tier's staging grows to its largest bucket, and
        to two buffers once it stages two buckets."""
        if self.overlap:  # the update runs while the next forward reads the old weights: one buffer per bucket
            for b in buckets:
                self.param_out[b.index] = self.stores[self.homes.compute_tier(b)].allocate(
                    str(bucket_key(b, Part.PARAM_OUT)), (b.numel,), self.dtype, TensorClass.PARAM
                )
            return
        for b in buckets:
            home = self.homes.weights[b.index]
            if not home.from_master(b) and home.in_place(b, self.homes.compute_tier(b)) is None:
                self._staged.setdefault(self.homes.compute_tier(b), []).append(b.numel)
        for tier, ns in self._staged.items():
            count = min(2, len(ns))  # double buffering needs two; a single bucket needs one
            have = self.staging.get(tier, [])
            if len(have) == count and all(t.numel() >= max(ns) for t in have):
                continue
            self.staging[tier] = [
                self.stores[tier].allocate(
                    str(StoreKey(f"staging{i}", Part.PARAM)), (max(ns),), self.dtype, TensorClass.PARAM
                )
                for i in range(count)
            ]

    def session(self) -> "Uploads":
        """The bookkeeping of one step's uploads."""
        return Uploads(self)

    def land_background(self, plan: list[tuple[Bucket, Runs]]) -> None:
        """overlap_step: send home the weights a finished background update wrote."""
        wait_all(
            [
                h
                for b, runs in plan
                for h in self.homes.weights[b.index].write(b, self.param_out[b.index], runs, self.homes.compute_tier(b))
            ]
        )


class Uploads:
    """One step's targets and transfers (see the module's docstring)."""

    def __init__(self, outputs: Outputs):
        self.o = outputs
        self.turn = 0
        self.inflight: dict[tuple[Tier, int], list[Handle]] = {}
        self._current: tuple[Tier, int] | None = None
        self._sent: dict[int, list[Handle]] = {}  # bucket -> the transfers of its new weights home
        self._in_place: set[int] = set()  # buckets whose new weights Adam wrote at home

    def target(self, b: Bucket) -> Optional[torch.Tensor]:
        """Where Adam writes ``b``'s new weights; None when it writes none."""
        if self.o.overlap:
            return self.o.param_out[b.index]
        if self.o.homes.weights[b.index].from_master(b):
            self._current = None
            return None
        tier = self.o.homes.compute_tier(b)
        direct = self.o.homes.weights[b.index].in_place(b, tier)
        if direct is not None:
            self._current = None
            self._in_place.add(b.index)  # at home as Adam writes them: landed, for a failed step's roll-back
            return direct
        which = (tier, self.turn % len(self.o.staging[tier]))
        with self.o.tracer.span("wait staging", "stall"):
            wait_all(self.inflight.pop(which, ()))  # ordering: its last upload has left the buffer
        self._current = which
        return self.o.staging[tier][which[1]][: b.numel]

    def done(self, b: Bucket, out: Optional[torch.Tensor], runs: Runs) -> None:
        """Adam wrote ``out`` (from :meth:`target`): send it home, overlapping the next bucket."""
        if self.o.overlap or self._current is None or out is None:
            return
        self.inflight[self._current] = self.o.homes.weights[b.index].write(b, out, runs, self.o.homes.compute_tier(b))
        self._sent.setdefault(b.index, []).extend(self.inflight[self._current])
        self.turn += 1

    def landed(self) -> set[int]:
        """The buckets some of whose new weights reached home (after :meth:`finish`)."""
        return self._in_place | {index for index, hs in self._sent.items() if any(h.succeeded() for h in hs)}

    def finish(self, quiet: bool = False) -> None:
        handles = [h for hs in self.inflight.values() for h in hs]
        self.inflight.clear()
        with self.o.tracer.span("wait uploads", "stall"):
            (wait_all_quietly if quiet else wait_all)(handles)
