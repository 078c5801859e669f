"""The checkpoint file against its narrow interface (tensors by name, metadata, a load that is
handed a reader): a stand-in model state, no TieredModel."""

from __future__ import annotations

import os

import pytest
import torch

from tiermem import StoreError, TierMemError
from tiermem.checkpoint import file as checkpoint


class FakeState:
    """What :class:`tiermem.checkpoint.view.ModelState` offers checkpoint.py (its core, reader and
    writer, all three this one object), over a dict."""

    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict | None = None, fail_after: int | None = None):
        self.t, self._meta, self.fail_after = tensors, meta or {"step": 3}, fail_after
        self.core = self.reader = self.writer = self
        self.param_groups = [{}]
        self.loaded_meta = None
        self.writes_files = True
        self.read = 0  # tensors given out: under data parallelism each one is a gather every rank joins

    def all_ok(self, ok):
        return ok

    def tensors(self):
        for i, item in enumerate(self.t.items()):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("state unreadable")
            self.read += 1
            yield item

    def specs(self, precision):
        return ((n, tuple(t.shape), (t.dtype,)) for n, t in self.t.items())

    def check_groups(self, saved, what):
        """No groups here: StateWriter's check of them is tested with models (tests/test_groups.py)."""

    def meta(self):
        return dict(self._meta, precision="bf16", param_step={}, scaler={"scale": 1.0, "good_steps": 0}, groups=[{}])

    def load(self, read_into, meta):
        for n, t in self.t.items():
            read_into(n, t)
        self.loaded_meta = meta


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "master/w": torch.randn(3, 5, generator=g),
        "exp_avg/w": torch.randn(15, generator=g).view(3, 5),
        "frozen/e": torch.randn(7, generator=g).to(torch.bfloat16),
        "buffers/n": torch.tensor(seed),
        "buffers/empty": torch.zeros(0),
        "buffers/half": torch.randn(2, 2, generator=g).half(),
    }


def _zeroed(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in like.items()}


def test_round_trip_every_dtype(tmp_path):
    path = str(tmp_path / "c.tm")
    src = _tensors(1)
    checkpoint.save(FakeState(src, {"step": 7}), path)
    dst = FakeState(_zeroed(src))
    checkpoint.load(dst, path)
    assert all(torch.equal(src[k], dst.t[k]) and src[k].dtype == dst.t[k].dtype for k in src)
    assert dst.loaded_meta["step"] == 7


