"""An inference-only TieredModel (``optimizer=None``, NOTE [Inference only]) and ``tm.generate``:
the same tokens as the transformers model in memory in the same precision, with the weights on the
device, the host and NVMe, from a model in memory or on the meta device with ``weights=``; no
gradient or optimizer-state bytes; training calls refused, changing nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tiermem
from tiermem import AdamW, Budgets, TensorClass, Tier, TieredModel, TierMemError
from tiermem.memory.aligned import round_up
from tiermem.policies import KeepOnDevice, ZeroInfinity

transformers = pytest.importorskip("transformers")

from ranks import run_ranks  # noqa: E402
from test_zero3 import WeightsOnHost  # noqa: E402  (every weight homed on the host)

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64)
SPLIT_HOST = 12 * 4096  # twelve host pages: the norms and the small projections, not the embeddings


def _config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen2":
        return transformers.Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2)
    assert family == "mixtral"
    return transformers.MixtralConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    )


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(family)).eval()


def _where(placement: str, tmp_path) -> dict:
    return {
        "device": {"policy": KeepOnDevice()},
        "host": {"policy": WeightsOnHost()},
        # no host room: every weight on NVMe (NOTE [Resident weights for inference])
        "nvme": {"policy": ZeroInfinity(), "nvme_dir": str(tmp_path), "budgets": Budgets(host=0)},
        # the host holds about half the weights' bytes: those stay, the rest stream from NVMe
        "split": {"policy": ZeroInfinity(), "nvme_dir": str(tmp_path), "budgets": Budgets(host=SPLIT_HOST)},
    }[placement]


def _prompts() -> dict:
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt left-padded
    return {"input_ids": ids, "attention_mask": mask}


def _decoding(beam: bool) -> dict:
    extra = {"num_beams": 3, "early_stopping": True} if beam else {}
    return {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, **extra}


def _in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model as transformers loads it in ``dtype`` (``from_pretrained(..., torch_dtype=dtype)``):
    its weights in ``dtype``, the buffers it computes when built (rotary ``inv_freq``) as built."""
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(model.config, torch_dtype=dtype)
    ref.to_empty(device="cpu")
    for name, buf in model.named_buffers():  # the computed ones: not in the state dict
        if ref.get_buffer(name).is_floating_point() and name not in model.state_dict():
            ref.get_buffer(name).copy_(buf)
    ref.load_state_dict(model.state_dict())
    return ref.eval()


