"""TieredTrainer under torch.distributed (2 gloo ranks in fresh processes, tests/ranks.py): the
Trainer's sampler splits the data, gradient accumulation communicates once per step (tm.no_sync()
on the earlier micro-batches), the ranks train like one process over both ranks' micro-batches,
a checkpoint-N/ holds one tiermem.ckpt (a DCP directory both ranks wrote), a resume on 2 ranks
continues bit-exact, evaluation, load_best_model_at_end and an fp16 overflow on one rank work
there, checkpoint-2 resumes in one process too, save_model() on rank 0 alone is a tiermem: error once the process group's timeout
passes (not a hang), and README's torchrun command runs the example."""

from __future__ import annotations

import os
import shutil
import time
from datetime import timedelta

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import transformers
from fresh import run_python
from ranks import free_port, run_ranks
from test_integrations_transformers import (
    ACCUM,
    CLIP,
    DECAY,
    LR,
    OVERFLOW,
    STEPS,
    WARMUP,
    Overflowing,
    Recording,
    arguments,
    dataset,
    gpt2,
)

from tiermem import AdamW, ConfigError, TieredModel, TierMemError
from tiermem.integrations.hf_loop import TrainerModule
from tiermem.integrations.transformers import TIERMEM_CHECKPOINT, TieredTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = 32  # 2 ranks x 2 per micro-batch x 2 micro-batches x 4 steps: one epoch
EVAL = 6
#: fp32 weights of 2 ranks against one process on the same samples after 4 steps: the gradient
#: sums run in another order (measured 1.4e-7 here; grad norms and losses 1e-7 apart relatively);
#: a wrong lr or a lost micro-batch moves the weights by ~1e-3, a wrong loss scaling the grad norm 2x
SPREAD, REL = 5e-7, 1e-6