def test_a_flipped_byte_is_found_before_anything_is_loaded(tmp_path):
    path = str(tmp_path / "c.tm")
    checkpoint.save(FakeState(_tensors(1)), path)
    with open(path, "r+b") as f:
        f.seek(len(checkpoint.MAGIC) + 70)  # inside the second tensor's bytes
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    dst = FakeState(_zeroed(_tensors(1)))
    with pytest.raises(StoreError, match="fails its checksum.*nothing was loaded"):
        checkpoint.load(dst, path)
    assert dst.loaded_meta is None and all(not t.any() for t in dst.t.values())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("exp_avg/w"), "does not match this model: missing"),
        (lambda t: t.update({"master/w": torch.zeros(5, 3)}), "has shape"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused(tmp_path, change, message):
    path = str(tmp_path / "c.tm")
    saved = _tensors(2)
    change(saved)
    checkpoint.save(FakeState(saved), path)
    dst = FakeState(_zeroed(_tensors(2)))
    with pytest.raises(TierMemError, match=message):
        checkpoint.load(dst, path)
    assert dst.loaded_meta is None


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_debris(tmp_path):
    path = str(tmp_path / "c.tm")
    checkpoint.save(FakeState(_tensors(3)), path)
    before = open(path, "rb").read()
    with pytest.raises(RuntimeError, match="state unreadable"):
        checkpoint.save(FakeState(_tensors(4), fail_after=2), path)
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["c.tm"]


@pytest.mark.parametrize(
    "mangle",
    [lambda b: b[:-3], lambda b: b"junk" + b[4:], lambda b: b"", lambda b: b.replace(b'"step": 3', b'"step": 4')],
)  # the footer's checksum
def test_a_damaged_file_is_not_a_checkpoint(tmp_path, mangle):
    path = str(tmp_path / "c.tm")
    checkpoint.save(FakeState(_tensors(5)), path)
    data = open(path, "rb").read()
    open(path, "wb").write(mangle(data))
    with pytest.raises(StoreError, match="is not a readable tiermem checkpoint"):
        checkpoint.load(FakeState(_zeroed(_tensors(5))), path)


def test_a_temporary_that_cannot_be_made_still_reads_the_state_through(tmp_path):
    """Rank 0 refusing the temporary (here a symlink planted at its name) still reads every tensor,
    as the other ranks do, so that no rank waits on a gather it never joins."""
    path = tmp_path / "c.tm"
    os.symlink(tmp_path / "elsewhere", f"{path}.tmp-{os.getpid()}")
    state = FakeState(_tensors(6))
    with pytest.raises(StoreError, match="already exists"):
        checkpoint.save(state, str(path))
    assert state.read == len(state.t)
    assert not os.path.lexists(tmp_path / "elsewhere") and not os.path.lexists(path)


# -- checkpoint names ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, part, param, of_module",
    [
        ("master/w", "master", "w", True),
        ("exp_avg/layers.0.weight", "exp_avg", "layers.0.weight", False),
        ("exp_avg_sq_absmax/a/b", "exp_avg_sq_absmax", "a/b", False),  # the part ends at the first '/'
        ("frozen/e", "frozen", "e", True),
        ("buffers/n", "buffers", "n", True),
    ],
)
def test_a_state_name_is_the_string_a_checkpoint_writes(name, part, param, of_module):
    from tiermem.checkpoint.names import StateName

    n = StateName.parse(name)
    assert (n.part, n.param, n.of_module) == (part, param, of_module)
    assert str(n) == f"{n}" == name


def test_a_moment_and_its_absmax_name_each_other_as_the_8bit_format_pairs_them():
    from tiermem.checkpoint.names import SCALES, StateName
    from tiermem.optim.formats import state_format

    fmt = state_format("adamw8bit", numel=1 << 20)
    blocked = [p.name for p in fmt.parts if p.block > 1]
    assert sorted(SCALES.values()) == sorted(blocked)
    for moment, scale in SCALES.items():
        assert moment in fmt.names and fmt.names.index(moment) < fmt.names.index(scale)
        assert StateName(moment, "w").scale == StateName(scale, "w")
        assert StateName(scale, "w").moment == StateName(moment, "w")
    assert StateName("master", "w").scale is None and StateName("exp_avg", "w").moment is None


@pytest.mark.parametrize("absmax_first", [False, True])
def test_a_quantized_moment_and_its_absmax_come_from_one_read_in_either_order(absmax_first):
    """NOTE [Converting state formats]: an fp32 moment loaded into an 8-bit one gives its codes and
    its absmax from one read of the checkpoint, whichever of the two the model asks for first."""
    from tiermem.checkpoint.convert import Conversion
    from tiermem.optim import quantize_blockwise

    value = torch.randn(300, generator=torch.Generator().manual_seed(0))
    codes, absmax = quantize_blockwise(value, signed=True)
    expected = {"exp_avg/w": ((300,), (torch.uint8,)), "exp_avg_absmax/w": (tuple(absmax.shape), (torch.float32,))}
    held = {"exp_avg/w": ((300,), torch.float32)}
    conversion = Conversion(expected, held)
    assert conversion.quantize == {"exp_avg/w"} and not conversion.dequantize
    assert conversion.reconciled(expected, held) == ({"exp_avg/w": ((300,), (torch.float32,))}, held)
    reads: list[str] = []

    def read_into(name: str, t: torch.Tensor) -> None:
        reads.append(name)
        t.copy_(value)

    read = conversion.reader(read_into, held)
    got = {"exp_avg/w": torch.empty(300, dtype=torch.uint8), "exp_avg_absmax/w": torch.empty_like(absmax)}
    for name in sorted(got, reverse=absmax_first):
        read(name, got[name])
    assert reads == ["exp_avg/w"]
    assert torch.equal(got["exp_avg/w"], codes.view(300)) and torch.equal(got["exp_avg_absmax/w"], absmax)
