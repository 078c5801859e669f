"""The copy service: what the homes, the gradient collector and the step ask of the transfer engine.

They move bytes they own (a bucket's gradient buffer, its staging, its NVMe key) and need no
registry of residency, so they depend on this small protocol, not on
:class:`~tiermem.transfer.engine.TransferEngine`, which provides it (a stand-in in a test can too).
Every call returns a :class:`~tiermem.handles.Handle`; ordering is the engine's (NOTE [Issued, then
done] in :mod:`tiermem.transfer.lanes`, NOTE [Chained requests] in :mod:`tiermem.transfer.engine`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch

from tiermem.handles import Handle
from tiermem.transfer.lease import Lease
from tiermem.types import TensorClass, Tier

#: ``(dst, src, accumulate)``: one copy of :meth:`CopyService.copy_many`
Copy = tuple[torch.Tensor, torch.Tensor, bool]


class CopyService(Protocol):
    """The keyless copies, store requests and background work the training state asks for."""

    device: torch.device

    def copy_async(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        src_tier: Tier,
        dst_tier: Tier,
        accumulate: bool = False,
        kind: Optional[TensorClass] = None,
        after: Optional[Handle] = None,
    ) -> Handle:
        """``dst <- src`` (or ``dst += src``) from ``src_tier`` to ``dst_tier``, in the direction's order."""
        ...

    def copy_many(
        self, copies: Sequence[Copy], *, src_tier: Tier, dst_tier: Tier, kind: Optional[TensorClass] = None
    ) -> Handle:
        """Several copies as one request (one turn of the lane, one completion)."""
        ...

    def store_write(
        self, tier: Tier, key: str, src: torch.Tensor, *, src_tier: Tier = Tier.HOST, kind: Optional[TensorClass] = None
    ) -> Handle:
        """Write ``src`` to ``tier``'s store under ``key``."""
        ...

    def store_read(
        self, tier: Tier, key: str, out: torch.Tensor, *, dst_tier: Tier = Tier.HOST, kind: Optional[TensorClass] = None
    ) -> Handle:
        """Read ``key`` from ``tier``'s store into ``out``."""
        ...

    def run_async(self, fn: Callable[[], object], *, name: str = "compute", lane: str = "compute") -> Handle:
        """Run ``fn`` on the compute lane (or behind another lane's requests)."""
        ...

    def join(self, handle: Handle) -> Any:
        """Wait for ``handle`` as a consumer on the device's current stream."""
        ...

    def lease(self, nbytes: int, key: str, kind: Optional[TensorClass] = None) -> Lease:
        """A pooled host buffer of ``nbytes``, until its ``release()``."""
        ...

    def behind(self, lane: str) -> Handle:
        """Done once every request queued on ``lane`` so far has finished."""
        ...

    def chain(
        self,
        first: Union[Handle, Sequence[Handle]],
        then: Optional[Callable[[], Any]] = None,
        *,
        cleanup: Optional[Callable[[], None]] = None,
        stall: Tier = Tier.HOST,
    ) -> Handle:
        """``then()`` once ``first`` has finished; ``cleanup()`` once the chain ends."""
        ...
