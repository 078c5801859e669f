"""The step lifecycle (NOTE [Step lifecycle]): one phase, moved by the public calls and checked
at each of them, so misuse is refused in one place before anything changes."""

from __future__ import annotations

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss, same_state

from tiermem import AdamW, ConfigError, Phase, TieredModel


def _tm() -> TieredModel:
    torch.manual_seed(3)
    return TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision="fp32", bucket_size=2000)


def test_phases_follow_the_calls():
    tm = _tm()
    x, y = gpt_batch(0)
    assert tm.phase is Phase.IDLE
    out = tm(x)
    assert tm.phase is Phase.IDLE  # a forward alone leaves no grads
    tm.backward(gpt_loss(out, y))
    assert tm.phase is Phase.GRADS_READY
    tm.backward(gpt_loss(tm(x), y))  # a second micro-batch
    assert tm.phase is Phase.GRADS_READY
    tm.step()
    assert tm.phase is Phase.IDLE
    tm.detach()
    assert tm.phase is Phase.DETACHED


def test_a_backward_that_raises_drops_the_grads():
    tm = _tm()
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))
    handle = tm.module.blocks[0].register_full_backward_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tm.backward(gpt_loss(tm(x), y))
    handle.remove()
    assert tm.phase is Phase.IDLE  # earlier micro-batches are gone too: never a step on a mix


def test_step_from_inside_backward_is_refused_and_changes_nothing():
    tm = _tm()
    x, y = gpt_batch(0)
    before = tm.state_dict()
    handle = tm.module.blocks[1].register_full_backward_hook(lambda *a: tm.step())
    with pytest.raises(ConfigError, match=r"step is not allowed while the model is backward.*after backward returns"):
        tm.backward(gpt_loss(tm(x), y))
    handle.remove()
    assert same_state(before, tm.state_dict())
    assert tm.phase is Phase.IDLE
    tm.backward(gpt_loss(tm(x), y))  # and training goes on
    assert not tm.step().skipped


def test_forward_or_save_from_inside_forward_is_refused(tmp_path):
    tm = _tm()
    x, _ = gpt_batch(0)
    for misuse, call in ((lambda: tm(x), "forward"), (lambda: tm.save(str(tmp_path / "c.tm")), r"save\(\)")):
        handle = tm.module.ln_f.register_forward_hook(lambda *a, f=misuse: f())
        with pytest.raises(ConfigError, match=rf"{call} is not allowed while the model is forward"):
            tm(x)
        handle.remove()
        assert tm.phase is Phase.IDLE
    assert not (tmp_path / "c.tm").exists()


def test_a_second_backward_through_one_graph_keeps_the_grads_and_says_so(caplog):
    tm, ref = _tm(), _tm()
    x, y = gpt_batch(0)
    loss = gpt_loss(tm(x), y)
    tm.backward(loss)
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as e:
        tm.backward(loss)
    assert any("earlier gradients are kept" in n for n in getattr(e.value, "__notes__", ["earlier gradients are kept"]))
    assert "earlier gradients are kept" in caplog.text
    assert tm.phase is Phase.GRADS_READY
    ref.backward(gpt_loss(ref(x), y))
    assert tm.step().grad_norm == ref.step().grad_norm > 0  # the first backward's grads were stepped on
    assert same_state(tm.state_dict(), ref.state_dict())


def test_a_step_without_backward_is_a_no_op_that_does_not_count(caplog):
    tm = _tm()
    before = tm.state_dict()
    res = tm.step()
    assert res.skipped and res.step == 0 and res.grad_norm == 0.0
    assert "not counted" in caplog.text
    assert same_state(before, tm.state_dict())
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))
    assert tm.step().step == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda tm, x, y: tm.load("unused.tm"),
        lambda tm, x, y: tm.optimizer.step(),
        lambda tm, x, y: tm.no_sync().__enter__(),
        lambda tm, x, y: tm(x),
        lambda tm, x, y: tm.backward(torch.zeros((), requires_grad=True)),
        lambda tm, x, y: tm.step(),
        lambda tm, x, y: tm.state_dict(),
        lambda tm, x, y: tm.save("unused.tm"),
        lambda tm, x, y: tm.detach(),
    ],
)
def test_every_call_after_detach_says_so(call):
    tm = _tm()
    x, y = gpt_batch(0)
    tm.detach()
    with pytest.raises(ConfigError, match="this TieredModel was detached; wrap the module again"):
        call(tm, x, y)


def test_load_drops_the_gradients_waiting_for_a_step(tmp_path):
    tm, ref = _tm(), _tm()
    path = str(tmp_path / "c.tm")
    tm.save(path)
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))  # waiting for a step...
    tm.load(path)  # ...when the checkpoint comes back
    assert tm.phase is Phase.IDLE
    for m in (tm, ref):
        x, y = gpt_batch(1)
        m.backward(gpt_loss(m(x), y))
        m.step()
    assert same_state(tm.state_dict(), ref.state_dict())  # the old grads were not added to the new ones
