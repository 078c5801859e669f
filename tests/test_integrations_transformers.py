"""tiermem.integrations.transformers: the HF Trainer trains through a TieredModel exactly as
TieredModel's own loop does (gradient accumulation, clipping, lr schedule, weight-decay groups,
bf16, a DeepSpeed config with "auto" values), logs loss / grad_norm / lr, writes checkpoint-N/
folders with tiermem's checkpoint, resumes bit-exact, leaves the lr schedule alone on an fp16 step
skipped for overflow, and loads the best checkpoint at the end through tiermem. Tiny GPT-2s built
from a config (never downloaded); a few steps each. Under torchrun: test_integrations_transformers_dp."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny models built from configs: nothing is ever downloaded
transformers = pytest.importorskip("transformers")  # the `hf` / `test` extra
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from tiermem import AdamW, ConfigError, TieredModel, TierMemError  # noqa: E402
from tiermem.integrations.transformers import TIERMEM_CHECKPOINT, TieredTrainer, TrainerOptimizer  # noqa: E402
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload  # noqa: E402

LR, WARMUP, STEPS, ACCUM, CLIP, DECAY = 2e-3, 1, 4, 2, 0.5, 0.1


def gpt2(dropout: float = 0.0) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(cfg)


def dataset(n: int = 24) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, 12), generator=g)
    out = []
    for i, x in enumerate(ids):
        labels = x.clone()
        labels[: i % 5] = -100  # a different number of counted tokens per sample
        out.append({"input_ids": x, "labels": labels})
    return out


def arguments(out, **kw) -> TrainingArguments:
    base = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=LR,
        weight_decay=DECAY,
        max_grad_norm=CLIP,
        lr_scheduler_type="linear",
        warmup_steps=WARMUP,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=3,
        use_cpu=not torch.cuda.is_available(),
    )
    return TrainingArguments(str(out), **{**base, **kw})


class Recording(TieredTrainer):
    """Keeps each micro-batch the Trainer fed and the loss it got back."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fed: list[tuple[dict, object]] = []
        self.losses: list[torch.Tensor] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.fed.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(loss.clone())
        return loss


def own_loop(fed, precision: str, blowup: dict[int, float] | None = None):
    """TieredModel's own loop over the same micro-batches: the oracle. ``blowup``: step -> factor
    on its losses; a skipped step does not step the scheduler (the Trainer's rule)."""
    model = gpt2()
    no_decay = tuple(n for n, _ in model.named_parameters() if n.endswith(".bias") or ".ln_" in n)
    tm = TieredModel(
        model, optimizer=AdamW(lr=LR, weight_decay=DECAY, no_decay=no_decay), precision=precision, grad_clip=CLIP
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        tm.optimizer, lambda s: s / WARMUP if s < WARMUP else max(0.0, (STEPS - s) / (STEPS - WARMUP))
    )
    losses, logs = [], []
    for step in range(STEPS):
        group = [batch for batch, _ in fed[step * ACCUM : (step + 1) * ACCUM]]
        n = fed[step * ACCUM][1]  # what the Trainer counted: the labels of the step's micro-batches
        counts = {int(sum((b["labels"][:, shift:] != -100).sum() for b in group)) for shift in (0, 1)}
        assert int(n) in counts and all(n_fed is n for _, n_fed in fed[step * ACCUM : (step + 1) * ACCUM])
        for b in group:
            loss = tm(**b, num_items_in_batch=n).loss  # already a share of the step's loss: no division
            loss = loss * blowup[step] if blowup and step in blowup else loss
            tm.backward(loss)
            losses.append(loss.detach())
        lr = tm.optimizer.param_groups[0]["lr"]
        res = tm.step()
        if not res.skipped:
            sched.step()
        logs.append(
            {
                "loss": sum(x.item() for x in losses[-ACCUM:]),
                "grad_norm": res.grad_norm,
                "lr": lr,
                "loss_scale": res.loss_scale,
                "skipped": res.skipped,
            }
        )
    return tm, losses, logs


AUTO = {
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "bf16": {"enabled": "auto"},
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
}


