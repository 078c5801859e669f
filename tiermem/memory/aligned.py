"""Page-aligned CPU buffers, pinned when an accelerator exists.

Direct I/O (O_DIRECT) needs the buffer address, the file offset and the length aligned to the
device's logical block size; 4096 covers every NVMe drive we know of. Pinned buffers let CUDA copy
asynchronously. ``Tensor.pin_memory()`` raises on a machine without an accelerator, so pinning is
only ever asked for when ``torch.cuda.is_available()``.

# NOTE [Exact pinned memory]
torch's pinned-memory cache (``pin_memory=True``) rounds every request below its threshold up to
the next power of two and keeps freed blocks for itself: a 2^k-byte bucket plus an alignment page
pins 2^(k+1) bytes, about 1.4x on average, and nothing goes back to the system until
``torch.cuda`` empties that cache. The host pool therefore takes each buffer as its own anonymous
mapping of exactly ``round_up(nbytes)`` bytes (page-aligned by construction, given back to the
system when the mapping is closed) and pins it in place with ``cudaHostRegister`` (NOTE
[Registering host memory]): :func:`host_buffer` pins exactly what the ledger counts, and
:func:`unpin` before the buffer is dropped unpins it. Where CUDA refuses to register host memory
(some virtualised or WSL setups), a pool falls back to torch's pinned cache and stops asking.
"""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

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
    buf = raw[offset : offset + size]
    assert buf.data_ptr() % align == 0
    return buf


def is_aligned(t: torch.Tensor, align: int = ALIGN) -> bool:
    return t.data_ptr() % align == 0


# NOTE [Huge pages for host buffers]
# A host buffer is a private anonymous mapping that asks for transparent huge pages (MADV_HUGEPAGE;
# the kernel's common "madvise" mode gives them only where asked). Its memory is then physically
# contiguous 2 MiB at a time, and direct I/O from or into it reaches the disk in requests as large
# as the device takes: on a virtio disk that takes 254 memory segments per request, 4 MiB requests
# instead of the ~1 MiB that scattered 4 KiB pages allow (bench/nvme.py, bench/RESULTS.md
# "2026-12-01 NvmeStore against fio": the same pwritev/preadv from such a buffer ran at 1.6x / 2.0x
# (write / read) the rate from a shared mapping). A shared anonymous mapping (mmap's default) is
# shmem, which THP leaves alone. The mapping's size is unchanged (the ledger's bytes are exact);
# where the kernel has no THP, or none is free, the buffer simply keeps 4 KiB pages.
HUGE_PAGE = 2 * 2**20


def host_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A uint8 CPU tensor of exactly ``round_up(nbytes)`` bytes in its own private anonymous
    mapping (page-aligned; unmapped once the tensor and its views are gone; huge pages asked for,
    NOTE [Huge pages for host buffers]), registered with CUDA in place when ``pin`` (NOTE [Exact
    pinned memory]); call :func:`unpin` before dropping it."""
    size = round_up(max(nbytes, 1))
    raw = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            raw.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP: 4 KiB pages, as before
            pass
    buf = torch.frombuffer(raw, dtype=torch.uint8)
    if pin:
        register_host(buf.data_ptr(), size)
    return buf


def pin_in_place(buf: torch.Tensor) -> Optional[str]:
    """Pin a :func:`host_buffer` in place; returns None, or why CUDA refused (the caller then takes
    a buffer from torch's pinned cache instead, and asks no more: NOTE [Exact pinned memory])."""
    try:
        register_host(buf.data_ptr(), buf.numel())
        return None
    except RuntimeError as e:
        return str(e)


def unpin(buf: torch.Tensor) -> None:
    """Undo the registration of a pinned :func:`host_buffer` (the bytes stay valid, unpinned)."""
    unregister_host(buf.data_ptr())


# NOTE [Registering host memory]
# torch's binding of cudaHostRegister/Unregister hands back the error code and leaves it as the
# runtime's "last error" of the calling thread, where the next kernel launch check on that thread
# (cudaGetLastError) would raise it from an unrelated operation. Both calls therefore run on one
# thread of their own that launches nothing. They run in the context of a device that already has
# one (the calling thread's current device if it has, else the first that has), as torch's own
# pinned allocator does: calling on a thread whose current device is 0 would otherwise create a
# context on GPU 0 for a model on cuda:N. Pinned host memory is usable from every device.
_pinner: Optional[ThreadPoolExecutor] = None
# reentrant, and the pinning thread calls inline: a GC pass there must not deadlock if a finalizer ever
# pins (tiermem's own only enqueue, NOTE [Finalizers only enqueue] in tiermem/memory/deferred.py)
_pinner_lock = threading.RLock()
_on_pinner = threading.local()  # .yes on the pinning thread itself


def _pin_thread() -> ThreadPoolExecutor:
    global _pinner
    with _pinner_lock:
        if _pinner is None:
            _pinner = ThreadPoolExecutor(
                1, thread_name_prefix="tiermem-pin", initializer=lambda: setattr(_on_pinner, "yes", True)
            )
        return _pinner


def context_device() -> int:
    """A device whose CUDA context exists, preferring the calling thread's current device."""
    current = torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None or has_context(current):
        return current
    return next((i for i in range(torch.cuda.device_count()) if has_context(i)), current)


def _cudart_call(name: str, *args: int) -> int:
    """``torch.cuda.cudart().<name>(*args)`` on the pinning thread (NOTE [Registering host memory])."""
    device = context_device()

    def call() -> int:
        with torch.cuda.device(device):
            return int(getattr(torch.cuda.cudart(), name)(*args))  # type: ignore[no-untyped-call]  # torch leaves it untyped

    if getattr(_on_pinner, "yes", False):  # called on the pinning thread itself: waiting on it would deadlock
        return call()
    return _pin_thread().submit(call).result()


def register_host(ptr: int, nbytes: int) -> None:
    err = _cudart_call("cudaHostRegister", ptr, nbytes, 1)  # 1: cudaHostRegisterPortable, every context
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")


def unregister_host(ptr: int) -> None:
    err = _cudart_call("cudaHostUnregister", ptr)
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {err}")
