"""Checkpoints keyed by parameter name (never by bucket), written atomically.

A checkpoint is one ``torch.save`` file: ``{"format", "params", "exp_avg", "exp_avg_sq",
"param_step", "frozen", "buffers", "groups", "scaler", "step", "precision"}``, every tensor
map keyed by the parameter's canonical (first) qualified name. It is written to a temporary
file beside the target and renamed over it only once complete, so a failed save leaves the
previous checkpoint loadable. Loading validates everything before changing anything.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from tiermem.errors import StoreError, TierMemError

if TYPE_CHECKING:
    from tiermem.model import TieredModel

FORMAT = "tiermem-checkpoint/1"
_HYPER = ("lr", "betas", "eps", "weight_decay", "initial_lr")


def _slots(tm: "TieredModel"):
    for b in tm.layout.buckets:
        buf = tm.layout.buffers[b.index]
        for s in b.slots:
            yield buf, s, slice(s.offset, s.offset + s.numel)


def fp32_weights(tm: "TieredModel") -> dict[str, torch.Tensor]:
    """Every parameter name (tied aliases included) -> its fp32 value, as views (no copies)."""
    out: dict[str, torch.Tensor] = {}
    for buf, s, sl in _slots(tm):
        for name in tm.layout.names[id(s.param)]:
            out[name] = buf.master[sl].view(s.shape)
    for name, t in tm.layout.frozen.items():
        for alias in tm.layout.names.get(id(dict(tm.module.named_parameters())[name]), [name]):
            out[alias] = t
    return out


def module_state(tm: "TieredModel") -> dict[str, torch.Tensor]:
    weights = fp32_weights(tm)
    state = tm.module.state_dict()
    return {k: weights[k].detach().cpu().clone() if k in weights else
            v.detach().to("cpu", tm.layout.buffer_dtypes.get(k, v.dtype), copy=True) for k, v in state.items()}


def _buffers(tm: "TieredModel") -> dict[str, torch.Tensor]:
    return {name: b.detach().cpu() for name, b in tm.module.named_buffers()}


def save(tm: "TieredModel", path: str) -> None:
    doc = {
        "format": FORMAT,
        "precision": tm.precision,
        "step": tm.stepper.steps,
        "param_step": tm.stepper.param_steps(),
        "params": {s.name: buf.master[sl].view(s.shape) for buf, s, sl in _slots(tm)},
        "exp_avg": {s.name: buf.exp_avg[sl].view(s.shape) for buf, s, sl in _slots(tm)},
        "exp_avg_sq": {s.name: buf.exp_avg_sq[sl].view(s.shape) for buf, s, sl in _slots(tm)},
        "frozen": dict(tm.layout.frozen),
        "buffers": _buffers(tm),
        "groups": [{k: g[k] for k in _HYPER if k in g} for g in tm.optimizer.param_groups],
        "scaler": tm.scaler.state_dict(),
    }
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise StoreError(f"tiermem: cannot save a checkpoint to {path!r}: directory {directory!r} does not "
                         f"exist; create it or choose another path")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old checkpoint or the new one, never half
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise StoreError(f"tiermem: saving the checkpoint to {path!r} failed ({e.strerror or e}); free space "
                         f"or choose another path. Any previous checkpoint there is unchanged") from e


def load(tm: "TieredModel", path: str) -> None:
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise StoreError(f"tiermem: no checkpoint at {path!r}; pass the path given to tm.save()") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is not ours or is damaged
        raise StoreError(f"tiermem: {path!r} is not a readable tiermem checkpoint ({type(e).__name__}: {e}); "
                         f"pass a file written by tm.save()") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StoreError(f"tiermem: {path!r} is not a tiermem checkpoint (format "
                         f"{doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r}, expected "
                         f"{FORMAT!r}); pass a file written by tm.save()")
    _validate(tm, doc, path)
    for buf, s, sl in _slots(tm):
        buf.master[sl].copy_(doc["params"][s.name].reshape(-1))
        buf.exp_avg[sl].copy_(doc["exp_avg"][s.name].reshape(-1))
        buf.exp_avg_sq[sl].copy_(doc["exp_avg_sq"][s.name].reshape(-1))
    for b in tm.layout.buckets:
        buf = tm.layout.buffers[b.index]
        buf.param.copy_(buf.master)
    params = dict(tm.module.named_parameters())
    for name, t in tm.layout.frozen.items():
        t.copy_(doc["frozen"][name])
        params[name].data.copy_(t)
    buffers = dict(tm.module.named_buffers())
    for name, t in doc["buffers"].items():
        buffers[name].copy_(t)
    for group, saved in zip(tm.optimizer.param_groups, doc["groups"]):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    tm.scaler.load_state_dict(doc["scaler"])
    tm.stepper.load_param_steps(doc["param_step"], doc["step"])


def _validate(tm: "TieredModel", doc: dict, path: str) -> None:
    expected = {s.name: s.shape for _, s, _ in _slots(tm)}
    for part in ("params", "exp_avg", "exp_avg_sq"):
        got = doc.get(part, {})
        missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        if missing or unexpected:
            raise TierMemError(f"tiermem: checkpoint {path!r} does not match this model: {part} missing "
                               f"{missing[:5]}, unexpected {unexpected[:5]}; load it into the model it was "
                               f"saved from")
        for name, shape in expected.items():
            if tuple(got[name].shape) != tuple(shape):
                raise TierMemError(f"tiermem: checkpoint {path!r}: {name!r} has shape {tuple(got[name].shape)}, "
                                   f"the model has {tuple(shape)}; load it into the model it was saved from")
    if set(doc.get("frozen", {})) != set(tm.layout.frozen) or set(doc.get("buffers", {})) != {
            n for n, _ in tm.module.named_buffers()}:
        raise TierMemError(f"tiermem: checkpoint {path!r} has different frozen parameters or buffers than "
                           f"this model; load it into the model it was saved from")
    if len(doc.get("groups", [])) != len(tm.optimizer.param_groups):
        raise TierMemError(f"tiermem: checkpoint {path!r} has {len(doc.get('groups', []))} param groups, "
                           f"this model {len(tm.optimizer.param_groups)}; use the same optimizer spec")
