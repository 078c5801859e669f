"""PEFT's LoRA as users bring it, under every built-in policy and Auto (issue 19).

Tiny Llama models built from configs (never downloaded), wrapped by ``peft.get_peft_model`` with LoRA
on the attention projections, on the MLP, on the input embedding, and on a tied embedding/head. The
base weights are frozen; under ZeroInfinity (and Auto with a device budget too small for them) they
live on NVMe and are read by peft's own code: ``lora.Embedding`` computes with
``lora_embedding_A[name].T``, a parameter of a ParameterDict whose module never runs forward.

- fp32 training agrees with ``torch.optim.AdamW`` over the trainable parameters to rounding (NOTE
  [Arithmetic tolerances] in tests/tolerance.py);
- bf16 training gives the same bits under every policy as under ZeroOffload, also with activation
  checkpointing in both modes and in ``eval()`` mode;
- a checkpoint saved after two steps continues bit for bit in a fresh model, and ``detach()`` ->
  ``merge_and_unload()`` -> ``generate()`` equals the same steps' plain peft model merged;
- the Hugging Face Trainer on tiermem (``TieredTrainer``) trains a LoRA model under ZeroInfinity
  with gradient checkpointing as ``TieredModel``'s own loop does, and resumes bit for bit.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

peft = pytest.importorskip("peft")  # the `test` extra
transformers = pytest.importorskip("transformers")

from models import same_state  # noqa: E402
from tolerance import assert_adam_within, second_moments  # noqa: E402

from tiermem import AdamW, Budgets, TieredModel  # noqa: E402
from tiermem.policies import ActivationOffload, Auto, KeepOnDevice, ZeroInfinity, ZeroOffload  # noqa: E402
from tiermem.train.weights.offdevice import OffDeviceWeight  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
transformers.logging.set_verbosity_error()

VOCAB, BATCH, SEQ = 96, 2, 12
SPEC = AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)

#: LoRA target -> (modules, tied embeddings)
TARGETS = {
    "attention": (["q_proj", "v_proj"], False),
    "mlp": (["gate_proj", "up_proj", "down_proj"], False),
    "embedding": (["embed_tokens", "k_proj"], False),
    "tied": (["embed_tokens"], True),
}


POLICIES = {
    "zero-offload": ZeroOffload,
    "zero-infinity": ZeroInfinity,
    "keep-on-device": KeepOnDevice,
    "activation-offload": lambda: ActivationOffload(ZeroOffload(), min_bytes=0),
    "auto": lambda: Auto(device_reserve=0.85),  # with Budgets(device="256KiB"): no room for the weights
}


def _lora(target: str, seed: int = 0) -> torch.nn.Module:
    base = _base(target, seed)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[target][0], init_lora_weights=False
    )  # random B too: every adapter weight gets gradients at once
    return peft.get_peft_model(base, lora)


def _base(target: str, seed: int = 0) -> torch.nn.Module:
    """The Llama that ``_lora(target, seed)`` adapts, with the same initial weights."""
    torch.manual_seed(seed)
    _, tied = TARGETS[target]
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        use_cache=False,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def _batch(i: int) -> dict:
    g = torch.Generator().manual_seed(500 + i)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _mode(model: torch.nn.Module, mode: str) -> None:
    if mode == "eval":
        model.eval()
    elif mode != "plain":
        _checkpointing(model, reentrant=mode == "reentrant")
        if mode == "reentrant":
            model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad


def _checkpointing(model: torch.nn.Module, *, reentrant: bool) -> None:
    kw = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _tiered(target: str, policy: str, tmp_path, *, precision="bf16", mode="plain", seed=0) -> TieredModel:
    model = _lora(target, seed)
    _mode(model, mode)
    tmp_path.mkdir(parents=True, exist_ok=True)
    kw = {}
    if policy == "auto":  # most of a small device kept for activations: Auto homes the weights off it
        kw["budgets"] = Budgets(device="256KiB")
    return TieredModel(
        model, POLICIES[policy](), optimizer=SPEC, precision=precision, grad_clip=1.0, nvme_dir=str(tmp_path), **kw
    )


def _train(tm: TieredModel, steps: range) -> list[float]:
    losses = []
    for i in steps:
        loss = tm(**_batch(i)).loss
        tm.backward(loss)
        assert not tm.step().skipped, f"step {i} skipped"
        losses.append(loss.item())
    return losses


_REF: dict = {}


def _reference(target: str, mode: str = "plain", steps: int = 2) -> tuple[list[float], dict]:
    key = (target, mode, steps)
    if key not in _REF:
        with tempfile.TemporaryDirectory() as d:
            tm = _tiered(target, "zero-offload", Path(d), mode=mode)
            losses = _train(tm, range(steps))
            _REF[key] = losses, tm.state_dict()
            tm.detach()
    return _REF[key]


def test_auto_with_a_tight_device_budget_homes_the_base_weights_off_the_device(tmp_path):
    tm = _tiered("embedding", "auto", tmp_path)
    emb = tm.module.base_model.model.model.embed_tokens
    assert type(emb.base_layer.weight) is OffDeviceWeight
    assert type(emb.lora_embedding_A["default"]) is OffDeviceWeight  # the ParameterDict read through .T
    assert _train(tm, range(2)) == _reference("embedding")[0]
    tm.detach()


# -- fp32: plain PyTorch is the oracle -------------------------------------------------------------
_TORCH: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}


def _torch_run(target: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The LoRA model trained by torch.optim.AdamW's for-loop kernel over its trainable
    parameters (clipping as tiermem's)."""
    if target not in _TORCH:
        model = _lora(target)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            trainable,
            lr=SPEC.lr,
            betas=SPEC.betas,
            eps=SPEC.eps,
            weight_decay=SPEC.weight_decay,
            foreach=False,
        )
        for i in range(2):
            model(**_batch(i)).loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            opt.zero_grad()
        _TORCH[target] = {k: v.detach().clone() for k, v in model.state_dict().items()}, second_moments(model, opt)
    return _TORCH[target]