def _expected(model: nn.Module, dtype: torch.dtype, beam: bool) -> torch.Tensor:
    """The oracle: the same model in memory, as transformers loads it in the same precision."""
    ref = _in_dtype(model, dtype)
    with torch.no_grad():
        return ref.generate(**_prompts(), **_decoding(beam))


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("placement", ["device", "host", "nvme", "split"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
def test_generate_same_tokens_as_in_memory(family, placement, precision, tmp_path):
    model = _model(family)
    expected = {beam: _expected(model, DTYPES[precision], beam) for beam in (False, True)}
    tm = TieredModel(model, optimizer=None, precision=precision, device="cpu", **_where(placement, tmp_path))
    for beam in (False, True):
        got = tm.generate(**_prompts(), **_decoding(beam))
        assert torch.equal(got, expected[beam]), (beam, got, expected[beam])
    assert not tm.training  # it was built from a model in eval mode, and is so again
    if placement != "device":
        assert tm.weight_sources(), "the weights were not homed off the device"


@pytest.mark.parametrize("precision", list(DTYPES))
def test_meta_model_with_weights_generates_the_same(precision, tmp_path):
    model = _model("llama")
    model.save_pretrained(tmp_path / "ckpt")  # safetensors
    expected = _expected(model, DTYPES[precision], beam=False)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    kw = dict(optimizer=None, precision=precision, device="cpu")
    tm = TieredModel(meta, ZeroInfinity(), nvme_dir=str(tmp_path), weights=tmp_path / "ckpt", **kw)
    assert torch.equal(tm.generate(**_prompts(), **_decoding(False)), expected)
    again = tiermem.from_pretrained(tmp_path / "ckpt", WeightsOnHost(), **kw)
    assert torch.equal(again.generate(**_prompts(), **_decoding(False)), expected)


def test_save_pretrained_and_resident_writes(tmp_path):
    """What an inference model saves is its working-precision weights, and a write inside
    ``tm.resident`` reaches a weight's home on NVMe."""
    model = _model("llama")
    tm = TieredModel(model, ZeroInfinity(), optimizer=None, precision="bf16", device="cpu", nvme_dir=str(tmp_path))
    with tm.resident(model.lm_head), torch.no_grad():
        model.lm_head.weight.mul_(2)
    tm.save_pretrained(tmp_path / "out")
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    ref = _in_dtype(_model("llama"), torch.bfloat16)
    with torch.no_grad():
        ref.lm_head.weight.mul_(2)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in saved.state_dict().items())
    with torch.no_grad():
        expected = ref.generate(**_prompts(), **_decoding(False))
    assert torch.equal(tm.generate(**_prompts(), **_decoding(False)), expected)


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_inference_keeps_the_weights_only(placement, tmp_path):
    """No GRAD and no OPTIM_STATE bytes anywhere; at their home, the weights' bytes in the working
    dtype (in page-aligned buffers on the host, exact on NVMe) and nothing on the other tier."""
    model = _model("llama")
    sizes = [p.numel() * 2 for p in model.parameters()]  # bf16
    tm = TieredModel(model, optimizer=None, precision="bf16", device="cpu", **_where(placement, tmp_path))
    tm.generate(**_prompts(), **_decoding(False))
    peaks = {k: n for k, n in tm.report().class_peak_bytes.items() if n}
    assert {c for c, _ in peaks} <= {TensorClass.PARAM, TensorClass.ACTIVATION}, peaks
    if placement == "host":
        assert peaks[TensorClass.PARAM, Tier.HOST] == sum(round_up(n) for n in sizes), peaks
        assert (TensorClass.PARAM, Tier.NVME) not in peaks
    else:
        assert peaks[TensorClass.PARAM, Tier.NVME] == sum(sizes), peaks
        assert (TensorClass.PARAM, Tier.HOST) not in peaks
    assert tm.model_plan.summary()["trainable_params"] == 0
    assert not tm.model_plan.buckets and tm.optimizer_spec is None


def test_training_calls_are_refused_and_change_nothing(tmp_path):
    model = _model("llama")
    tm = TieredModel(model, optimizer=None, precision="fp32", device="cpu", **_where("host", tmp_path))
    before = tm.state_dict()
    loss = tm(torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 4, dtype=torch.long)).loss
    with pytest.raises(TierMemError, match=r"tiermem: tm.backward\(\).*inference \(optimizer=None\).*AdamW"):
        tm.backward(loss)
    for step in (tm.step, tm.optimizer.step):
        with pytest.raises(TierMemError, match=r"tiermem: tm.step\(\).*inference \(optimizer=None\)"):
            step()
    with pytest.raises(TierMemError, match=r"tiermem: tm.optimizer.add_param_group\(\).*inference"):
        tm.optimizer.add_param_group({"params": [next(model.parameters())]})
    after = tm.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert tm.phase.name == "IDLE"


def test_state_dict_and_detach_give_working_precision_values_and_flags_back():
    model = _model("llama")
    model.lm_head.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    tm = TieredModel(model, optimizer=None, precision="bf16", device="cpu", policy=WeightsOnHost())
    sd = tm.state_dict()
    assert all(torch.equal(sd[k], expected[k]) for k in sd if sd[k].is_floating_point())
    back = tm.detach()
    assert {n: p.requires_grad for n, p in back.named_parameters()} == flags
    assert all(torch.equal(v, expected[k]) for k, v in back.state_dict().items() if v.is_floating_point())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"grad_clip": 1.0}, r"tiermem: grad_clip=1.0 is a training option, but optimizer=None"),
        ({"overlap_step": True}, r"tiermem: overlap_step=True is a training option"),
        ({"update_in_backward": True}, r"tiermem: update_in_backward=True is a training option"),
    ],
)
def test_training_options_refused_for_inference(kwargs, match):
    model = _model("llama")
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(TierMemError, match=match):
        TieredModel(model, optimizer=None, device="cpu", **kwargs)
    assert [p.requires_grad for p in model.parameters()] == flags


