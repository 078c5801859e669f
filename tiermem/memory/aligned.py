"""Page-aligned CPU buffers, pinned when an accelerator exists.

Direct I/O (O_DIRECT) needs the buffer address, the file offset and the length aligned to the
device's logical block size; 4096 covers every NVMe drive we know of. Pinned buffers let CUDA copy
asynchronously. ``Tensor.pin_memory()`` raises on a machine without an accelerator, so pinning is
only ever asked for when ``torch.cuda.is_available()``.
"""
from __future__ import annotations

import torch

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def can_pin() -> bool:
    return torch.cuda.is_available()


def aligned_empty(nbytes: int, *, pin: bool | None = None, align: int = ALIGN) -> torch.Tensor:
    """A uint8 CPU tensor of ``round_up(nbytes)`` bytes whose first byte sits on an ``align`` boundary.

    The length is rounded up too, so a direct-I/O request may cover the whole buffer.
    """
    if pin is None:
        pin = can_pin()
    size = round_up(max(nbytes, 1), align)
    raw = torch.empty(size + align, dtype=torch.uint8, pin_memory=bool(pin))
    offset = (-raw.data_ptr()) % align
    buf = raw[offset:offset + size]
    assert buf.data_ptr() % align == 0
    return buf


def is_aligned(t: torch.Tensor, align: int = ALIGN) -> bool:
    return t.data_ptr() % align == 0
