"""tiermem.plan.footprint: the one rule for the bytes each tier needs, checked three ways: by hand
on made-up bucket plans, against ``tiermem plan``'s figures and the layout's old rule for real
models under every built-in policy, and against what TieredModel really allocates."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from models import Quirky, TinyGPT
from test_gpu_paths import gpu_mode  # noqa: F401 - the engine's GPU control flow on the CPU (a fixture)
from torch import nn

from tiermem import AdamW, AdamW8bit, Budgets, ConfigError, OutOfTierMemory, TensorClass, TensorInfo, Tier, TieredModel
from tiermem.memory.aligned import round_up
from tiermem.memory.resident import HostStore
from tiermem.plan import footprint as fp, sizing
from tiermem.plan.buckets import Bucket
from tiermem.plan.choose import Evaluator
from tiermem.plan.placement import plan as plan_placement
from tiermem.plan.policy import PerClass
from tiermem.policies import ActivationOffload, KeepOnDevice, ZeroInfinity, ZeroOffload

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
BF16 = torch.bfloat16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _pages(*sizes: int) -> int:
    """The page rounding of host buffers of these sizes (each under a page here)."""
    return sum(4096 - n for n in sizes)


def _bucket(numel: int, grad: Tier, state: Tier, param: Tier = D, index: int = 0) -> Bucket:
    return Bucket(index, grad_tier=grad, state_tier=state, group=0, param_tier=param, numel=numel)


# -- the rule, by hand ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "buckets, overlap, expect",
    [
        # ZeRO-Offload, buckets of 10 and 6: bf16 weights on the device, fp32 grads and state on the
        # host, and two staging buffers as large as the larger bucket where Adam runs
        (
            [_bucket(10, H, H), _bucket(6, H, H, index=1)],
            False,
            {
                D: {fp.WORKING_WEIGHTS: 2 * 16, fp.GRADS_IN_FLIGHT: 0},
                H: {
                    fp.GRADS: 4 * 16,
                    fp.OPTIM_STATE: 12 * 16,
                    fp.WEIGHT_STAGING: 2 * 2 * 10,
                    fp.PAGE_ROUNDING: _pages(40, 24, *[40] * 3, *[24] * 3, 20, 20),
                },
            },
        ),
        # overlap_step: a second grad buffer and Adam's output per bucket instead of the staging
        (
            [_bucket(10, H, H), _bucket(6, H, H, index=1)],
            True,
            {
                D: {fp.WORKING_WEIGHTS: 32, fp.GRADS_IN_FLIGHT: 0},
                H: {
                    fp.GRADS: 64,
                    fp.OPTIM_STATE: 192,
                    fp.SECOND_GRADS: 64,
                    fp.UPDATED_WEIGHTS: 32,
                    fp.PAGE_ROUNDING: _pages(40, 40, 24, 24, *[40] * 3, *[24] * 3, 20, 12),
                },
            },
        ),
        # everything on the device: no staging, no copies
        (
            [_bucket(10, D, D)],
            False,
            {D: {fp.WORKING_WEIGHTS: 20, fp.GRADS: 40, fp.OPTIM_STATE: 120, fp.GRADS_IN_FLIGHT: 0}},
        ),
        # ZeRO-Infinity: NVMe holds each value once, plus the writes that can be in flight beside their
        # key's value (3 buckets of state, 2 of weights); the host streams state through 3 buckets;
        # a single bucket needs one staging buffer
        (
            [_bucket(10, H, N, param=N)],
            False,
            {
                N: {fp.WORKING_WEIGHTS: 20, fp.OPTIM_STATE_NVME: 120, fp.NVME_JOURNAL: 3 * 120 + 2 * 20},
                H: {
                    fp.GRADS: 40,
                    fp.STATE_PIPELINE: 3 * 120,
                    fp.WEIGHT_STAGING: 20,
                    fp.PAGE_ROUNDING: _pages(40, 120, 120, 120, 20),
                },
                D: {fp.GRADS_IN_FLIGHT: 0},
            },
        ),
        # grads on NVMe: once there, 4 buckets of writes in flight; three on their way through the host
        (
            [_bucket(10, N, H)],
            False,
            {
                D: {fp.WORKING_WEIGHTS: 20, fp.GRADS_IN_FLIGHT: 0},
                N: {fp.GRADS: 40, fp.NVME_JOURNAL: 4 * 40},
                H: {
                    fp.OPTIM_STATE: 120,
                    fp.GRADS_TO_NVME: 3 * 40,
                    fp.WEIGHT_STAGING: 20,
                    fp.PAGE_ROUNDING: _pages(40, 40, 40, 40, 40, 40, 20),
                },
            },
        ),
        # grads on the device, state on the host: Adam needs them copied to the host for the step
        (
            [_bucket(10, D, H)],
            False,
            {
                D: {fp.WORKING_WEIGHTS: 20, fp.GRADS: 40, fp.GRADS_IN_FLIGHT: 0},
                H: {
                    fp.OPTIM_STATE: 120,
                    fp.GRADS_FOR_STEP: 40,
                    fp.WEIGHT_STAGING: 20,
                    fp.PAGE_ROUNDING: _pages(40, 40, 40, 40, 20),
                },
            },
        ),
    ],
)
def test_footprint_by_hand(buckets, overlap, expect):
    assert fp.footprint(buckets, [], BF16, overlap=overlap) == expect


def test_weights_sharded_over_ranks_by_hand():
    """Under data parallelism a rank keeps its chunk of sharded weights (one host buffer per
    bucket), and the device room for gathered buckets: held ones (``gathered_at_once`` of the
    largest) plus two of the largest gathered ahead, never more than all of them; a chunk on NVMe
    is read into a host buffer for its gather; Adam writes a chunk on its own tier in place. A
    chunk beside its master is not kept but rounded from it for each gather (NOTE [A chunk
    rounded from its master]), except under overlap_step, and the update writes none of it."""
    host = [_bucket(10, H, H, param=H), _bucket(6, H, H, param=H, index=1)]
    need = fp.footprint(host, [], BF16, world=2, gathered_at_once=1)
    assert fp.WORKING_WEIGHTS not in need[H]  # rounded from the masters
    assert need[H][fp.GATHER_ROUNDED] == 2 * (2 * 5)  # both buckets in flight at most (1 held + 2 ahead)
    # state (3 parts) and grads of each chunk, the whole-bucket state a checkpoint reads, the two rounded chunks
    buffers = [20, 20, 20, 12, 12, 12, 20, 12, 40, 40, 40, 10, 10]
    assert need[H][fp.PAGE_ROUNDING] == sum(fp.host_buffer_bytes(n) - n for n in buffers)  # no scratch
    kept = fp.footprint(host, [], BF16, world=2, gathered_at_once=1, overlap=True)
    assert kept[H][fp.WORKING_WEIGHTS] == 2 * (5 + 3)  # half of each bucket, in bf16
    assert fp.GATHER_ROUNDED not in kept[H]
    assert fp.WEIGHT_STAGING not in need[H]  # in place
    assert need[D][fp.GATHERED] == min(2 * 16, 1 * 20 + 2 * 20)  # capped by all the buckets gathered
    many = [_bucket(10, H, H, param=H, index=i) for i in range(8)]
    assert fp.footprint(many, [], BF16, world=2, gathered_at_once=2)[D][fp.GATHERED] == (2 + 2) * 20
    nvme = fp.footprint([_bucket(11, H, N, param=N)], [], BF16, world=2, gathered_at_once=1)
    assert nvme[N][fp.WORKING_WEIGHTS] == 2 * 6  # 11 in two chunks of 6 (the last padded)
    assert nvme[N][fp.NVME_JOURNAL] == 3 * 12 * 6 + 2 * 2 * 6
    assert nvme[H][fp.GATHER_STAGING] == 2 * 6 and nvme[H][fp.WEIGHT_STAGING] == 2 * 6
    device = fp.footprint(host[:1] + [_bucket(10, H, H, index=1)], [], BF16, world=2, gathered_at_once=1)
    assert device[D][fp.WORKING_WEIGHTS] == 2 * 10  # on the device: whole on every rank (ZeRO-2)...
    sharded = fp.footprint(
        host[:1] + [_bucket(10, H, H, index=1)], [], BF16, world=2, gathered_at_once=1, shard_weights=True
    )
    assert sharded[D][fp.WORKING_WEIGHTS] == 2 * 5  # ...unless shard_weights
    assert sharded[H][fp.WEIGHT_STAGING] == 2 * 5  # Adam's output, on its way to the device's chunk
    # a CPU device: its chunk beside the master on the host is rounded from it, nothing staged
    on_cpu = fp.footprint(
        host[:1] + [_bucket(10, H, H, index=1)],
        [],
        BF16,
        world=2,
        gathered_at_once=1,
        shard_weights=True,
        device_is_host=True,
    )
    assert fp.WORKING_WEIGHTS not in on_cpu[D] and fp.WEIGHT_STAGING not in on_cpu[H]
    assert on_cpu[D][fp.GATHER_ROUNDED] == 2 * 5 and on_cpu[H][fp.GATHER_ROUNDED] == 2 * 5  # one bucket each
    assert fp.footprint(host, [], BF16, shard_weights=True) == fp.footprint(host, [], BF16)  # alone: nothing


def test_gathers_held_counts_nested_modules_and_one_op():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    m = Outer()
    buckets = []
    for i, p in enumerate([m.scale, m.inner[0].weight, m.inner[0].bias, m.inner[1].weight, m.inner[1].bias]):
        b = _bucket(0, H, H, param=H, index=i)
        b.add(f"p{i}", p, i)
        buckets.append(b)
    # Outer's bucket while inner[0] (two buckets) runs, plus one op reading as many as a module's
    assert fp.gathers_held(m, buckets, {b.index for b in buckets}) == 3 + 2
    assert fp.gathers_held(m, buckets, {0}) == 1 + 1


def test_frozen_grads_in_flight_and_largest_module():
    frozen = [
        (torch.empty(5, dtype=torch.float32, device="meta"), N),  # meta: nothing allocated; its copy on NVMe
        (torch.empty(3, dtype=torch.int64, device="meta"), D),  # not floating point: its own size
        (torch.empty(6, dtype=torch.float16, device="meta"), D),  # the working dtype: no host copy
        (torch.empty(4, dtype=torch.bfloat16, device="meta"), H),  # another 2-byte dtype: a host copy
    ]  # NOTE [Frozen weights keep one copy]: a copy only where the dtype is not the working one, beside an NVMe home on NVMe
    b = _bucket(0, H, H)
    b.add("w", nn.Parameter(torch.empty(7)), 0)
    b.add("v", nn.Parameter(torch.empty(2)), 1)
    need = fp.footprint([b], frozen, torch.float16, largest_module=123)
    assert need[N][fp.FROZEN_WEIGHTS] == 2 * 5  # once: frozen weights are written once
    assert need[D][fp.FROZEN_WEIGHTS] == 3 * 8 + 6 * 2
    assert need[H][fp.FROZEN_WEIGHTS] == 4 * 2
    assert need[H][fp.FROZEN_COPY] == 4 * 2
    assert need[N][fp.FROZEN_COPY] == 5 * 4
    assert need[D][fp.GRADS_IN_FLIGHT] == 7 * 2  # the largest parameter's grad, in fp16
    assert need[D][fp.LARGEST_MODULE] == 123


def test_totals():
    need = {D: {fp.WORKING_WEIGHTS: 5, fp.GRADS_IN_FLIGHT: 3}, H: {fp.FROZEN_COPY: 7}}
    assert fp.totals(need) == {D: 8, H: 7, N: 0}
    assert fp.totals(need, fp.TRAINING_STATE) == {D: 5, H: 0, N: 0}


def test_largest_module_bytes():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert fp.largest_module_bytes(m, {}, BF16) == 0
    assert fp.largest_module_bytes(m, {"0.weight": N, "2.weight": N, "2.bias": N}, BF16) == 2 * 32
    assert fp.largest_module_bytes(m, {"0.weight": H, "0.bias": H, "2.weight": H}, torch.float32) == 4 * 40


@dataclass
class _Store:
    used: int
    allowed: int


def test_check_fits():
    need = {D: {fp.WORKING_WEIGHTS: 600, fp.GRADS_IN_FLIGHT: 0}, H: {fp.GRADS: 100}}
    fp.check_fits(need, {D: _Store(400, 1000), H: _Store(0, 100)})
    with pytest.raises(
        OutOfTierMemory,
        match=r"^tiermem: out of device memory.*it needs 600 B there "
        r"\(working weights 600 B\); raise Budgets\(device=\.\.\.\) "
        r"to at least 1001 B",
    ) as e:
        fp.check_fits(need, {D: _Store(401, 1000), H: _Store(0, 100)})
    assert (e.value.tier, e.value.asked) == (D, 600)
    with pytest.raises(ConfigError, match=r"^tiermem: the policy places tensors on host but no host store"):
        fp.check_fits(need, {D: _Store(0, 1000)})


# -- one rule for the constructor and for `tiermem plan` -------------------------------------------
def _models():
    return {
        "TinyGPT": TinyGPT,
        "Quirky": Quirky,  # tied weights; a frozen layer and BatchNorm buffers
        "Linears": lambda: nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 13), nn.Linear(13, 5)),
    }


POLICIES = {
    "ZeroOffload": ZeroOffload(),
    "KeepOnDevice": KeepOnDevice(),
    "ZeroInfinity": ZeroInfinity(),
    "ActivationOffload": ActivationOffload(ZeroOffload(), min_bytes=0),
    "ActivationOffload(ZeroInfinity)": ActivationOffload(ZeroInfinity(), tier=Tier.NVME),
}


def _placement(policy) -> dict[TensorClass, Tier]:
    """The policy's home for each class, as ``tiermem plan`` takes it (all built-ins place per class)."""
    return {
        kind: policy.place(TensorInfo("x.weight", kind, 4096, (32, 32), torch.float32, "x")) for kind in TensorClass
    }


