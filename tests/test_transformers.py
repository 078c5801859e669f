"""Hugging Face ``transformers`` models as users bring them, under every built-in policy.

Tiny models built from configs (never downloaded: this module sets the hub offline and calls no
``from_pretrained``): GPT-2, Llama with tied and untied embeddings, T5, BERT and Mixtral (a mixture
of experts, whose expert weights are 3-d parameters routed per token). Under ZeroOffload,
ZeroInfinity, KeepOnDevice and ActivationOffload:

- fp32 training agrees with ``torch.optim.AdamW``'s for-loop kernel to rounding (NOTE [Arithmetic
  tolerances] in tests/tolerance.py);
- bf16 training gives the same bits under every policy as under ZeroOffload, also with activation
  checkpointing in both modes (``use_reentrant`` True and False) and with the model in ``eval()``
  mode (how ``from_pretrained`` returns it); those modes change ZeroOffload's numbers exactly where
  they change plain PyTorch's gradients;
- a checkpoint saved after two steps and loaded into a fresh model continues bit for bit;
- ``detach()`` gives back a model that ``generate()``s (or, for BERT, predicts) exactly like a
  fresh model loaded with the same ``state_dict``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a download, even by accident
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers
from models import same_state
from tolerance import assert_adam_within, second_moments

from tiermem import AdamW, TieredModel
from tiermem.policies import ActivationOffload, KeepOnDevice, ZeroInfinity, ZeroOffload

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)
transformers.logging.set_verbosity_error()  # the tiny configs' token ids outside the vocabulary, etc.

VOCAB, BATCH, SEQ = 128, 2, 16  # bf16 logits of one batch: 8 KiB, over a page: ActivationOffload moves them
SPEC = AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
STEPS = 3  # the last one after a checkpoint is loaded
FP32_STEPS = 2


def _llama_config(tied: bool):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        use_cache=False,
    )


#: family -> (the model, built from a config; what its batches look like)
FAMILIES = {
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB,
                n_positions=SEQ,
                n_embd=32,
                n_layer=2,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=1,
            )
        ),
        "causal",
    ),
    "llama-tied": (lambda: transformers.LlamaForCausalLM(_llama_config(tied=True)), "causal"),
    "llama-untied": (lambda: transformers.LlamaForCausalLM(_llama_config(tied=False)), "causal"),
    "t5": (
        lambda: transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
                use_cache=False,
            )
        ),
        "seq2seq",
    ),
    "bert": (
        lambda: transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=SEQ,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),
        "masked",
    ),
    "mixtral": (
        lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=SEQ,
                num_local_experts=4,
                num_experts_per_tok=2,
                use_cache=False,
            )
        ),
        "causal",
    ),
}

POLICIES = {
    "zero-offload": ZeroOffload,
    "zero-infinity": ZeroInfinity,
    "keep-on-device": KeepOnDevice,
    "activation-offload": lambda: ActivationOffload(ZeroOffload(), min_bytes=0),
}


def _build(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[family][0]()


def _batch(family: str, i: int) -> dict:
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    kind = FAMILIES[family][1]
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


def _enable(model: torch.nn.Module, mode: str) -> None:
    """Activation checkpointing in either mode, or eval()."""
    if mode == "eval":
        model.eval()
        return
    kw = {"use_reentrant": mode == "checkpoint-reentrant"}
    if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _tiered(
    family: str, policy: str, tmp_path, *, precision: str = "bf16", mode: str = "plain", seed: int = 0
) -> TieredModel:
    model = _build(family, seed)
    if mode != "plain":
        _enable(model, mode)
    if policy == "zero-infinity":
        tmp_path.mkdir(exist_ok=True)
    return TieredModel(
        model,
        POLICIES[policy](),
        optimizer=SPEC,
        precision=precision,
        grad_clip=1.0,
        nvme_dir=str(tmp_path) if policy == "zero-infinity" else None,
    )


def _train(tm: TieredModel, family: str, steps: range) -> list[float]:
    losses = []
    for i in steps:
        loss = tm(**_batch(family, i)).loss
        tm.backward(loss)
        res = tm.step()
        assert not res.skipped, f"step {i} skipped"
        losses.append(loss.item())
    return losses


_REFERENCE: dict[tuple[str, str, int], tuple] = {}


@pytest.fixture
def reference(tmp_path_factory):
    """ZeroOffload, bf16: losses and fp32 weights after each step, per family and mode (each run
    once, shared by the tests that compare with it). Checkpointing changes the numbers of some
    models in plain PyTorch too (T5's gradients, in both modes), so each mode has its own."""

    def get(family: str, mode: str = "plain", steps: int = STEPS) -> tuple[list[float], list[dict]]:
        key = (family, mode, steps)
        if key not in _REFERENCE:
            tm = _tiered(family, "zero-offload", tmp_path_factory.mktemp("ref"), mode=mode)
            losses, states = [], []
            for i in range(steps):
                losses += _train(tm, family, range(i, i + 1))
                states.append(tm.state_dict())
            tm.detach()
            _REFERENCE[key] = losses, states
        return _REFERENCE[key]

    return get


# -- fp32: plain PyTorch is the oracle ---------------------------------------------------------
_TORCH: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}


