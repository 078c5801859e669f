"""The KV cache of ``tm.generate`` (NOTE [The KV cache is placed], tiermem/plan/kv_cache.py): its
bytes equal those of the cache transformers builds; they are held in a tier's ledger while generate
runs and released after (also when it raises); a device too small puts the cache on the host with
the same tokens; no tier with room refuses the call, changing nothing; ``tiermem plan --generate``
prints the same figure and its tier."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from tiermem import Budgets, Phase, TensorClass, Tier, TieredModel
from tiermem.__main__ import main
from tiermem.errors import OutOfTierMemory
from tiermem.memory.ledger import Ledger
from tiermem.plan import kv_cache
from tiermem.plan.kv_cache import KvShape
from tiermem.policies import KeepOnDevice, ZeroOffload

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, max_position_embeddings=64)


def _model(family: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    return transformers.AutoModelForCausalLM.from_config(config(**SMALL, num_attention_heads=4, num_key_value_heads=2))


def _prompts(rows: int = 2) -> dict:
    torch.manual_seed(1)
    return {"input_ids": torch.randint(3, 97, (rows, 5))}


def _greedy(new: int = 6) -> dict:
    # min_new_tokens: no sequence stops early, so a dynamic cache reaches its full length
    return {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}


def _measured(cache) -> int:
    """The bytes of the keys and values a transformers cache holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


class Probe(transformers.LogitsProcessor):
    """Reads each tier's hold on the KV cache at every decoding step; ``fail_at``: raise at that step."""

    def __init__(self, tm: TieredModel, fail_at: int | None = None):
        self.tm, self.fail_at, self.seen = tm, fail_at, []

    def __call__(self, input_ids, scores):
        self.seen.append({t: s.ledger.held(kv_cache.KEY) for t, s in self.tm.stores.items()})
        if self.fail_at is not None and len(self.seen) > self.fail_at:
            raise RuntimeError("a decoding step failed")
        return scores


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"num_beams": 3},
        {"cache_implementation": "static"},
        {"do_sample": True, "num_return_sequences": 2, "max_new_tokens": None, "max_length": 12, "min_length": 12},
    ],
    ids=["greedy", "beams", "static", "sampled"],
)
def test_bytes_equal_the_cache_transformers_builds(family, extra):
    model = _model(family).to(torch.bfloat16).eval()
    kwargs = {**_prompts(), **_greedy(), **extra, "return_dict_in_generate": True}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if "max_length" in kwargs:
        kwargs.pop("min_new_tokens")
    with torch.no_grad():
        out = model.generate(**kwargs)
    cache = kv_cache.for_call(model, (), kwargs, torch.bfloat16)
    assert cache is not None and cache.nbytes == _measured(out.past_key_values), (cache, extra)
    assert cache.layers == 3 and cache.batch == out.sequences.shape[0] * extra.get("num_beams", 1)
    assert cache.tokens == out.sequences.shape[1] - 1  # the last token is never fed back


def test_the_call_and_config_defaults():
    model = _model()
    ids = _prompts(3)["input_ids"]
    shape = KvShape(layers=3, kv_heads=2, head_dim=8)
    assert KvShape.of(model.config) == shape
    # no length: 20 new tokens; within max_position_embeddings
    assert kv_cache.for_call(model, (ids,), {}, torch.float32).tokens == 5 + 20 - 1
    model.config.max_position_embeddings = 16
    assert kv_cache.for_call(model, (ids,), {}, torch.float32).tokens == 15
    model.generation_config.max_new_tokens = 4  # the model's own generation config
    got = kv_cache.for_call(model, (ids,), {"num_return_sequences": 2, "do_sample": True}, torch.float32)
    assert (got.batch, got.tokens, got.nbytes) == (6, 8, 2 * 3 * 2 * 8 * 4 * 6 * 8)
    assert kv_cache.for_call(model, (ids,), {"use_cache": False}, torch.float32) is None
    assert kv_cache.for_call(torch.nn.Linear(2, 2), (ids,), {}, torch.float32) is None  # no config
    # a config.json's dict, head width from hidden_size, no grouped-query attention
    assert KvShape.of({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}) == KvShape(2, 4, 16)
    assert KvShape.of({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 3}}) == KvShape(
        2, 4, 3
    )
    assert KvShape.of({"hidden_size": 64}) is None
    assert KvShape.of(SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)) == KvShape(2, 4, 16)