def _footprint_of(
    model: nn.Module, policy, dtype: torch.dtype, overlap: bool, bucket_numel: int, spec=None, built: bool = False
):
    """The footprint of ``model`` as TieredModel plans it (and the inputs the old rule took);
    ``built``: as TieredModel's default device builds it (no weight staging on a CPU device: NOTE
    [A CPU device])."""
    planned = plan_placement(model, policy, spec or AdamW(), dtype, bucket_numel, overlap=overlap)
    buckets, homes = list(planned.buckets), dict(planned.weight_homes)
    frozen = [(p, homes.get(n, D)) for n, p in model.named_parameters() if not p.requires_grad]
    largest_module = fp.largest_module_bytes(model, homes, dtype)
    cpu = built and not torch.cuda.is_available()  # TieredModel's default device
    need = fp.footprint(buckets, frozen, dtype, overlap=overlap, largest_module=largest_module, device_is_host=cpu)
    return need, (buckets, frozen, largest_module, homes)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("precision", sizing.PRECISIONS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", _models())
def test_plan_and_constructor_agree(model, policy, precision, overlap):
    module, dtype = _models()[model](), DTYPES[precision]
    need, _ = _footprint_of(module, POLICIES[policy], dtype, overlap, bucket_numel=97)
    # `tiermem plan`'s code path, from the parameter counts alone: the training-state part
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    planned = sizing.tier_bytes(trainable, precision, _placement(POLICIES[policy]), frozen=n_frozen)
    assert fp.totals(need, fp.TRAINING_STATE) == planned
    # `tiermem plan --policy auto`'s and Auto's judge: the whole footprint, page rounding and the NVMe
    # journal included, nothing added
    judge = Evaluator(
        module, AdamW(), dtype, 97, limits={D: 1 << 40, H: 1 << 40, N: 1 << 40}, machine=lambda: None, overlap=overlap
    )
    assert dict(judge(POLICIES[policy], predict=False).need) == fp.totals(need)


class WeightsOnHost(PerClass):
    """Every weight in its own host buffer: a page each, however small (a LayerNorm's bias)."""

    homes = {TensorClass.PARAM: H, TensorClass.GRAD: H, TensorClass.OPTIM_STATE: H, TensorClass.ACTIVATION: D}


def _many_small() -> nn.Module:
    """Many parameters far under a page (LayerNorms of width 5), one of them frozen."""
    m = nn.Sequential(*(nn.Sequential(nn.Linear(5, 5), nn.LayerNorm(5)) for _ in range(12)))
    m[3][1].requires_grad_(False)
    return m


BUILT = {"TinyGPT": TinyGPT, "Quirky": Quirky, "ManySmall": _many_small}
#: what only a running step takes (or the largest module's weights, on the device while it runs)
STEP_ONLY = frozenset({fp.GRADS_IN_FLIGHT, fp.LARGEST_MODULE})


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", [*POLICIES, "WeightsOnHost"])
@pytest.mark.parametrize("model", BUILT)
def test_what_construction_allocates(model, policy, overlap, tmp_path):
    """TieredModel's stores after construction hold exactly what the footprint says, page rounding
    of every host buffer included, except what only a running step takes (grads in flight, the
    largest module's weights)."""
    pol = WeightsOnHost() if policy == "WeightsOnHost" else POLICIES[policy]
    need, _ = _footprint_of(BUILT[model](), pol, BF16, overlap, bucket_numel=300, built=True)
    tm = TieredModel(
        BUILT[model](), pol, precision="bf16", bucket_size=4 * 300, overlap_step=overlap, nvme_dir=str(tmp_path)
    )
    allocated = frozenset(set().union(*need.values()) - STEP_ONLY)
    expect = fp.totals(need, allocated)  # the step's grads too: their room is held (NOTE [Grads come and go])
    peak = tm.report().peak_bytes
    assert peak[D] == expect[D]
    assert peak[H] == expect[H]
    if Tier.NVME in peak:  # each value once; the journal is room for writes in flight, taken by steps
        assert peak[N] <= fp.totals(need)[N]
    tm.detach()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", ["ZeroInfinity", "WeightsOnHost", "ZeroOffload"])
@pytest.mark.parametrize("model", ["TinyGPT", "ManySmall"])
def test_what_construction_allocates_with_a_bf16_master(model, policy, overlap, tmp_path):
    """As above with 8-bit moments and a bf16 master, which off the device is the weights
    themselves (NOTE [One copy of bf16 master weights]; with overlap_step, a copy of its own)."""
    pol = WeightsOnHost() if policy == "WeightsOnHost" else POLICIES[policy]
    spec = AdamW8bit(min_8bit_size=64, bf16_stochastic_round=True)
    need, _ = _footprint_of(BUILT[model](), pol, BF16, overlap, bucket_numel=300, spec=spec, built=True)
    tm = TieredModel(
        BUILT[model](),
        pol,
        optimizer=spec,
        precision="bf16",
        bucket_size=4 * 300,
        overlap_step=overlap,
        nvme_dir=str(tmp_path),
    )
    allocated = frozenset(set().union(*need.values()) - STEP_ONLY)
    expect = fp.totals(need, allocated)
    peak = tm.report().peak_bytes
    assert (peak[D], peak[H]) == (expect[D], expect[H])
    if Tier.NVME in peak:
        assert peak[N] <= fp.totals(need)[N]
        assert peak[N] >= fp.totals(need, fp.TRAINING_STATE)[N]  # the weights and state, each once, all written
    tm.detach()


def test_many_small_weights_on_the_host_fit_only_with_their_pages():
    """A host budget that holds the bytes but not the pages was built and then failed; the fit
    check now refuses it up front, naming the rounding, and accepts the bytes with their pages."""
    need, _ = _footprint_of(_many_small(), WeightsOnHost(), BF16, False, bucket_numel=2**20)
    rounding = need[H][fp.PAGE_ROUNDING]
    assert rounding >= 4096 * 24  # a page for each of the dozens of small weights, at least
    host = fp.totals(need)[H]
    with pytest.raises(OutOfTierMemory, match=r"host buffers rounded up to whole pages"):
        TieredModel(_many_small(), WeightsOnHost(), budgets=Budgets(host=host - rounding // 2))
    tm = TieredModel(_many_small(), WeightsOnHost(), budgets=Budgets(host=host))
    x = torch.randn(4, 5)
    for _ in range(2):
        tm.backward(tm(x).float().square().mean())
        tm.step()
    assert tm.report().peak_bytes[H] <= host


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_the_footprint_rounds_host_buffers_as_the_pool_does(nbytes):
    assert fp.host_buffer_bytes(nbytes) == round_up(max(nbytes, 1))
    pool = HostStore(budget=1 << 20, pin=False)
    pool.allocate("x", (nbytes,), torch.uint8)
    assert pool.ledger.used == fp.host_buffer_bytes(nbytes)


# -- staging between NVMe and the device, on a GPU -------------------------------------------------
def test_nvme_staging_by_hand():
    """On a GPU the host stages the four largest weights that live on NVMe (trainable or frozen,
    one per NVMe lane thread), each rounded to pages as the pool leases it; on the CPU none."""
    b = _bucket(0, H, N, param=N)
    for i, numel in enumerate([300, 7, 1000, 20, 5000]):
        b.add(f"w{i}", nn.Parameter(torch.empty(numel)), i)
    frozen = [(torch.empty(2500, device="meta"), N), (torch.empty(9999, device="meta"), H)]  # on the host: none
    cpu = fp.footprint([b], frozen, BF16)
    gpu = fp.footprint([b], frozen, BF16, nvme_staging=True)
    assert fp.NVME_THREADS == 4 and fp.NVME_STAGING not in cpu[H]
    staged = [2 * 5000, 2 * 2500, 2 * 1000, 2 * 300]  # bf16 bytes of the four largest on NVMe
    assert gpu[H][fp.NVME_STAGING] == sum(staged)
    assert gpu[H][fp.PAGE_ROUNDING] - cpu[H][fp.PAGE_ROUNDING] == sum(fp.host_buffer_bytes(n) - n for n in staged)
    assert {t: p for t, p in gpu.items() if t != H} == {t: p for t, p in cpu.items() if t != H}
    one = fp.footprint([_bucket(0, H, N, param=N)], [(torch.empty(3, device="meta"), N)], BF16, nvme_staging=True)
    assert one[H][fp.NVME_STAGING] == 6  # fewer weights than threads: each once
    on_host = fp.footprint([b], [], BF16, nvme_staging=True, overlap=True)
    assert fp.NVME_STAGING in on_host[H]  # overlap_step changes nothing here
    assert fp.NVME_STAGING not in fp.footprint([_bucket(10, H, H)], [], BF16, nvme_staging=True)[H]


def test_nvme_staging_is_what_the_gpu_path_leases(gpu_mode, tmp_path):  # noqa: F811 - the fixture imported above
    """The engine's GPU control flow (stand-in streams, tests/test_gpu_paths.py) under ZeRO-Infinity
    training: the NVMe staging buffers live at once, as the host pool counts them (whole pages),
    stay within the footprint's NVMe staging and its pages; the CPU path leases none. The thread
    count the footprint multiplies by is the lanes' own."""
    import threading

    from models import gpt_batch, gpt_loss

    _, (buckets, frozen, largest, _) = _footprint_of(TinyGPT(), ZeroInfinity(), BF16, False, bucket_numel=4096)
    need = fp.footprint(buckets, frozen, BF16, largest_module=largest, nvme_staging=True)
    staged = sorted((s.numel * 2 for b in buckets for s in b.slots), reverse=True)[: fp.NVME_THREADS]
    assert need[H][fp.NVME_STAGING] == sum(staged)
    judge = Evaluator(
        TinyGPT(),
        AdamW(),
        BF16,
        4096,
        limits={D: 1 << 40, H: 1 << 40, N: 1 << 40},
        machine=lambda: None,
        nvme_staging=True,
    )
    assert dict(judge(ZeroInfinity(), predict=False).need) == fp.totals(need)  # Auto judges with it too
    make, _ = gpu_mode
    names = {n for n, _ in TinyGPT().named_parameters()}
    peaks = {}
    for gpu in (False, True):
        (tmp_path / str(gpu)).mkdir()
        tm = TieredModel(
            TinyGPT(),
            ZeroInfinity(),
            optimizer=AdamW(lr=1e-2),
            precision="bf16",
            bucket_size=2 * 4096,
            nvme_dir=str(tmp_path / str(gpu)),
            budgets=Budgets(host=fp.totals(need)[H]),
        )
        assert tm.engine.lanes.pools["nvme"]._max_workers == fp.NVME_THREADS
        if gpu:
            tm.engine.lanes.close()
            tm.engine.lanes = tm.engine._copies.lanes = make().lanes
        host, live, peak, lock = tm.stores[H], {}, [0, 0], threading.Lock()
        acquire, release = host.acquire, host.release

        def leased(nbytes, key, kind=None, acquire=acquire, live=live, peak=peak, lock=lock):
            buf = acquire(nbytes, key, kind)
            if (
                key.startswith("<staging ") and key[len("<staging ") : -1] in names
            ):  # a weight's, not a converting copy's
                with lock:
                    live[key] = buf.numel()  # what the pool counts: whole pages
                    peak[:] = max(peak[0], sum(live.values())), max(peak[1], len(live))
            return buf

        def returned(key, buf, release=release, live=live, lock=lock):
            with lock:
                live.pop(key, None)
            release(key, buf)

        host.acquire, host.release = leased, returned
        for i in range(3):
            x, y = gpt_batch(i)
            tm.backward(gpt_loss(tm(x), y))
            tm.step()
        peaks[gpu] = tuple(peak)
        tm.detach()
    assert peaks[False] == (0, 0)  # the CPU path reads NVMe into the device buffer itself
    assert 0 < peaks[True][0] <= sum(fp.host_buffer_bytes(n) for n in staged)
    assert 1 <= peaks[True][1] <= fp.NVME_THREADS