def _torch_run(family: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The family trained by ``torch.optim.AdamW``'s for-loop kernel (grad clipping as tiermem)."""
    if family not in _TORCH:
        model = _build(family)
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=SPEC.lr,
            betas=SPEC.betas,
            eps=SPEC.eps,
            weight_decay=SPEC.weight_decay,
            foreach=False,
        )
        for i in range(FP32_STEPS):
            model(**_batch(family, i)).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        _TORCH[family] = {k: v.detach().clone() for k, v in model.state_dict().items()}, second_moments(model, opt)
    return _TORCH[family]


@pytest.mark.numerics
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_agrees_with_torch_adamw(family, policy, tmp_path):
    ref, exp_avg_sq = _torch_run(family)
    tm = _tiered(family, policy, tmp_path, precision="fp32")
    _train(tm, family, range(FP32_STEPS))
    ours = tm.state_dict()
    tm.detach()
    hp = dict(lr=SPEC.lr, steps=FP32_STEPS, betas=SPEC.betas, eps=SPEC.eps, weight_decay=SPEC.weight_decay)
    assert_adam_within(ours, ref, exp_avg_sq, **hp)  # NOTE [Arithmetic tolerances] in tests/tolerance.py


# -- bf16: placement never changes the numbers ---------------------------------------------------
MODES = ["checkpoint-reentrant", "checkpoint", "eval"]


def _torch_grads(family: str, mode: str) -> dict[str, torch.Tensor]:
    """One backward of the model in bf16, plain PyTorch, in ``mode``."""
    model = _build(family).to(torch.bfloat16)
    if mode != "plain":
        _enable(model, mode)
    model(**_batch(family, 0)).loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_and_eval_change_the_numbers_only_where_torch_does(family, mode, reference):
    """ZeroOffload with checkpointing (or in eval()) gives the bits of its plain training exactly
    when plain PyTorch's gradients are the same bits with and without it (all these models but
    T5, whose gradients change under checkpointing in PyTorch too)."""
    plain, other = _torch_grads(family, "plain"), _torch_grads(family, mode)
    torch_same = all(torch.equal(plain[k], other[k]) for k in plain)
    assert same_state(reference(family, mode, steps=2)[1][1], reference(family)[1][1]) is torch_same


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["zero-infinity", "activation-offload", "keep-on-device"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_checkpointing_and_eval_mode_same_bits_as_zero_offload(family, policy, mode, reference, tmp_path):
    """Recomputation in backward and eval() forwards are where weights off the device (and
    activations sent away) could go wrong."""
    ref_losses, ref_states = reference(family, mode, steps=2)
    tm = _tiered(family, policy, tmp_path, mode=mode)
    assert _train(tm, family, range(2)) == ref_losses
    assert same_state(tm.state_dict(), ref_states[1])
    if policy == "activation-offload" and mode != "eval":  # eval(): activations stay on the device
        assert sum(tm.activations.stats.offloaded.values()) > 0
    tm.detach()


# -- checkpoints, detach(), generate() -------------------------------------------------------------
def _predict(model: torch.nn.Module, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits for one batch, and greedy generation (BERT: the argmax tokens)."""
    model.eval()
    batch = _batch(family, 99)
    with torch.no_grad():
        logits = model(**batch).logits
        if family == "bert":
            return logits, logits.argmax(-1)
        kw = {"decoder_start_token_id": 0} if family == "t5" else {}
        out = model.generate(
            batch["input_ids"][:, :6], max_new_tokens=5, do_sample=False, min_new_tokens=5, pad_token_id=0, **kw
        )
    return logits, out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_same_bits_save_load_continue_detach_generate(family, policy, reference, tmp_path):
    """Two steps (the same bits as ZeroOffload's), a checkpoint loaded into a fresh model with other
    initial weights, a third step (the same bits as three steps straight), then ``detach()``."""
    ref_losses, ref_states = reference(family)
    tm = _tiered(family, policy, tmp_path / "a")
    assert _train(tm, family, range(2)) == ref_losses[:2]
    assert same_state(tm.state_dict(), ref_states[1])
    if policy == "activation-offload":
        assert sum(tm.activations.stats.offloaded.values()) > 0
    tm.save(str(tmp_path / "ckpt"))
    tm.detach()
    resumed = _tiered(family, policy, tmp_path / "b", seed=7)
    resumed.load(str(tmp_path / "ckpt"))
    assert _train(resumed, family, range(2, STEPS)) == ref_losses[2:]
    state = resumed.state_dict()
    assert same_state(state, ref_states[-1])

    model = resumed.detach()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    fresh = _build(family, seed=3)
    fresh.load_state_dict(state)
    assert same_state(model.state_dict(), fresh.state_dict())  # weights and buffers, dtypes too
    (logits, out), (fresh_logits, fresh_out) = _predict(model, family), _predict(fresh, family)
    assert torch.equal(logits, fresh_logits) and torch.equal(out, fresh_out)