def test_a_gpt2_style_config_json_reads_as_transformers_reads_it():
    """GPT-2's config.json says n_layer, n_head, n_embd; transformers' config object maps them."""
    raw = {"model_type": "gpt2", "n_layer": 3, "n_head": 4, "n_embd": 96, "vocab_size": 50}
    config = transformers.GPT2Config(**raw)
    want = KvShape(
        config.num_hidden_layers, config.num_attention_heads, config.hidden_size // config.num_attention_heads
    )
    assert KvShape.of(raw) == KvShape.of(config) == want == KvShape(3, 4, 24)


@pytest.mark.parametrize(
    "grouping", [{"multi_query": True}, {"multi_query_group_num": 2}, {"num_kv_heads": 1}, {"n_head_kv": 1}]
)
def test_a_config_json_whose_kv_heads_it_does_not_say_is_refused(grouping):
    """StarCoder's multi-query attention has one KV head of 48 attention heads: a shape read without
    it would be 48x too large, so none is read (the CLI says to add num_key_value_heads)."""
    raw = {"n_layer": 40, "n_head": 48, "n_embd": 6144, **grouping}
    assert KvShape.of(raw) is None
    assert KvShape.of({**raw, "num_key_value_heads": 1}) == KvShape(40, 1, 128)


def test_held_on_the_device_while_generating_and_released_after():
    model = _model()
    ref = copy.deepcopy(model).to(torch.bfloat16).eval()
    tm = TieredModel(model, KeepOnDevice(), optimizer=None, device="cpu")
    expected = kv_cache.for_call(tm.module, (), {**_prompts(), **_greedy()}, tm.dtype)
    probe = Probe(tm)
    got = tm.generate(**_prompts(), **_greedy(), logits_processor=transformers.LogitsProcessorList([probe]))
    with torch.no_grad():
        assert torch.equal(got, ref.generate(**_prompts(), **_greedy()))
    assert len(probe.seen) == 6 and all(s == {Tier.DEVICE: expected.nbytes, Tier.HOST: 0} for s in probe.seen)
    device = tm.stores[Tier.DEVICE].ledger
    assert device.held(kv_cache.KEY) == 0 and device.kind_used[TensorClass.ACTIVATION] == 0
    assert tm.report().class_peak_bytes[TensorClass.ACTIVATION, Tier.DEVICE] == expected.nbytes
    assert device.peak == tm.model_plan.tier_bytes()[Tier.DEVICE] + expected.nbytes
    # generate raising part way: released all the same, and the next call works
    with pytest.raises(RuntimeError, match="a decoding step failed"):
        tm.generate(**_prompts(), **_greedy(), logits_processor=[Probe(tm, fail_at=2)])
    assert device.held(kv_cache.KEY) == 0 and tm.phase is Phase.IDLE
    assert torch.equal(tm.generate(**_prompts(), **_greedy()), got)


