"""tiermem's stages in a user's torch.profiler trace (NOTE [tiermem in the torch profiler] in
tiermem/spans.py): a profile of two steps holds each stage as a ``tiermem::`` span; without a
profiler a span is a shared no-op."""

from __future__ import annotations

import torch
from models import TinyGPT, train_steps
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from tiermem import AdamW, PerClass, TensorClass, Tier, TieredModel, spans
from tiermem.policies import ZeroInfinity, ZeroOffload

ALL_THREADS = _ExperimentalConfig(profile_all_threads=True)  # transfers run on tiermem's own threads


class StateOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.NVME,
    }


def _model(policy, **kw) -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(TinyGPT(), policy, optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=3000, **kw)


def _spans_of_two_steps(tm: TieredModel, **kw) -> set[str]:
    train_steps(tm, 1)  # the first step records the order weights are used in (prefetch follows it)
    with profile(activities=[ProfilerActivity.CPU], **kw) as prof:
        train_steps(tm, 2, offset=1)
    return {e.name for e in prof.events() if e.name.startswith(spans.PREFIX)}


def test_a_profile_of_two_steps_holds_every_stage_of_zero_offload():
    tm = _model(ZeroOffload())
    names = _spans_of_two_steps(tm, experimental_config=ALL_THREADS)
    buckets = {f"tiermem::adam {b.key}" for b in tm.layout.buckets}
    assert len(buckets) > 1 and buckets <= names, "Adam per bucket"
    assert {
        "tiermem::forward",
        "tiermem::backward",
        "tiermem::step",
        "tiermem::wait grads",
        "tiermem::wait uploads",
    } <= names
    assert {"tiermem::d2h", "tiermem::copy grad device->host"} <= names, "grads home"
    if tm.device.type == "cuda":  # a CPU device's weights are written in place by Adam (NOTE [A CPU device])
        assert {"tiermem::h2d", "tiermem::copy param host->device"} <= names, "weights uploaded"
    else:
        assert "tiermem::copy param host->device" not in names


def test_nvme_reads_and_writes_and_prefetched_weights_are_spans(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "weights").mkdir()
    tm = _model(StateOnNvme(), nvme_dir=str(tmp_path / "state"))
    names = _spans_of_two_steps(tm, experimental_config=ALL_THREADS)
    state = {b.key for b in tm.layout.buckets}
    assert any(n.startswith("tiermem::nvme write bucket") for n in names)
    assert {n.split()[-1].split(":")[0] for n in names if n.startswith("tiermem::nvme read ")} == state
    tm.detach()
    tm = _model(ZeroInfinity(), nvme_dir=str(tmp_path / "weights"))
    names = _spans_of_two_steps(tm, experimental_config=ALL_THREADS)
    weights = {s.name for b in tm.layout.buckets for s in b.slots}
    fetched = {n.removeprefix("tiermem::nvme read ") for n in names if n.startswith("tiermem::nvme read ")}
    assert weights & fetched and "tiermem::nvme" in names  # weights fetched from NVMe on the NVMe lane
    tm.detach()


def test_a_default_profile_holds_the_stages_of_the_calling_thread():
    tm = _model(ZeroOffload())
    names = _spans_of_two_steps(tm)
    assert {"tiermem::forward", "tiermem::backward", "tiermem::step"} <= names
    assert {f"tiermem::adam {b.key}" for b in tm.layout.buckets} <= names


def test_without_a_profiler_a_span_is_a_shared_no_op():
    assert not spans.profiling()
    assert spans.span("adam bucket0") is spans.span("step")
    built = []
    assert spans.lazy_span(lambda: built.append(1) or "x") is spans.span("y") and not built  # no name built
    with profile(activities=[ProfilerActivity.CPU]):
        assert spans.profiling() and spans.span("x") is not spans.span("y")