@pytest.mark.parametrize(
    "precision,how", [("fp32", None), ("bf16", None), ("fp16", None), ("bf16", "ds.json"), ("bf16", "zero-infinity")]
)
def test_trainer_trains_as_tiered_models_own_loop(tmp_path, precision, how):
    deepspeed, options, policy = None, None, ZeroOffload
    if how == "ds.json":
        (tmp_path / how).write_text(json.dumps(AUTO))
        deepspeed = str(tmp_path / how)
    elif how == "zero-infinity":  # placement never changes the numbers: the oracle stays ZeroOffload's loop
        options, policy = {"policy": ZeroInfinity(), "nvme_dir": str(tmp_path)}, ZeroInfinity
    args = arguments(tmp_path / "out", bf16=precision == "bf16", fp16=precision == "fp16")
    trainer = Recording(model=gpt2(), args=args, train_dataset=dataset(), deepspeed=deepspeed, tiermem=options)
    trainer.train()
    assert trainer.tiered.precision == precision  # tiermem's dtype; no autocast or GradScaler on top:
    assert not (trainer.args.bf16 or trainer.args.fp16) and trainer.accelerator.scaler is None
    assert isinstance(trainer.tiered.policy, policy) and trainer.tiered.grad_clip == CLIP
    assert len(trainer.fed) == STEPS * ACCUM

    tm, losses, logs = own_loop(trainer.fed, precision)
    assert all(torch.equal(a, b) for a, b in zip(trainer.losses, losses))
    got, want = trainer.tiered.state_dict(), tm.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    history = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    for h, ref in zip(history, logs):
        assert h["grad_norm"] == ref["grad_norm"] and h["learning_rate"] == ref["lr"]
        assert h["loss"] == pytest.approx(ref["loss"], rel=1e-6)  # the Trainer sums the micro-batch losses
        assert h.get("loss_scale") == (ref["loss_scale"] if precision == "fp16" else None)
    assert any(ref["grad_norm"] > CLIP for ref in logs)  # clipping took part
    assert logs[0]["lr"] == 0.0 and logs[1]["lr"] == LR  # the warmup


def test_checkpoints_and_resume_bit_exact(tmp_path, caplog):
    kw = dict(save_strategy="steps", save_steps=2, bf16=True)
    first = TieredTrainer(model=gpt2(dropout=0.1), args=arguments(tmp_path / "a", **kw), train_dataset=dataset())
    first.train()
    for n in (2, 4):
        files = set(os.listdir(tmp_path / "a" / f"checkpoint-{n}"))
        assert {TIERMEM_CHECKPOINT, "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= files
    # the weights saved are the fp32 master weights, loadable by from_pretrained
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "a" / "checkpoint-4").state_dict()
    final = first.tiered.state_dict()
    assert all(torch.equal(loaded[k], final[k]) for k in final if k in loaded)

    # a run killed after step 2 while saving step 4: resume picks the newest complete checkpoint
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    (tmp_path / "b" / "checkpoint-4").mkdir()
    (tmp_path / "b" / "checkpoint-4" / "model.safetensors").write_bytes(b"half")
    second = TieredTrainer(model=gpt2(dropout=0.1), args=arguments(tmp_path / "b", **kw), train_dataset=dataset())
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        second.train(resume_from_checkpoint=True)
    assert "checkpoint-4 is incomplete" in caplog.text
    resumed = second.tiered.state_dict()
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    assert second.tiered.stepper.steps == STEPS
    logged = lambda t: [  # noqa: E731
        (h["step"], h["loss"], h["grad_norm"], h["learning_rate"])
        for h in t.state.log_history
        if "grad_norm" in h and h["step"] > 2
    ]
    assert logged(second) == logged(first)


def test_evaluate_runs_through_the_tiered_model(tmp_path):
    kw = dict(max_steps=1, per_device_eval_batch_size=4)
    trainer = TieredTrainer(
        model=gpt2(), args=arguments(tmp_path / "tiered", **kw), train_dataset=dataset(), eval_dataset=dataset(6)
    )
    trainer.train()
    got = trainer.evaluate()["eval_loss"]
    plain = transformers.Trainer(
        model=trainer.tiered.detach(), args=arguments(tmp_path / "plain", **kw), eval_dataset=dataset(6)
    )  # the oracle: the plain Trainer on the same fp32 weights
    assert got == plain.evaluate()["eval_loss"]


