"""train/inputs: ``tm(...)`` moves every tensor of its inputs to the device and casts the floating
ones to the working precision, in every kind of container, which comes back as its own type.
Moving is checked with the meta device (a device other than the CPU on any machine)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Optional

import pytest
import torch
from torch import nn

from tiermem import AdamW, ConfigError, TieredModel
from tiermem.model.inputs import cast_inputs

META = torch.device("meta")


class Pair(NamedTuple):
    x: torch.Tensor
    ids: torch.Tensor


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    ids: torch.Tensor
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    ids: torch.Tensor


class Encoding(UserDict):
    """A Mapping that is not a dict, with state of its own (as transformers' BatchEncoding)."""

    def __init__(self, data: dict, extra: Any = None):
        super().__init__(data)
        self.extra = extra


class ReadOnly(Mapping):
    """A Mapping that cannot be rebuilt from a dict."""

    def __init__(self, a, b):
        self._d = {"a": a, "b": b}

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return 2


def _x() -> torch.Tensor:
    return torch.randn(2, 3)


def _ids() -> torch.Tensor:
    return torch.arange(4)


def _check(t: Any, dtype: torch.dtype) -> None:
    assert isinstance(t, torch.Tensor) and t.device == META and t.dtype == dtype


@pytest.mark.parametrize(
    "kind",
    [
        "tuple",
        "list",
        "namedtuple",
        "dataclass",
        "frozen dataclass",
        "dict",
        "OrderedDict",
        "dict subclass",
        "UserDict Mapping",
        "MappingProxyType",
        "nested",
    ],
)
def test_every_container_comes_back_as_itself_with_its_tensors_moved_and_floats_cast(kind):
    x, ids = _x(), _ids()
    obj, get = {
        "tuple": ((x, ids), lambda o: (o[0], o[1])),
        "list": ([x, ids], lambda o: (o[0], o[1])),
        "namedtuple": (Pair(x, ids), lambda o: (o.x, o.ids)),
        "dataclass": (Batch(x, ids), lambda o: (o.x, o.ids)),
        "frozen dataclass": (FrozenBatch(x, ids), lambda o: (o.x, o.ids)),
        "dict": ({"x": x, "ids": ids}, lambda o: (o["x"], o["ids"])),
        "OrderedDict": (OrderedDict(x=x, ids=ids), lambda o: (o["x"], o["ids"])),
        "dict subclass": (type("Sub", (dict,), {})(x=x, ids=ids), lambda o: (o["x"], o["ids"])),
        "UserDict Mapping": (Encoding({"x": x, "ids": ids}, extra="encodings"), lambda o: (o["x"], o["ids"])),
        "MappingProxyType": (MappingProxyType({"x": x, "ids": ids}), lambda o: (o["x"], o["ids"])),
        "nested": ({"a": [Pair(x, ids)], "b": (Batch(x, ids),)}, lambda o: (o["b"][0].x, o["a"][0].ids)),
    }[kind]
    out = cast_inputs(obj, torch.bfloat16, META)
    assert type(out) is type(obj)
    fx, fids = get(out)
    _check(fx, torch.bfloat16)
    _check(fids, torch.int64)  # integers keep their dtype
    assert get(obj)[0].device.type == "cpu"  # the caller's container is not changed
    if kind == "UserDict Mapping":
        assert out.extra == "encodings"  # what else the instance holds comes along
    if kind == "dataclass":
        assert out.note == "kept"


def test_what_is_not_a_tensor_passes_as_it_is():
    marker = object()
    out = cast_inputs((marker, "text", 3, None, {"k": 1.5}), torch.bfloat16, META)
    assert out[0] is marker and out[1:] == ("text", 3, None, {"k": 1.5})
    batch = Batch(torch.zeros(1, dtype=torch.bfloat16), _ids())
    assert cast_inputs(batch, torch.bfloat16, torch.device("cpu")) is batch  # nothing to convert: no copy


def test_a_mapping_that_cannot_be_rebuilt_is_refused_not_passed_on_unconverted():
    with pytest.raises(ConfigError, match=r"^tiermem: tm\(\.\.\.\) got a ReadOnly .* pass a dict instead"):
        cast_inputs(ReadOnly(_x(), _ids()), torch.bfloat16, META)


class _Takes(nn.Module):
    """Reads its input from any container and records what it got."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.seen: Optional[torch.Tensor] = None

    def forward(self, batch):
        x = batch["x"] if isinstance(batch, (dict, UserDict)) else batch.x
        self.seen = x
        return self.lin(x).float().sum()


@pytest.mark.parametrize(
    "make",
    [lambda x: Pair(x, _ids()), lambda x: Batch(x, _ids()), lambda x: Encoding({"x": x, "ids": _ids()})],
    ids=["namedtuple", "dataclass", "BatchEncoding-like Mapping"],
)
def test_tm_casts_inputs_in_the_containers_it_once_refused_or_passed_unconverted(make):
    torch.manual_seed(0)
    module = _Takes()
    tm = TieredModel(module, optimizer=AdamW(lr=1e-2), precision="bf16")
    tm.backward(tm(make(torch.randn(4, 3))))
    tm.step()
    assert module.seen.dtype == torch.bfloat16


def test_transformers_batch_encoding():
    import transformers  # the test extra installs it

    enc = transformers.BatchEncoding({"input_ids": torch.arange(6).view(2, 3), "mask": torch.ones(2, 3)})
    out = cast_inputs(enc, torch.bfloat16, META)
    assert isinstance(out, transformers.BatchEncoding)
    _check(out["mask"], torch.bfloat16)
    _check(out["input_ids"], torch.int64)
    _check(out.input_ids, torch.int64)  # its attribute access reads the converted data


def test_casting_leaves_no_reference_cycle():
    """It runs on every forward: nothing it makes may wait for the GC (pytree's tree_map would)."""
    import gc

    from tiermem.memory import deferred

    obj = {"a": [Pair(_x(), _ids())], "b": (Batch(_x(), _ids()),), "c": Encoding({"x": _x()})}
    deferred.collect()  # models earlier tests dropped are given back first (their release makes garbage)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            cast_inputs(obj, torch.bfloat16, META)
        assert gc.collect() == 0
    finally:
        gc.enable()