def test_failed_construction_gives_the_module_back(tmp_path):
    """A construction that fails after the parameters were taken leaves them as they were."""
    model = _model("llama")
    before = {n: (p.dtype, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(TierMemError, match="nvme_dir"):
        # no host room, so the weights go to NVMe, and no nvme_dir
        TieredModel(model, ZeroInfinity(), optimizer=None, precision="bf16", device="cpu", budgets=Budgets(host=0))
    for n, p in model.named_parameters():
        dtype, flag, value = before[n]
        assert (p.dtype, p.requires_grad) == (dtype, flag) and torch.equal(p, value)


def test_generate_needs_a_module_that_generates():
    tm = TieredModel(nn.Linear(4, 4), optimizer=None, device="cpu")
    with pytest.raises(
        TierMemError, match=r"tiermem: tm.generate\(...\) runs the module's own generate\(\), and Linear"
    ):
        tm.generate(torch.ones(1, 4))


def test_generate_on_a_training_model_restores_its_mode():
    model = _model("llama").train()
    expected = _expected(model, torch.float32, beam=False)
    tm = TieredModel(model, precision="fp32", device="cpu")  # optimizer left out: AdamW
    assert tm.optimizer_spec == AdamW() and tm.layout.n_params > 0
    assert torch.equal(tm.generate(**_prompts(), **_decoding(False)), expected)
    assert tm.training
    out = tm(**_prompts(), labels=_prompts()["input_ids"])
    tm.backward(out.loss)
    assert not tm.step().skipped


def test_weights_stream_along_the_recorded_order(tmp_path):
    """With a device budget smaller than the weights, each forward ends an iteration of the weights'
    order (there is no step): after the first forward every weight is prefetched or still there,
    none fetched on demand, and the tokens are the same."""
    model = _model("llama")
    expected = _expected(model, torch.float32, beam=False)
    tm = TieredModel(
        model,
        ZeroInfinity(),
        optimizer=None,
        precision="fp32",
        device="cpu",
        nvme_dir=str(tmp_path),
        budgets=Budgets(device="80KiB", host=0),  # every weight on NVMe, a few at a time on the device
    )
    assert torch.equal(tm.generate(**_prompts(), **_decoding(False)), expected)
    scheduler = tm.param_offload.scheduler
    first, *later = scheduler.history
    assert scheduler.trace is not None and len(later) == _decoding(False)["max_new_tokens"] - 1
    assert first.misses > 0 and sum(h.misses for h in later) == 0
    assert sum(h.prefetches for h in later) > 0 and scheduler.stats.evictions > 0  # it streamed


def test_sampling_and_an_eval_forward_match_in_memory(tmp_path):
    """Sampling draws the same tokens from the same generator state; ``tm.eval()`` and ``tm(...)``
    give the in-memory model's logits."""
    model = _model("qwen2")
    ref = _in_dtype(model, torch.bfloat16)
    sampling = {**_decoding(False), "do_sample": True, "top_k": 20, "temperature": 0.9}
    torch.manual_seed(5)
    with torch.no_grad():
        expected, logits = ref.generate(**_prompts(), **sampling), ref(**_prompts()).logits
    tm = TieredModel(model, optimizer=None, precision="bf16", device="cpu", **_where("nvme", tmp_path))
    torch.manual_seed(5)
    assert torch.equal(tm.generate(**_prompts(), **sampling), expected)
    with torch.no_grad():
        assert torch.equal(tm.eval()(**_prompts()).logits, logits)


def test_resident_weights_order():
    """Under a MiB the smallest first (a request costs more than the bytes), then the largest first
    (a big read cannot hide behind a layer's compute); each whole, in whole pages, skipped where it
    does not fit; ties in forward order (NOTE [Resident weights for inference])."""
    from tiermem.plan.policy import ModelInfo
    from tiermem.policies.zero_infinity import resident_weights
    from tiermem.types import TensorInfo

    sizes = {"norm": 2048, "embed": 65 << 20, "q": 2 << 20, "mlp": 6 << 20, "bias": 512 << 10, "head": 65 << 20}
    model = ModelInfo(
        tuple(TensorInfo(n, TensorClass.PARAM, b, (b // 2,), torch.bfloat16) for n, b in sizes.items()), inference=True
    )
    assert resident_weights(model, 4096) == {"norm"}
    assert resident_weights(model, (512 << 10) + 4096) == {"norm", "bias"}
    # head does not fit beside embed: skipped, and mlp, next in line, is taken
    assert resident_weights(model, (65 << 20) + (6 << 20) + (1 << 20)) == {"norm", "bias", "embed", "mlp"}
    assert resident_weights(model, (130 << 20) + (512 << 10) + 8192) == {"norm", "bias", "embed", "head"}
    assert resident_weights(model, (138 << 20) + (1 << 20)) == {"norm", "bias", "embed", "head", "mlp", "q"}
    assert resident_weights(model, 0) == frozenset()


def test_resident_weights_past_the_planners_limit_drop_the_last_chosen():
    """Where the planner says the choice passes the host's limit (here: any resident weight costs
    8 MiB more), the weights chosen last stay on NVMe, until it fits; those ranked first stay."""
    from types import SimpleNamespace

    from tiermem.plan.policy import ModelInfo
    from tiermem.types import TensorInfo

    sizes = {"norm": 2048, "embed": 65 << 20, "q": 2 << 20, "mlp": 6 << 20, "head": 65 << 20}

    def evaluate(policy, predict=True):
        on_host = getattr(policy, "on_host", frozenset())
        return SimpleNamespace(need={Tier.HOST: sum(round_up(sizes[n]) for n in on_host) + (8 << 20) * bool(on_host)})

    infos = tuple(TensorInfo(n, TensorClass.PARAM, b, (b // 2,), torch.bfloat16) for n, b in sizes.items())
    limit = (138 << 20) + 4096  # all five by bytes alone; with the 8 MiB, the two 65 MB weights and the norm
    model = ModelInfo(infos, limits={Tier.HOST: limit}, evaluate=evaluate, inference=True)
    bound = ZeroInfinity().for_model(model)
    assert bound.on_host == {"norm", "embed", "head"}  # mlp and q, chosen last, dropped
    assert evaluate(bound).need[Tier.HOST] <= limit


def test_resident_weights_are_the_smallest_that_fit(tmp_path):
    """ZeroInfinity for inference keeps on the host the weights its limit holds (those of this tiny
    model are all under a MiB: the smallest first), each in whole pages; the rest stay on NVMe (NOTE
    [Resident weights for inference]). The host peak and the NVMe bytes say where each weight went."""
    model = _model("llama")
    named = dict(model.named_parameters())  # tied weights once
    order = sorted(enumerate(named.items()), key=lambda i: (i[1][1].numel(), i[0]))
    room, expected = SPLIT_HOST, set()
    for _, (name, p) in order:
        if round_up(p.numel() * 2) > room:
            break
        expected.add(name)
        room -= round_up(p.numel() * 2)
    assert 0 < len(expected) < len(named)  # the budget splits them
    tm = TieredModel(model, optimizer=None, precision="bf16", device="cpu", **_where("split", tmp_path))
    assert tm.model_plan.placement.on_host == expected
    tm.generate(**_prompts(), **_decoding(False))
    peaks = tm.report().class_peak_bytes
    host = sum(round_up(named[n].numel() * 2) for n in expected)
    assert peaks[TensorClass.PARAM, Tier.HOST] == host <= SPLIT_HOST
    assert peaks[TensorClass.PARAM, Tier.NVME] == sum(p.numel() * 2 for n, p in named.items() if n not in expected)


def test_training_keeps_zero_infinity_weights_on_nvme(tmp_path):
    """The host room goes to weights only for inference: a model built to train keeps ZeroInfinity's
    weights on NVMe whatever the host's limit."""
    model = _model("llama")
    tm = TieredModel(model, ZeroInfinity(), precision="bf16", device="cpu", nvme_dir=str(tmp_path))
    assert not any(t is Tier.HOST for t in tm.model_plan.weight_homes.values())
    assert tm.model_plan.placement is not None and not hasattr(tm.model_plan.placement, "on_host")


class _WithBuffers(nn.Module):
    """A persistent float buffer (statistics, in the state dict) and a computed one (not in it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("stats", torch.full((4,), 1 / 3))
        self.register_buffer("freq", torch.full((4,), 1 / 3), persistent=False)

    def forward(self, x):
        seen.append((self.stats.dtype, self.freq.dtype))
        return self.fc(x) * self.stats.to(x.dtype) + self.freq.to(x.dtype)


seen: list = []


@pytest.mark.parametrize("optimizer", [None, AdamW()])
def test_inference_keeps_computed_buffers_in_their_dtype(optimizer):
    """For inference a non-persistent buffer keeps its dtype, as transformers' from_pretrained in a
    dtype leaves rotary inv_freq; a persistent one takes the working precision, as in training
    (NOTE [Buffers keep their values])."""
    seen.clear()
    tm = TieredModel(_WithBuffers(), optimizer=optimizer, precision="bf16", device="cpu")
    with torch.no_grad():
        tm(torch.ones(2, 4))
    assert seen == [(torch.bfloat16, torch.float32 if optimizer is None else torch.bfloat16)]
    back = tm.detach()
    assert back.freq.dtype == back.stats.dtype == torch.float32 and torch.equal(back.freq, torch.full((4,), 1 / 3))


@pytest.mark.parametrize("batch", [1, 3])
def test_linear_inputs_folded_for_inference(batch):
    """An inference model's weights do not require grad, and torch's matmul then folds an input of
    more than two dims only where its strides nest; the prefill's last-token slice does not (at
    batch 1 too, though is_contiguous() says True), and multiplying it as a batch copies the whole
    weight (258 ms for a bf16 lm_head at batch 1, 1.79 s at 16: RESULTS 2026-12-07). Each Linear gets
    it with fresh strides; the logits are those of the model in memory."""
    model = _model("llama")
    hidden = torch.randn(batch, 5, 32)[:, -1:, :]  # a view into the whole sequence's hidden states
    assert hidden.stride(0) != hidden.stride(1) * hidden.size(1)
    with torch.no_grad():
        expected = model.lm_head(hidden)
    tm = TieredModel(model, optimizer=None, precision="fp32", device="cpu")
    got: list[tuple[int, ...]] = []  # the strides lm_head multiplies, seen after tiermem's hooks
    tm.module.lm_head.register_forward_pre_hook(lambda m, args: got.append(args[0].stride()))
    with torch.no_grad():
        out = model.lm_head(hidden)
    assert got == [(32, 32, 1)] and torch.equal(out, expected)


def test_host_weights_are_read_in_place_on_a_cpu_device():
    """The CPU device computes with host memory: an inference model reads the weights homed there
    where they are (NOTE [Host weights read in place]): no copy moves to the device tier, none is
    counted there, whatever the device budget; the tokens are the in-memory model's."""
    model = _model("llama")
    expected = _expected(model, torch.bfloat16, beam=False)
    tm = TieredModel(
        model, WeightsOnHost(), optimizer=None, precision="bf16", device="cpu", budgets=Budgets(device="16KiB")
    )
    assert torch.equal(tm.generate(**_prompts(), **_decoding(False)), expected)
    report = tm.report()
    assert (TensorClass.PARAM, Tier.DEVICE) not in {k for k, n in report.class_peak_bytes.items() if n}
    assert not any(n for (src, dst), n in report.bytes_moved.items() if dst == Tier.DEVICE), report.bytes_moved


def test_weights_read_in_place_rest_on_their_home_and_go_back_as_copies():
    """A host weight read in place is a plain tensor over its home's memory: a write inside
    ``tm.resident`` is the home's new value (state_dict, tokens); ``detach()`` hands back copies
    off that memory, with the values; a model dropped without ``detach()`` refuses reads of them
    (their memory may be another tensor's by then), never giving a made-up value."""
    model = _model("llama")
    tm = TieredModel(model, WeightsOnHost(), optimizer=None, precision="bf16", device="cpu")
    head = model.lm_head.weight
    home = tm.param_offload.residency.home_value("lm_head.weight")
    assert type(head.data) is torch.Tensor and head.data_ptr() == home.data_ptr()
    before = head.detach().clone()
    with tm.resident(model.lm_head), torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert torch.equal(tm.state_dict()["lm_head.weight"], before * 2)
    back = tm.detach()
    assert back.lm_head.weight.data_ptr() != home.data_ptr() and torch.equal(back.lm_head.weight, before * 2)

    dropped = _model("llama")
    tm = TieredModel(dropped, WeightsOnHost(), optimizer=None, precision="bf16", device="cpu")
    tm.param_offload.remove()  # what giving the model back without detach() does to its weights
    with pytest.raises(TierMemError, match="tiermem:"):
        dropped.lm_head.weight + 1


def _rank_generate(rank, world, tmp, shard_weights, placement):
    """One rank's inference model and its generate, against the same model in memory (NOTE
    [Inference only]); each rank its own prompts, the same number of forwards."""
    model = _model("llama")
    torch.manual_seed(10 + rank)
    ids = torch.randint(3, 97, (2, 6))
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **_decoding(False), "min_new_tokens": 8}
    with torch.no_grad():
        expected = _in_dtype(model, torch.bfloat16).generate(**kw)
    where = _where(placement, tmp)  # each rank its own directory in it
    if placement == "nvme":  # room for the sharded weights' gathers on the host, the weights on NVMe
        where["budgets"] = Budgets(host="32KiB")
    tm = TieredModel(model, optimizer=None, precision="bf16", device="cpu", shard_weights=shard_weights, **where)
    got = tm.generate(**kw)
    read = sum(n for (src, _), n in tm.report().bytes_moved.items() if src is Tier.NVME)
    return bool(torch.equal(got, expected)), tm.group.world, read > 0


@pytest.mark.parametrize(
    "shard_weights, placement", [(False, "host"), (True, "host"), (True, "nvme")], ids=["replicated", "sharded", "nvme"]
)
def test_generate_on_two_ranks(shard_weights, placement, tmp_path):
    """Inference under data parallelism (2 gloo ranks): each rank generates its own prompts with the
    in-memory model's tokens, the weights replicated or sharded over the ranks (gathered per module)."""
    results = run_ranks(_rank_generate, str(tmp_path), shard_weights, placement)
    assert results == [(True, 2, placement == "nvme")] * 2


def test_a_prompt_longer_than_the_positions_is_refused():
    """A prompt past the model's max_position_embeddings: a tiermem: error before anything runs,
    the mode as it was; a prompt that fits then gives the in-memory model's tokens."""
    model = _model("llama").train()
    expected = _expected(model, torch.float32, beam=False)
    tm = TieredModel(model, optimizer=None, precision="fp32", device="cpu")
    too_long = torch.randint(3, 97, (1, SMALL["max_position_embeddings"] + 1))
    with pytest.raises(
        TierMemError, match=r"tiermem: tm.generate\(...\): the prompt has 65 tokens and the model has 64"
    ):
        tm.generate(too_long, max_new_tokens=2)
    assert tm.training
    assert torch.equal(tm.generate(**_prompts(), **_decoding(False)), expected)