@pytest.mark.numerics
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("target", TARGETS)
def test_fp32_agrees_with_torch_adamw(target, policy, tmp_path):
    ref, exp_avg_sq = _torch_run(target)
    tm = _tiered(target, policy, tmp_path, precision="fp32")
    _train(tm, range(2))
    ours = tm.state_dict()
    tm.detach()
    hp = dict(lr=SPEC.lr, steps=2, betas=SPEC.betas, eps=SPEC.eps, weight_decay=SPEC.weight_decay)
    assert_adam_within(ours, ref, exp_avg_sq, **hp)  # NOTE [Arithmetic tolerances] in tests/tolerance.py


# -- bf16: placement never changes the numbers ----------------------------------------------------
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "zero-offload"])
@pytest.mark.parametrize("target", TARGETS)
def test_bf16_same_bits_as_zero_offload(target, policy, tmp_path):
    losses, state = _reference(target)
    tm = _tiered(target, policy, tmp_path)
    assert _train(tm, range(2)) == losses
    assert same_state(tm.state_dict(), state)
    tm.detach()


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant", "eval"])
@pytest.mark.parametrize("policy", ["zero-infinity", "auto"])
@pytest.mark.parametrize("target", ["attention", "embedding"])
def test_bf16_checkpointing_and_eval_same_bits_as_zero_offload(target, policy, mode, tmp_path):
    """The issue's failing cases: LoRA with non-reentrant checkpointing (a frozen RMSNorm weight
    inside the recomputed region) and LoRA on an embedding, with the base weights on NVMe."""
    losses, state = _reference(target, mode)
    tm = _tiered(target, policy, tmp_path, mode=mode)
    assert _train(tm, range(2)) == losses
    assert same_state(tm.state_dict(), state)
    tm.detach()