def test_a_device_too_small_puts_it_on_the_host_with_the_same_tokens():
    ref = _model().to(torch.bfloat16).eval()
    with torch.no_grad():
        expected = ref.generate(**_prompts(), **_greedy())
    tm = TieredModel(_model(), ZeroOffload(), optimizer=None, device="cpu")
    need = tm.model_plan.tier_bytes()[Tier.DEVICE]
    cache = kv_cache.for_call(tm.module, (), {**_prompts(), **_greedy()}, tm.dtype)
    tm.detach()
    tm = TieredModel(
        _model(), ZeroOffload(), optimizer=None, device="cpu", budgets=Budgets(device=need + cache.nbytes - 1)
    )
    probe = Probe(tm)
    assert torch.equal(tm.generate(**_prompts(), **_greedy(), logits_processor=[probe]), expected)
    assert probe.seen and all(s == {Tier.DEVICE: 0, Tier.HOST: cache.nbytes} for s in probe.seen)
    assert tm.report().class_peak_bytes[TensorClass.ACTIVATION, Tier.HOST] == cache.nbytes
    # one prompt fewer: the device has room again
    probe = Probe(tm)
    tm.generate(**_prompts(1), **_greedy(), logits_processor=[probe])
    assert all(s == {Tier.DEVICE: cache.nbytes // 2, Tier.HOST: 0} for s in probe.seen)


def test_no_tier_with_room_refuses_and_changes_nothing():
    tm = TieredModel(_model(), KeepOnDevice(), optimizer=None, device="cpu")
    need = tm.model_plan.tier_bytes()[Tier.DEVICE]
    tm.detach()
    model = _model().train()
    ref = copy.deepcopy(model).to(torch.bfloat16).eval()
    budgets = Budgets(device=need + 4000, host=3000)
    tm = TieredModel(model, KeepOnDevice(), optimizer=None, device="cpu", budgets=budgets)
    big = {**_prompts(), **_greedy(20)}  # 2 x 24 tokens x 3 layers x 2 heads x 8 x 2 (keys, values) x 2 B
    message = (
        r"^tiermem: out of host memory placing 'the KV cache of tm.generate\(...\)': asked 9.00 KiB, .*"
        r"3 layers x batch 2 x 24 tokens x 2 KV heads x 8 head dim, keys and values in bfloat16.*"
        r"device 3.91 KiB free .*; host 2.93 KiB free .*max_new_tokens.*Budgets\(device=...\) to at least "
        r"\d+\.\d\d KiB or Budgets\(host=...\) to at least 9.00 KiB; nothing was generated$"
    )
    with pytest.raises(OutOfTierMemory, match=message):
        tm.generate(**big)
    assert tm.training and tm.phase is Phase.IDLE  # the module's mode and the phase as they were
    assert {t: s.ledger.held(kv_cache.KEY) for t, s in tm.stores.items()} == {Tier.DEVICE: 0, Tier.HOST: 0}
    assert tm.stores[Tier.DEVICE].ledger.used == need and tm.stores[Tier.HOST].ledger.used == 0
    with torch.no_grad():  # a call that fits (2.25 KiB, on the device): the tokens the in-memory model's
        assert torch.equal(tm.generate(**_prompts(), **_greedy(2)), ref.generate(**_prompts(), **_greedy(2)))


def test_a_cache_the_caller_chose_is_kept_and_counted():
    model = _model()
    tm = TieredModel(model, KeepOnDevice(), optimizer=None, device="cpu")
    probe = Probe(tm)
    kwargs = {**_prompts(), **_greedy(), "cache_implementation": "static", "return_dict_in_generate": True}
    out = tm.generate(**kwargs, logits_processor=[probe])
    assert type(out.past_key_values).__name__ == "StaticCache"  # not replaced
    assert all(s[Tier.DEVICE] == _measured(out.past_key_values) for s in probe.seen)


def _ledgers(device: int, host: int) -> dict[Tier, Ledger]:
    return {Tier.DEVICE: Ledger(Tier.DEVICE, device), Tier.HOST: Ledger(Tier.HOST, host)}


@pytest.mark.parametrize(
    "device_type, chosen, room, tier",
    [
        ("cuda", None, (100, 100), Tier.DEVICE),
        ("cuda", None, (99, 100), Tier.HOST),  # the device is short: the host
        ("cuda", "cache_implementation='offloaded'", (100, 100), Tier.HOST),  # where the caller's cache lives
        ("cuda", "past_key_values", (99, 100), None),  # the caller's cache is on the device: not moved
        ("cpu", "past_key_values", (99, 100), Tier.HOST),  # on a CPU, host and device are one memory
        ("cpu", None, (99, 99), None),
    ],
)
def test_placed_by_tier_and_choice(device_type, chosen, room, tier):
    cache = kv_cache.kv_cache(KvShape(1, 1, 5), batch=1, max_length=6, dtype=torch.bfloat16)  # 100 B
    assert cache.nbytes == 100
    ledgers = _ledgers(room[0] + 10, room[1] + 20)
    place = dict(policy=KeepOnDevice(), ledgers=ledgers, footprint={Tier.DEVICE: 10, Tier.HOST: 20}, chosen=chosen)
    if tier is None:
        with pytest.raises(OutOfTierMemory, match="no tier has room for it"):
            with kv_cache.placed(cache, device=torch.device(device_type), **place):
                pass
        return
    with kv_cache.placed(cache, device=torch.device(device_type), **place) as got:
        assert got is tier and ledgers[tier].held(kv_cache.KEY) == 100
    assert all(ledger.used == 0 for ledger in ledgers.values())


@pytest.mark.parametrize(
    "tier, device_type, chosen, offloaded",
    [
        (Tier.HOST, "cuda", None, True),  # transformers keeps it on the host
        (Tier.DEVICE, "cuda", None, False),
        (Tier.HOST, "cpu", None, False),  # the host is the device's memory: the ordinary cache
        (Tier.HOST, "cuda", "past_key_values", False),  # the caller's cache, as given
    ],
)
def test_offloaded_only_on_an_accelerator_and_never_over_a_choice(tier, device_type, chosen, offloaded):
    assert kv_cache.offloaded(tier, torch.device(device_type), chosen) is offloaded


def test_an_encoder_decoder_gets_no_placement():
    config = transformers.T5Config(num_layers=2, num_heads=4, d_model=32, d_kv=8, vocab_size=97)
    assert KvShape.of(config) is None
    assert (
        KvShape.of({"is_encoder_decoder": True, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8})
        is None
    )


def _config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **SMALL, "num_attention_heads": 4, "num_key_value_heads": 2}))
    return str(path)


