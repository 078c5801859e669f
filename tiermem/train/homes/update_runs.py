"""The words an update is said in: the ranges of a bucket it covers (``Runs``), the flat views of a
bucket's state it writes (``StateViews``) and the function that runs it (``Update``), shared by every
home (NOTE [Homes] in :mod:`tiermem.train.homes.bucket_homes`).
"""

from __future__ import annotations

from typing import Callable

import torch

from tiermem.plan.buckets import Bucket, Slot

StateViews = tuple[torch.Tensor, ...]  # one flat tensor per part of the bucket's state format, master first
Runs = list[tuple[int, int, int]]  # (start, end, step) ranges of a bucket that an update covers
Update = Callable[[Bucket, Runs, StateViews], None]


def slots_in(bucket: Bucket, runs: Runs) -> list[Slot]:
    """The slots of ``bucket`` that the update ``runs`` cover."""
    return [s for s in bucket.slots if any(a <= s.offset < e for a, e, _ in runs)]