# -- checkpoints, detach, merge, generate -----------------------------------------------------------
def _generate(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.generate(
            _batch(99)["input_ids"][:, :5], max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0
        )


@pytest.mark.parametrize("target", TARGETS)
def test_save_load_continue_then_merge_and_generate(target, tmp_path):
    ref_losses, ref_state = _reference(target, steps=3)
    tm = _tiered(target, "zero-infinity", tmp_path / "a")
    _train(tm, range(2))
    tm.save(str(tmp_path / "ckpt"))
    tm.detach()
    resumed = _tiered(target, "zero-infinity", tmp_path / "b", seed=5)
    resumed.load(str(tmp_path / "ckpt"))
    assert _train(resumed, range(2, 3)) == ref_losses[2:]
    state = resumed.state_dict()
    assert same_state(state, ref_state)
    merged = resumed.detach().merge_and_unload()
    plain = _lora(target, seed=9)
    plain.load_state_dict(state)
    plain = plain.merge_and_unload()
    assert same_state(merged.state_dict(), plain.state_dict())
    assert torch.equal(_generate(merged), _generate(plain))


# -- the Hugging Face Trainer ------------------------------------------------------------------------
def test_trainer_with_lora_and_checkpointing_under_zero_infinity(tmp_path):
    from transformers import TrainingArguments

    from tiermem.integrations.transformers import TieredTrainer

    class Recording(TieredTrainer):
        """Keeps each micro-batch the Trainer fed."""

        fed: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.fed.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
            return super().training_step(model, inputs, num_items_in_batch)

    data = [{k: v[j] for k, v in _batch(i).items()} for i in range(8) for j in range(BATCH)]

    def args(out, **kw):
        return TrainingArguments(
            str(out),
            per_device_train_batch_size=2,
            max_steps=4,
            learning_rate=SPEC.lr,
            weight_decay=0.0,
            max_grad_norm=1.0,
            lr_scheduler_type="constant",
            logging_steps=1,
            report_to=[],
            disable_tqdm=True,
            seed=3,
            bf16=True,
            gradient_checkpointing=True,
            use_cpu=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            **kw,
        )

    for d in ("nvme", "nvme2"):
        (tmp_path / d).mkdir()
    first = Recording(
        model=_lora("attention"),
        args=args(tmp_path / "a", save_strategy="steps", save_steps=2),
        train_dataset=data,
        tiermem={"policy": ZeroInfinity(), "nvme_dir": str(tmp_path / "nvme")},
    )
    first.fed = []
    first.train()
    history = [h for h in first.state.log_history if "grad_norm" in h]
    assert len(history) == 4 and first.tiered.stepper.skipped_in_a_row == 0
    final = first.tiered.state_dict()
    first.tiered.detach()

    # the micro-batches it fed, through TieredModel's own loop (ZeroOffload: placement never changes the numbers)
    model = _lora("attention")
    _checkpointing(model, reentrant=False)
    own = TieredModel(
        model, ZeroOffload(), optimizer=AdamW(lr=SPEC.lr, weight_decay=0.0), precision="bf16", grad_clip=1.0
    )
    for h, (batch, n) in zip(history, first.fed):
        own.backward(own(**batch, num_items_in_batch=n).loss)
        assert own.step().grad_norm == h["grad_norm"]
    assert same_state(own.state_dict(), final)

    second = TieredTrainer(
        model=_lora("attention", seed=4),
        args=args(tmp_path / "a", save_strategy="no"),
        train_dataset=data,
        tiermem={"policy": ZeroInfinity(), "nvme_dir": str(tmp_path / "nvme2")},
    )
    second.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert same_state(second.tiered.state_dict(), final)


def test_save_pretrained_writes_the_adapter_as_peft_does(tmp_path):
    """A peft model's tm.save_pretrained(dir) is peft's own save_pretrained of the trained model:
    the same adapter tensors under the same names, and PeftModel.from_pretrained on a fresh base
    gives the trained model's logits."""
    tm = _tiered("attention", "zero-infinity", tmp_path, precision="fp32")
    for i in range(2):
        tm.backward(tm(**_batch(i)).loss)
        tm.step()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"an earlier full save")  # an adapter save leaves it
    tm.save_pretrained(tmp_path / "hf")
    trained = tm.detach()
    trained.save_pretrained(tmp_path / "peft")  # peft's own
    from safetensors.torch import load_file

    mine, theirs = (
        load_file(tmp_path / "hf" / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert sorted(mine) == sorted(theirs) and len(mine) == 2 * 2 * 2  # lora A and B of q and v, 2 layers
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == b"an earlier full save"
    loaded = peft.PeftModel.from_pretrained(_base("attention"), tmp_path / "hf")
    batch = _batch(7)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, trained(**batch).logits)