@pytest.fixture(autouse=True, scope="module")
def _same_kernel_as_the_ranks():
    """The ranks run torch's fused AdamW (tests/ranks.py); so does the one-process oracle here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERMEM_NO_COMPILE", "1")
        yield


class OverflowingOnRank0(Overflowing):
    def compute_loss(self, model, inputs, *a, **kw):
        if self.args.process_index == 0:
            return super().compute_loss(model, inputs, *a, **kw)
        return Recording.compute_loss(self, model, inputs, *a, **kw)


def _rank_trainer(rank, world, tmp):
    """A run with checkpoints, then a resume from its checkpoint-2 in another folder and an
    evaluation; then a configuration refused."""
    import torch.distributed as dist

    # what torchrun sets; accelerate reads these and joins the group the harness made
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    entered = []
    no_sync = TrainerModule.no_sync
    TrainerModule.no_sync = lambda self: entered.append(1) or no_sync(self)  # count the Trainer's
    kw = dict(save_strategy="steps", save_steps=2, per_device_eval_batch_size=1)
    first = Recording(model=gpt2(), args=arguments(os.path.join(tmp, "a"), **kw), train_dataset=dataset(SAMPLES))
    first.train()
    out = {
        "world": first.args.world_size,
        "tm_world": first.tiered.group.world,
        "no_sync": len(entered),
        "fed": first.fed,
        "weights": first.tiered.state_dict(),
        "history": first.state.log_history,
        "files": sorted(os.listdir(os.path.join(tmp, "a", "checkpoint-2"))),
        "tiermem_files": sorted(os.listdir(os.path.join(tmp, "a", "checkpoint-2", TIERMEM_CHECKPOINT))),
        "checkpoint": os.path.join(tmp, "a", "checkpoint-2"),
    }  # written by both ranks; resumed in one process too
    if rank == 0:
        shutil.copytree(os.path.join(tmp, "a", "checkpoint-2"), os.path.join(tmp, "b", "checkpoint-2"))
    dist.barrier()
    second = TieredTrainer(model=gpt2(), args=arguments(os.path.join(tmp, "b"), **kw), train_dataset=dataset(SAMPLES))
    second.train(resume_from_checkpoint=True)
    out.update(resumed=second.tiered.state_dict(), resumed_history=second.state.log_history)
    out["eval_loss"] = second.evaluate(dataset(EVAL))["eval_loss"]  # the eval sampler splits these too
    model = gpt2()
    model.load_state_dict(out["resumed"])  # the oracle: the plain Trainer on these ranks, same fp32 weights
    plain = transformers.Trainer(model=model, args=arguments(os.path.join(tmp, "plain"), **kw))
    out["plain_eval_loss"] = plain.evaluate(dataset(EVAL))["eval_loss"]
    best = TieredTrainer(
        model=gpt2(),
        args=arguments(
            os.path.join(tmp, "best"),
            load_best_model_at_end=True,
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=1,
            metric_for_best_model="eval_loss",
            greater_is_better=True,
            per_device_eval_batch_size=1,
        ),
        train_dataset=dataset(SAMPLES),
        eval_dataset=dataset(EVAL),
    )
    best.train()  # the highest eval loss is the best: an early step
    out.update(
        best=best.state.best_model_checkpoint,
        best_steps=best.tiered.stepper.steps,
        best_history=best.state.log_history,
        best_eval_loss=best.evaluate()["eval_loss"],
    )
    fp16 = OverflowingOnRank0(
        model=gpt2(), args=arguments(os.path.join(tmp, "fp16"), fp16=True), train_dataset=dataset(SAMPLES)
    )
    fp16.train()  # both ranks skip the step rank 0's loss blew up in (the overflow check is global)
    out.update(fp16_history=fp16.state.log_history, fp16_scheduled=fp16.lr_scheduler.last_epoch)
    try:  # a replica per rank would train each on its own data: refused on both ranks alike
        TieredTrainer(
            model=gpt2(),
            args=arguments(os.path.join(tmp, "c")),
            train_dataset=dataset(SAMPLES),
            tiermem={"process_group": False},
        ).train()
    except ConfigError as e:
        out["refused"] = str(e)
    # save_model() on rank 0 alone (a collective): an error naming the mistake once the process
    # group's timeout (shortened here) has passed; rank 1 does not save, and waits until rank 0 is done
    dist.barrier()
    dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=2))
    done = os.path.join(tmp, "alone.done")
    if rank == 0:
        try:
            second.save_model(os.path.join(tmp, "alone"))
        except TierMemError as e:
            out["alone"] = str(e)
        open(done, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_rank_trainer, str(tmp_path_factory.mktemp("trainer-dp")), deadline=240.0)


def one_process(fed0, fed1, then=()):
    """The oracle: TieredModel's own loop in one process over both ranks' micro-batches of each
    step, each loss a share of the step's tokens over both ranks; then over the micro-batches
    ``then`` of a single process, ACCUM a step."""
    model = gpt2()
    no_decay = tuple(n for n, _ in model.named_parameters() if n.endswith(".bias") or ".ln_" in n)
    tm = TieredModel(
        model, optimizer=AdamW(lr=LR, weight_decay=DECAY, no_decay=no_decay), precision="fp32", grad_clip=CLIP
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        tm.optimizer, lambda s: s / WARMUP if s < WARMUP else max(0.0, (STEPS - s) / (STEPS - WARMUP))
    )
    logs = []
    groups = [fed0[i : i + ACCUM] + fed1[i : i + ACCUM] for i in range(0, len(fed0), ACCUM)] + [
        list(then[i : i + ACCUM]) for i in range(0, len(then), ACCUM)
    ]
    assert len(groups) == STEPS
    for group in groups:
        n = group[0][1]
        assert all(int(n_fed) == int(n) for _, n_fed in group)  # the Trainer counted the tokens of both ranks
        assert int(n) in {int(sum((b["labels"][:, shift:] != -100).sum() for b, _ in group)) for shift in (0, 1)}
        loss = 0.0
        for b, _ in group:
            share = tm(**b, num_items_in_batch=n).loss
            tm.backward(share)
            loss += share.item()
        lr = tm.optimizer.param_groups[0]["lr"]
        res = tm.step()
        sched.step()
        logs.append({"loss": loss, "grad_norm": res.grad_norm, "lr": lr})
    return tm.state_dict(), logs


def test_the_trainers_sampler_splits_the_data_between_the_ranks(ranks):
    assert [r["world"] for r in ranks] == [r["tm_world"] for r in ranks] == [2, 2]
    rows = [tuple(x.tolist()) for r in ranks for b, _ in r["fed"] for x in b["input_ids"]]
    assert sorted(rows) == sorted(tuple(d["input_ids"].tolist()) for d in dataset(SAMPLES))  # each once


def test_two_ranks_train_like_one_process_over_both_ranks_micro_batches(ranks):
    want, logs = one_process(ranks[0]["fed"], ranks[1]["fed"])
    for r in ranks:
        assert max((r["weights"][k] - want[k]).abs().max().item() for k in want) < SPREAD
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in want)  # one model
    # accumulation: no reduction on the micro-batches before a step's last
    assert [r["no_sync"] for r in ranks] == [STEPS * (ACCUM - 1)] * 2
    history = [[h for h in r["history"] if "grad_norm" in h] for r in ranks]
    assert history[0] == history[1]  # every rank logs the same (the Trainer prints rank 0's)
    for h, ref in zip(history[0], logs):
        assert h["learning_rate"] == ref["lr"]
        assert h["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL)
        assert h["loss"] == pytest.approx(ref["loss"], rel=REL)  # the mean over ranks of each rank's sum
    assert any(ref["grad_norm"] > CLIP for ref in logs)


def test_checkpoint_holds_one_tiermem_checkpoint_and_resumes_bit_exact_on_two_ranks(ranks):
    files = set(ranks[0]["files"])
    assert {
        TIERMEM_CHECKPOINT,
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "trainer_state.json",
        "rng_state_0.pth",
        "rng_state_1.pth",
    } <= files
    assert [f for f in files if f.endswith(".ckpt")] == [TIERMEM_CHECKPOINT]  # one checkpoint, whatever the world size
    assert ranks[0]["tiermem_files"] == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "tiermem-rank0.json",
        "tiermem-rank1.json",
    ]  # a DCP directory: every rank wrote its shards
    for r in ranks:
        assert all(torch.equal(r["resumed"][k], r["weights"][k]) for k in r["weights"])
        later = lambda hist: [h for h in hist if "grad_norm" in h and h["step"] > 2]  # noqa: E731
        assert later(r["resumed_history"]) == later(r["history"])


def test_a_checkpoint_of_two_ranks_resumes_in_one_process(ranks, tmp_path):
    """checkpoint-2 of the 2-rank run, resumed by a TieredTrainer in this process (world 1):
    the last two steps train like TieredModel's own loop that ran the first two over both ranks'
    micro-batches and the last two over this process's."""
    shutil.copytree(ranks[0]["checkpoint"], tmp_path / "checkpoint-2")
    one = Recording(model=gpt2(), args=arguments(str(tmp_path)), train_dataset=dataset(SAMPLES))
    one.train(resume_from_checkpoint=True)
    assert one.tiered.group.world == 1 and one.args.world_size == 1
    assert len(one.fed) == (STEPS - 2) * ACCUM  # the two steps after the checkpoint, nothing before
    want, logs = one_process(ranks[0]["fed"][: 2 * ACCUM], ranks[1]["fed"][: 2 * ACCUM], then=one.fed)
    got = one.tiered.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= SPREAD
    history = [h for h in one.state.log_history if "grad_norm" in h]  # the checkpoint's, then this run's
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    history = history[2:]
    for h, ref in zip(history, logs[2:]):
        assert h["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL)
        assert h["loss"] == pytest.approx(ref["loss"], rel=REL)
        assert h["learning_rate"] == pytest.approx(ref["lr"], rel=1e-12)


def test_evaluate_on_two_ranks_and_a_replica_per_rank_refused(ranks):
    for r in ranks:
        assert r["eval_loss"] == r["plain_eval_loss"]
        assert r["refused"].startswith("tiermem: this Trainer runs 2 processes but the TieredModel shards over 1")


def test_save_model_on_rank_0_alone_is_a_tiermem_error_at_the_timeout(ranks):
    message = ranks[0]["alone"]
    assert message.startswith("tiermem: save_model() waited for the other ranks past the process group's timeout")
    assert "call it on every rank" in message and "Timed out" in message and "\n" not in message
    assert "alone" not in ranks[1]


def test_load_best_model_at_end_on_two_ranks(ranks):
    evals = [{h["step"]: h["eval_loss"] for h in r["best_history"] if "eval_loss" in h} for r in ranks]
    assert evals[0] == evals[1] and len(evals[0]) == STEPS
    step = max(evals[0], key=evals[0].get)
    for r in ranks:
        assert step < STEPS and r["best"].endswith(f"checkpoint-{step}") and r["best_steps"] == step
        assert r["best_eval_loss"] == evals[0][step]  # the metric it was chosen by, measured again


def test_fp16_overflow_on_two_ranks_leaves_the_lr_schedule(ranks):
    for r in ranks:
        logged = [h for h in r["fp16_history"] if "grad_norm" in h]
        scales = [h["loss_scale"] for h in logged]
        assert scales[OVERFLOW] == scales[0] / 2 and set(scales[OVERFLOW:]) == {scales[OVERFLOW]}  # one skip
        lrs = [h["learning_rate"] for h in logged]
        assert lrs[OVERFLOW + 1] == lrs[OVERFLOW] == LR and r["fp16_scheduled"] == STEPS - 1
    same = lambda r: [str(h) for h in r["fp16_history"][:-1]]  # noqa: E731 - str: a skipped step's norm is nan
    assert same(ranks[0]) == same(ranks[1])  # the last entry holds timings


def test_the_readmes_torchrun_command_runs_the_example(tmp_path):
    """``torchrun --nproc_per_node 2 examples/trainer_gpt.py``, a few steps: trains, checkpoints,
    and prints once (rank 0)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    # torchrun's --master-port read from its environment (the command stays the README's): a free
    # port, not the default 29500, which another run on this machine (a pytest-xdist worker) may hold
    env["PET_MASTER_PORT"] = str(free_port())
    cmd = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "examples", "trainer_gpt.py"),
        "--steps",
        "4",
        "--save-steps",
        "2",
        "--out",
        str(tmp_path / "run"),
    ]
    proc = run_python(*cmd, timeout=240, env=env, cwd=tmp_path)  # the agent forked, its workers fresh interpreters
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("world size 2: loss ") == 1, proc.stdout
    assert "'checkpoint-2', 'checkpoint-4'" in proc.stdout
    assert (tmp_path / "run" / "checkpoint-4" / TIERMEM_CHECKPOINT / "tiermem-rank1.json").is_file()