def test_load_best_model_at_end_loads_tiermems_checkpoint_of_the_best_step(tmp_path):
    # greater_is_better: the highest eval loss is the best, an early step (the last would prove nothing)
    kw = dict(
        load_best_model_at_end=True,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        per_device_eval_batch_size=3,
    )
    trainer = TieredTrainer(
        model=gpt2(), args=arguments(tmp_path, **kw), train_dataset=dataset(), eval_dataset=dataset(6)
    )
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    best = max(evals, key=evals.get)
    assert best < STEPS and trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best}")
    saved = lambda n: GPT2LMHeadModel.from_pretrained(tmp_path / f"checkpoint-{n}").state_dict()  # noqa: E731
    got, want, last = trainer.tiered.state_dict(), saved(best), saved(STEPS)
    assert all(torch.equal(got[k], want[k]) for k in want) and not all(torch.equal(got[k], last[k]) for k in last)
    assert trainer.tiered.stepper.steps == best  # optimizer state and step are the best checkpoint's too
    assert trainer.evaluate()["eval_loss"] == evals[best]  # the metric it was chosen by, measured again
    os.remove(tmp_path / f"checkpoint-{best}" / TIERMEM_CHECKPOINT)
    with pytest.raises(
        TierMemError,
        match=rf"^tiermem: the best checkpoint .*checkpoint-{best}' \(by eval_loss\) "
        r"has no tiermem\.ckpt; it was not saved by a TieredTrainer",
    ):
        trainer._load_best_model()


class NotAnOptimizer:
    """Something given as an optimizer that is none (a torch.optim class runs fused or generically)."""


def _fails(tmp_path, **kw):
    return TieredTrainer(
        model=gpt2(), args=arguments(tmp_path / "out", **kw.pop("args", {})), train_dataset=dataset(), **kw
    )


BAD = {
    "not an optimizer": (
        dict(optimizers=(NotAnOptimizer(), None)),
        r"optimizers=\(NotAnOptimizer\(\.\.\.\), \.\.\.\)\) is not an optimizer tiermem "
        r"runs; it runs torch\.optim\.AdamW, torch\.optim\.Adam",
    ),
    "two optimizers": (
        dict(
            optimizers=(torch.optim.AdamW(gpt2().parameters()), None), optimizer_cls_and_kwargs=(torch.optim.AdamW, {})
        ),
        r"got both optimizers= and",
    ),
    "precision in tiermem=": (dict(tiermem={"precision": "bf16"}), r"these come from TrainingArguments"),
    "a placement besides the config": (
        dict(deepspeed=AUTO, tiermem={"policy": KeepOnDevice()}),
        r"the DeepSpeed config says these \(where tensors live",
    ),
    "no_decay in tiermem=": (dict(tiermem={"no_decay": ("*.bias",)}), r"get_decay_parameter_names\(\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_refused_at_construction(tmp_path, case):
    kw, match = BAD[case]
    with pytest.raises(ConfigError, match="^tiermem: .*" + match):
        _fails(tmp_path, **kw)


def test_one_process_on_several_gpus_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))  # what 2 visible GPUs give
    with pytest.raises(
        ConfigError,
        match=r"^tiermem: TieredTrainer drives one device per process \(2 GPUs are "
        r"visible to this one\); run one process per GPU with torchrun "
        r"--nproc_per_node 2$",
    ):
        _fails(tmp_path)


