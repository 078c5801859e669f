"""The NVMe store's journal: what each key's two slots hold, which one is current, the order writes
landed in, the falls back, the bytes the budget holds for all of it, and the spare files a released
slot goes to.

:class:`~tiermem.memory.nvme.NvmeStore` moves the bytes; the journal records what they mean. Every
method runs with the store's lock held, and none touches a file: the file operation a change
calls for (a slot to unlink, a spare to rename into) is returned for the store to do outside the
lock. NOTE [Two slots, overwritten in place], NOTE [No mix after a fall back], NOTE [One value per
key, and a few spare files] and NOTE [What the NVMe budget counts] in
:mod:`tiermem.memory.nvme_keys` say what it keeps.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Optional

from tiermem.memory import nvme_layout as layout
from tiermem.memory.ledger import Ledger
from tiermem.memory.nvme_keys import Copy, FellBack, KeyState, Value, over_budget, would_mix
from tiermem.memory.nvme_spares import SparePool
from tiermem.types import TensorClass


class Released(NamedTuple):
    """A slot file whose value is no longer wanted: ``path``, to be renamed to ``spare`` (then
    :meth:`SlotJournal.kept_spare`), or unlinked where ``spare`` is None."""

    path: str
    spare: Optional[str]


class SlotJournal:
    """The state of every key of a store under ``directory`` (NOTE [Two slots, overwritten in
    place]), counted in ``ledger``. ``keep_previous=False`` keeps one value per key and up to
    ``spares`` spare files per size band; ``direct``: whether slot files are padded for O_DIRECT."""

    def __init__(self, directory: str, ledger: Ledger, *, keep_previous: bool, spares: int, direct: bool):
        self.directory, self.ledger, self.direct = directory, ledger, direct
        self.keep_previous = keep_previous  # NOTE [One value per key, and a few spare files]
        self.keys: dict[str, KeyState] = {}
        self.seq = 0  # successful writes so far, NOTE [No mix after a fall back]
        self.fell_back: list[FellBack] = []
        self.spares = SparePool(directory, spares if not keep_previous else 0, ledger)

    # -- writes ------------------------------------------------------------------------------------
    def admit(self, key: str, value: Value, kind: Optional[TensorClass]) -> KeyState:
        """Queue a write of ``value`` under ``key`` once the budget holds room for it (NOTE [What the
        NVMe budget counts]); raises :class:`~tiermem.OutOfTierMemory` where it cannot."""
        state = self.keys.get(key) or KeyState()
        held, used = self.ledger.held(key), self.ledger.used
        need = state.on_disk(extra=value.nbytes)
        if need > held and used - held + need > self.ledger.allowed:
            self.spares.drop_all()  # spare files hold no value: give their blocks back first
            used = self.ledger.used
        if need > held and used - held + need > self.ledger.allowed:
            raise over_budget(key, need, value.nbytes, used - held, self.ledger.allowed)
        state.kind = kind if kind is not None else state.kind
        self.ledger.reserve(key, max(held, need), state.kind)
        self.keys[key] = state
        state.queued.append(value)
        return state

    def next_copy(self, key: str, value: Value) -> Copy:
        """Where a write of ``value`` goes: the slot that does not hold the key's current value, one
        generation on (slot 0, generation 0 where the key holds nothing); its header comes once the
        data is hashed."""
        current = self.keys[key].current()
        slot, gen = (0, 0) if current is None else (1 - current.slot, current.gen + 1)
        return Copy(value, slot, gen, self.path(key, slot), header=b"")

    def take_spare(self, value: Value) -> Optional[str]:
        """A spare file for a slot that does not exist yet to go over (None: make a new one)."""
        return self.spares.take(layout.file_size(value.nbytes, self.direct))  # none kept with keep_previous

    def landed(self, key: str, copy: Copy, ok: bool) -> Optional[Released]:
        """A write of ``copy`` ended (``ok``: its data and header landed, the switch): the key holds it
        (or, failed, nothing in its slot). Returns the previous slot's file where the store keeps one
        value per key (NOTE [One value per key, and a few spare files])."""
        state = self.keys[key]
        assert state.queued[0] is copy.value  # NOTE [Per-key order]: a key's writes end in order
        state.queued.pop(0)
        if ok:
            self.seq += 1
            copy = dataclasses.replace(copy, seq=self.seq)
        state.copies[copy.slot] = copy if ok else None
        previous = state.copies[1 - copy.slot] if ok and not self.keep_previous else None
        if previous is not None:
            state.copies[previous.slot] = None
        self.settle(key, state)
        if previous is None:
            return None
        return Released(previous.path, self.spares.give(layout.file_size(previous.value.nbytes, self.direct)))

    def kept_spare(self, released: Released, renamed: bool) -> None:
        """``released`` was renamed to its spare (or that failed: it is unlinked instead)."""
        assert released.spare is not None
        self.spares.keep(released.spare, renamed)

    # -- falls back, deletes, reverts ------------------------------------------------------------
    def previous(self, key: str, bad: Copy) -> Optional[Copy]:
        """The copy in the slot beside ``bad``, if that slot holds one."""
        return self.keys[key].copies[1 - bad.slot]

    def fall_back(self, key: str, bad: Copy, previous: Copy, said: str) -> None:
        """``key`` drops its spoilt copy ``bad`` for the intact ``previous`` (``said``: what was
        wrong); reads of keys written since ``previous`` are refused (NOTE [No mix after a fall back])."""
        state = self.keys[key]
        state.copies[bad.slot] = None
        self.settle(key, state)
        self.fell_back.append(FellBack(key, previous.seq, self.seq, said))

    def check_no_mix(self, key: str, copy: Copy) -> None:
        """NOTE [No mix after a fall back]."""
        for why in self.fell_back:
            if why.spans(key, copy):
                raise would_mix(key, copy, why)

    def forget_copies(self, key: str) -> None:
        """``key`` holds nothing (a delete); writes queued after it still land."""
        state = self.keys[key]
        state.copies = [None, None]
        self.settle(key, state)

    def revert(self, key: str) -> Optional[Copy]:
        """Drop ``key``'s current copy for the previous one; returns the dropped copy (its file to
        unlink), or None where there is no previous copy to go back to."""
        state = self.keys[key]
        latest = state.current()
        if latest is None or state.copies[1 - latest.slot] is None:
            return None
        state.copies[latest.slot] = None
        self.settle(key, state)
        return latest

    def forget_if_empty(self, key: str) -> None:
        """After a key's last queued request: forget it if it holds nothing and nothing is queued."""
        state = self.keys.get(key)
        if state is not None and state.current() is None and not state.queued:
            del self.keys[key]

    # -- what the keys hold ------------------------------------------------------------------------
    def current(self, key: str) -> Optional[Copy]:
        """The copy a read of ``key`` returns now."""
        return self.keys[key].current()

    def latest(self, key: str) -> Optional[Value]:
        """What ``key`` holds once its queued writes land."""
        state = self.keys.get(key)
        return state.latest() if state is not None else None

    def holds(self, key: str) -> bool:
        """Whether ``key``'s slots hold a value now."""
        state = self.keys.get(key)
        return state is not None and state.current() is not None

    def held_keys(self) -> list[str]:
        """The keys that hold a value (or will, once their queued writes land)."""
        return [k for k, state in self.keys.items() if state.latest() is not None]

    def path(self, key: str, slot: int) -> str:
        """The file of ``key``'s ``slot``."""
        return os.path.join(self.directory, layout.file_name(key, slot))

    def settle(self, key: str, state: KeyState) -> None:
        """Hold what ``key``'s slots and queued writes take (only ever shrinks)."""
        if state.current() is None and not state.queued:
            self.ledger.release(key)
        else:
            self.ledger.reserve(key, state.on_disk(), state.kind)
