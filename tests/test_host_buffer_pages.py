"""Host buffers are private mappings that ask for transparent huge pages (NOTE [Huge pages for host
buffers] in tiermem/memory/aligned.py), so direct I/O from them reaches the disk in large requests;
their size stays exact and their bytes are plain memory."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tiermem.memory import aligned

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _mapping(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address ``ptr``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
            if head:
                if inside:
                    break
                inside = int(head.group(1), 16) <= ptr < int(head.group(2), 16)
                if inside:
                    fields["perms"] = head.group(3)
            elif inside and ":" in line:
                key, value = line.split(":", 1)
                fields[key] = value.strip()
    assert fields, f"no mapping holds {ptr:#x}"
    return fields


def test_a_large_host_buffer_is_private_and_asks_for_huge_pages():
    buf = aligned.host_buffer(5 * aligned.HUGE_PAGE + 123, pin=False)
    buf.fill_(3)
    m = _mapping(buf.data_ptr())
    assert m["perms"].endswith("p")  # private: shared anonymous memory is shmem, which THP leaves alone
    assert int(m["Size"].split()[0]) * 1024 == buf.numel() == aligned.round_up(5 * aligned.HUGE_PAGE + 123)
    if os.path.exists(THP):  # a kernel with THP takes the advice
        assert "hg" in m["VmFlags"].split()
        assert m["THPeligible"] == ("0" if "[never]" in open(THP).read() else "1")
    assert int(buf.sum()) == 3 * buf.numel()


def test_a_small_host_buffer_asks_for_no_huge_page():
    buf = aligned.host_buffer(aligned.HUGE_PAGE - 4096, pin=False)
    buf.fill_(1)
    m = _mapping(buf.data_ptr())
    assert m["perms"].endswith("p") and "hg" not in m["VmFlags"].split()
    assert torch.equal(buf[:10], torch.ones(10, dtype=torch.uint8))