TRAIN_BAD = {
    "rmsprop": (
        dict(args={"optim": "rmsprop"}),
        r"optim='rmsprop'\) is not an optimizer tiermem runs; it runs "
        r"'adamw_torch', 'adamw_torch_fused'",
    ),
    "4-bit": (dict(args={"optim": "adamw_torch_4bit"}), r"optim='adamw_torch_4bit'\) is not an optimizer tiermem runs"),
    "adafactor": (
        dict(args={"optim": "adafactor"}),
        r"optim='adafactor'\) is transformers' Adafactor with an absolute step size .* pass "
        r"TieredTrainer\(optimizer_cls_and_kwargs=\(torch.optim.Adafactor",
    ),
    "a class tiermem cannot run": (
        dict(optimizer_cls_and_kwargs=(torch.optim.SparseAdam, {"lr": 0.1})),
        r"optimizer=SparseAdam could not be run generically",
    ),
    "another model's optimizer": (
        dict(optimizers=(torch.optim.AdamW(gpt2().parameters()), None)),
        r"hold \d+ tensors that are not parameters of the wrapped module",
    ),
    "config disagrees with args": (
        dict(deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}),
        r"optimizer\.params\.lr=0\.0003 but lr=0\.002 was given; make them agree",
    ),
    "config batch disagrees": (
        dict(deepspeed={"train_micro_batch_size_per_gpu": 8}),
        r"train_micro_batch_size_per_gpu=8 but train_micro_batch_size_per_gpu=2",
    ),
}


@pytest.mark.parametrize("case", sorted(TRAIN_BAD))
def test_refused_when_training_starts(tmp_path, case):
    kw, match = TRAIN_BAD[case]
    with pytest.raises(ConfigError, match="^tiermem: .*" + match):
        _fails(tmp_path, **kw).train()


def _llrd(model: GPT2LMHeadModel) -> list[dict]:
    """Layer-wise lr decay over a GPT-2: the embeddings lowest, each block higher, the rest at LR."""
    t = model.transformer
    layers = [[t.wte, t.wpe], *[[h] for h in t.h], [t.ln_f]]
    return [
        {"params": [p for mod in layer for p in mod.parameters()], "lr": LR * 0.5 ** (len(layers) - 1 - d)}
        for d, layer in enumerate(layers)
    ]


def _warmup(opt) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, [lambda s, i=i: min(1.0, (s + 1) / (i + 2)) for i in range(len(opt.param_groups))]
    )


def test_trainer_takes_an_optimizer_and_scheduler_of_the_users(tmp_path):
    """optimizers=(torch AdamW with per-layer groups, a per-group LambdaLR built on it): the Trainer
    trains as TieredModel's own loop with that optimizer and that schedule on tm.optimizer."""
    model = gpt2()
    opt = torch.optim.AdamW(_llrd(model), lr=LR, weight_decay=DECAY)
    trainer = Recording(
        model=model, args=arguments(tmp_path / "out"), train_dataset=dataset(), optimizers=(opt, _warmup(opt))
    )
    trainer.train()
    ref_model = gpt2()
    tm = TieredModel(
        ref_model,
        optimizer=torch.optim.AdamW(_llrd(ref_model), lr=LR, weight_decay=DECAY),
        precision="fp32",
        grad_clip=CLIP,
    )
    sched = _warmup(tm.optimizer)
    lrs = []
    for step in range(STEPS):
        for batch, n in trainer.fed[step * ACCUM : (step + 1) * ACCUM]:
            tm.backward(tm(**batch, num_items_in_batch=n).loss)
        lrs.append([g["lr"] for g in tm.optimizer.param_groups])
        tm.step()
        sched.step()
    got, want = trainer.tiered.state_dict(), tm.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [g["lr"] for g in trainer.tiered.optimizer.param_groups] == [g["lr"] for g in tm.optimizer.param_groups]
    history = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert history == [group_lrs[0] for group_lrs in lrs]  # the Trainer logs the first group's
    assert len({tuple(x) for x in lrs}) == STEPS  # the schedule moved every step


def test_trainer_builds_optimizer_cls_and_kwargs_on_its_weight_decay_groups(tmp_path):
    """optimizer_cls_and_kwargs=(torch.optim.AdamW, kwargs): built as the Trainer builds it (its
    decay and no-decay groups, the kwargs as given): the numbers of the default optimizer with
    the same hyperparameters, group for group."""
    kwargs = {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8}
    trainer = Recording(
        model=gpt2(),
        args=arguments(tmp_path / "out"),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=(torch.optim.AdamW, kwargs),
    )
    trainer.train()
    tm, _, _ = own_loop(trainer.fed, "fp32")
    got, want = trainer.tiered.state_dict(), tm.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [g["weight_decay"] for g in trainer.tiered.optimizer.param_groups] == [DECAY, 0.0]