@pytest.mark.parametrize("host_mem, tier", [("100GB", "host"), ("1MB", None)])
def test_plan_generate_option(tmp_path, capsys, host_mem, tier):
    cfg = _config(tmp_path)
    common = ["plan", "--config", cfg, "--precision", "bf16", "--policy", "KeepOnDevice", "--nvme-free", "1GB"]
    assert main([*common, "--device-mem", "50GB", "--host-mem", "100GB", "--generate", "4,101", "--json", "-"]) == 0
    gen = json.loads(capsys.readouterr().out)["generate"]
    row = gen["precisions"]["bf16"]
    assert row["kv_cache_bytes"] == 2 * 3 * 2 * 8 * 2 * 4 * 100 and row["cache_tokens"] == 100
    assert row["policies"]["KeepOnDevice"]["tier"] == "device"
    # a cache of 1.54 MB does not fit a device of 1 MB
    argv = [*common, "--device-mem", "1MB", "--host-mem", host_mem, "--generate", "80,101"]
    assert main([*argv, "--json", "-"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["generate"]["precisions"]["bf16"]["policies"]["KeepOnDevice"]["tier"]
        == tier
    )
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "KV cache of generate: batch 80 x 101 tokens x 3 layers x 2 KV heads x 8 wide" in text
    assert ("│ host" if tier else "none: smaller batch or tokens") in text


def test_plan_without_generate_is_unchanged_and_bad_generate_is_refused(tmp_path, capsys):
    cfg = _config(tmp_path)
    assert main(["plan", "--config", cfg, "--json", "-"]) == 0
    assert "generate" not in json.loads(capsys.readouterr().out)
    assert main(["plan", "--config", cfg, "--generate", "4x100"]) == 2
    assert "tiermem: --generate '4x100' is not BATCH,TOKENS" in capsys.readouterr().err
    assert main(["plan", "--params", "1e6", "--generate", "4,100"]) == 2
    assert "tiermem: --generate needs --config CONFIG.JSON" in capsys.readouterr().err