def test_resume_needs_tiermems_checkpoint_of_the_same_step(tmp_path):
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    with pytest.raises(TierMemError, match=r"^tiermem: .*checkpoint-2' has no tiermem\.ckpt or trainer_state\.json"):
        _fails(tmp_path).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    (tmp_path / "out" / "checkpoint-2" / TIERMEM_CHECKPOINT).write_bytes(b"")  # the Trainer's state never came
    with pytest.raises(TierMemError, match=r"^tiermem: .*checkpoint-2' has no trainer_state\.json \(not saved"):
        _fails(tmp_path).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    with pytest.raises(TierMemError, match=r"^tiermem: no complete checkpoint-N folder"):
        _fails(tmp_path).train(resume_from_checkpoint=True)
    opt = TrainerOptimizer(TieredModel(gpt2(), precision="fp32"))
    saved = opt.state_dict()
    with pytest.raises(TierMemError, match=r"is of step 7 but its tiermem\.ckpt of step 0: the folder mixes two saves"):
        opt.load_state_dict({**saved, "tiermem_step": 7})
    with pytest.raises(TierMemError, match=r"not written by a TieredTrainer"):
        opt.load_state_dict({"state": {}, "param_groups": []})


def test_import_tiermem_does_not_import_transformers():
    code = "import sys, tiermem; assert 'transformers' not in sys.modules and 'tiermem.integrations' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


class Overflowing(Recording):
    """Multiplies the loss of optimizer step ``OVERFLOW`` (0-based) by ``BLOWUP``: in fp16 its
    scaled gradients overflow, as a loss spike does under the Trainer's own GradScaler."""

    def compute_loss(self, model, inputs, *a, **kw):
        loss = super().compute_loss(model, inputs, *a, **kw)
        return loss * BLOWUP if self.state.global_step == OVERFLOW else loss


OVERFLOW, BLOWUP = 1, 1e6


def test_fp16_step_skipped_for_overflow_leaves_the_lr_schedule(tmp_path):
    trainer = Overflowing(model=gpt2(), args=arguments(tmp_path / "out", fp16=True), train_dataset=dataset())
    trainer.train()
    tm, _, logs = own_loop(trainer.fed, "fp16", blowup={OVERFLOW: BLOWUP})
    assert [ref["skipped"] for ref in logs] == [s == OVERFLOW for s in range(STEPS)]  # the overflow did happen
    got, want = trainer.tiered.state_dict(), tm.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # the later steps ran with the oracle's lrs
    history = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [h["learning_rate"] for h in history] == [ref["lr"] for ref in logs]
    assert [h["loss_scale"] for h in history] == [ref["loss_scale"] for ref in logs]
    # the Trainer's rule under its GradScaler: a skipped step does not step the scheduler
    assert logs[OVERFLOW + 1]["lr"] == logs[OVERFLOW]["lr"] == LR and trainer.lr_scheduler.last_epoch == STEPS - 1
    assert trainer.accelerator.optimizer_step_was_skipped is False  # the last step was not skipped


@pytest.mark.parametrize(
    "optim, optim_args, want",
    [
        ("sgd", "momentum=0.9,nesterov=True", {"momentum": 0.9, "nesterov": True, "weight_decay": DECAY}),
        ("adagrad", "lr_decay=0.01", {"lr_decay": 0.01, "eps": 1e-10}),
        ("lion_32bit", None, {"betas": (0.9, 0.999), "weight_decay": DECAY}),  # the Trainer gives Lion the adam betas
        ("paged_adamw_8bit", None, {"betas": (0.9, 0.999), "eps": 1e-8}),
    ],
)
def test_trainer_optim_names_build_tiermems_optimizer_of_that_meaning(tmp_path, optim, optim_args, want):
    trainer = TieredTrainer(
        model=gpt2(),
        args=arguments(tmp_path / "out", optim=optim, optim_args=optim_args, max_steps=1),
        train_dataset=dataset(),
    )
    trainer.train()
    group = trainer.tiered.optimizer.param_groups[0]
    assert {k: group[k] for k in want} == want
    assert (
        type(trainer.tiered.optimizer_spec).__name__
        == {"sgd": "SGD", "adagrad": "Adagrad", "lion_32bit": "Lion", "paged_adamw_8bit": "AdamW8bit"}[optim]
    )
