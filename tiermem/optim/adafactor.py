"""``adafactor_step``: torch.optim.Adafactor's update of one tensor, fused into as few passes as its
reductions allow (tiermem/optim/kernels/csrc/factored.py), with the reference in torch ops.

For a tensor of two or more dimensions (the last two factored, leading ones a batch, as torch does)
the state is ``row_var`` (one value per row: ``prod(shape[:-1])``) and ``col_var`` (one per column of
each matrix: ``prod(shape[:-2]) * shape[-1]``); for fewer dimensions, ``variance`` (one per element).
Differences from torch.optim.Adafactor (``foreach=False``), all at the rounding level: sums of squares
are taken directly in double (torch squares fp32 norms), square roots are correctly rounded, the
weights' and the update's RMS come from those sums, and a factored update's ``1/sqrt(v)`` (v = the
row's variance over the mean row variance, times the column's) is ``1/sqrt(row) * 1/sqrt(col)``, taken
once per row and column rather than per element, so the passes over the tensor move bytes, not
divide (unless v is below ``eps1**2``, where both clamp). ``eps1=None`` is fp32's machine epsilon, for bf16
master weights too (the update is computed in fp32).
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import Callable, Optional

import torch

from tiermem.config.argdocs import shares_args
from tiermem.errors import ConfigError
from tiermem.optim.arg_checks import make_hyper
from tiermem.optim.functional import ENTRY_ARGS
from tiermem.optim.hypers import _Hyper, check_hyper
from tiermem.optim.kernels import dispatch as _run, native as _native, sr as _sr
from tiermem.optim.kernels.sr import StochasticRound

FP32_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class AdafactorHyper(_Hyper):
    step: int
    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps1: Optional[float] = None
    eps2: float = 1e-3
    d: float = 1.0
    weight_decay: float = 0.0
    maximize: bool = False
    grad_scale: float = 1.0
    clip_coef: float = 1.0
    prechecked: InitVar[bool] = False  # checked already, by the same rules (NOTE [Checked once a step])
    where = "adafactor_step "

    def _check(self, values: dict) -> None:
        check_adafactor(self.where, **values)

    @property
    def eps1_value(self) -> float:
        return FP32_EPS if self.eps1 is None else self.eps1

    @property
    def one_minus_beta2(self) -> float:
        return self.step**self.beta2_decay

    @property
    def rho(self) -> float:
        return min(self.lr, 1 / (self.step**0.5))

    @property
    def decay_mul(self) -> float:
        return 1.0 - self.lr * self.weight_decay if self.weight_decay != 0 else 1.0

    def scalars(self, neg_step: float = 0.0) -> list[float]:
        w = self.one_minus_beta2
        return [
            self.grad_multiplier,
            self.clip_coef,
            self.eps1_value * self.eps1_value,
            self.decay_mul,
            neg_step,
            w,
            float(abs(_fp32(w)) >= 0.5),
            self.inv_eps1,
        ]

    @property
    def inv_eps1(self) -> float:
        """The update's factor where the second moment is clamped: 1 / sqrt(fp32(eps1^2)), rounded as
        the kernels round (a correctly rounded square root, then a division)."""
        return _fp32(1.0 / _fp32(math.sqrt(_fp32(self.eps1_value * self.eps1_value))))

    def neg_step(self, p_sumsq: float, u_sumsq: float, n: int) -> float:
        """-alpha / denom: the weights' RMS sets the step size, the update's RMS clips it."""
        alpha = max(self.eps2, math.sqrt(p_sumsq) / n**0.5) * self.rho
        denom = max(1.0, math.sqrt(u_sumsq) / (n**0.5 * self.d))
        return -alpha / denom


def _fp32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def check_adafactor(where: str, **values) -> None:
    """Each value against the one rule of its name (tiermem/config/specs.py's table, Adafactor's included)."""
    check_hyper(where, **values)


@shares_args(ENTRY_ARGS)
def adafactor_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-2,
    beta2_decay: float = -0.8,
    eps1: Optional[float] = None,
    eps2: float = 1e-3,
    d: float = 1.0,
    weight_decay: float = 0.0,
    maximize: bool = False,
    row_var: Optional[torch.Tensor] = None,
    col_var: Optional[torch.Tensor] = None,
    variance: Optional[torch.Tensor] = None,
    shape: Optional[tuple[int, ...]] = None,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out: Optional[torch.Tensor] = None,
    stochastic_round: Optional[StochasticRound] = None,
    check_finite: bool = True,
    impl: Optional[str] = None,
) -> bool:
    """One Adafactor update in place (see the module docstring for the state). ``shape`` is the
    parameter's shape when ``master`` is a flat view of it (default: master's own shape); the other
    arguments are as in :func:`tiermem.optim.sgd_step`. The state tensors are passed by name, as
    torch's state keys them; those of the other layout must be None.

    Args:
        lr: learning rate.
        beta2_decay: the exponent of the second moment's decay, as ``torch.optim.Adafactor``'s.
        eps1: term added to the squared gradient (None: the dtype's smallest normal number).
        eps2: floor of the parameter's RMS that scales the update.
        d: clipping threshold of the update's RMS.
        weight_decay: decoupled weight decay.
        maximize: maximize the objective instead of minimizing it.
        row_var: fp32 row factor of the second moment (parameters of 2 or more dimensions).
        col_var: fp32 column factor of the second moment (parameters of 2 or more dimensions).
        variance: fp32 full second moment (parameters of fewer than 2 dimensions).
        shape: the parameter's shape when ``master`` is a flat view of it.
        impl: ``"native"`` or ``"reference"`` instead of the default (tests and benchmarks).
    """
    hyper = make_hyper(
        AdafactorHyper,
        step=step,
        lr=lr,
        beta2_decay=beta2_decay,
        eps1=eps1,
        eps2=eps2,
        d=d,
        weight_decay=weight_decay,
        maximize=maximize,
        grad_scale=grad_scale,
        clip_coef=clip_coef,
    )
    shape, state = factored_state(master, shape, row_var, col_var, variance)
    return adafactor_update(
        master, grad, state, shape, out, hyper, stochastic_round=stochastic_round, check_finite=check_finite, impl=impl
    )


def adafactor_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    state: tuple[torch.Tensor, ...],
    shape: tuple[int, ...],
    out: Optional[torch.Tensor],
    hyper: AdafactorHyper,
    *,
    stochastic_round: Optional[StochasticRound],
    check_finite: bool,
    impl: Optional[str],
) -> bool:
    """:func:`adafactor_step` once its hyperparameters are checked (``hyper``) and its state is laid
    out for ``shape`` (the drop-in calls it with the hyperparameters it made once for the step)."""
    where = "adafactor_step "
    _run._check_impl(where, impl)
    _run._check_tensors(_kernel(shape), master, state, grad, out)
    _sr.check(master, stochastic_round, where)
    if master.numel() == 0:
        return False
    master, grad = master.detach(), grad.detach()
    flat = all(t is None or t.is_contiguous() for t in (master, grad, out, *state))
    lib = _run.choose_native(where, "adafactor", impl, master, flat)
    if check_finite and _run.any_nonfinite(grad):
        return True
    keys = None if stochastic_round is None else stochastic_round.keys(hyper.step)
    if lib is not None:
        _native_step(
            lib,
            master.view(-1),
            grad.view(-1),
            None if out is None else out.view(-1),
            [t.detach().view(-1) for t in state],
            shape,
            hyper,
            keys,
        )
    else:
        reference(master, [t.detach() for t in state], grad, out, shape, hyper, keys)
    return False


def factored_state(
    master: torch.Tensor,
    shape: Optional[tuple[int, ...]],
    row_var: Optional[torch.Tensor],
    col_var: Optional[torch.Tensor],
    variance: Optional[torch.Tensor],
) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
    """The parameter's shape (``shape``, else master's) and its state tensors in the kernels' order:
    (row_var, col_var) for two or more dimensions, else (variance,); the other layout's must be None."""
    if not isinstance(master, torch.Tensor):
        raise ConfigError(f"tiermem: adafactor_step master is a {type(master).__name__}, not a tensor; pass a tensor")
    shape = tuple(master.shape) if shape is None else tuple(int(s) for s in shape)
    if math.prod(shape) != master.numel():
        raise ConfigError(
            f"tiermem: adafactor_step shape={shape} has {math.prod(shape)} elements but master has "
            f"{master.numel()}; pass the parameter's shape"
        )
    if len(shape) >= 2:
        if row_var is None or col_var is None or variance is not None:
            raise ConfigError(
                f"tiermem: adafactor_step factors a tensor of shape {shape}: pass row_var and col_var "
                f"(and no variance), as torch.optim.Adafactor keeps them"
            )
        return shape, (row_var, col_var)
    if variance is None or row_var is not None or col_var is not None:
        raise ConfigError(
            f"tiermem: adafactor_step keeps a full variance for a tensor of shape {shape}: pass "
            f"variance (and no row_var or col_var), as torch.optim.Adafactor keeps it"
        )
    return shape, (variance,)


def _dims(shape: tuple[int, ...]) -> tuple[int, int, int]:
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def state_numels(shape: tuple[int, ...]) -> dict[str, int]:
    """The state's tensors and their element counts for a parameter of this shape."""
    if len(shape) >= 2:
        b, r, c = _dims(shape)
        return {"row_var": b * r, "col_var": b * c}
    return {"variance": math.prod(shape)}


def _kernel(shape: tuple[int, ...]) -> _run.Kernel:
    """What _run's tensor checks read: the state's names, dtypes and element counts."""
    specs = tuple(_run.StateSpec(name, torch.float32, _always(k)) for name, k in state_numels(shape).items())
    return _run.Kernel("adafactor_step", specs, None, None)  # type: ignore[arg-type]  # only the tensor checks read it


def _always(k: int) -> Callable[[int], int]:
    """A state's element count, whatever the master's."""
    return lambda n: k


def reference(
    master: torch.Tensor,
    state: list,
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
    shape: tuple[int, ...],
    h: AdafactorHyper,
    keys,
) -> None:
    """torch.optim.adafactor._single_tensor_adafactor's update in torch ops (module docstring)."""
    p = master if master.dtype == torch.float32 else master.float()
    g = grad.float() * (1.0 / h.grad_scale) * h.clip_coef
    g = (-g if h.maximize else g).reshape(shape)
    p_sumsq = float((p.double() ** 2).sum())
    w, eps1 = h.one_minus_beta2, h.eps1_value
    if len(shape) >= 2:
        b, r, c = _dims(shape)
        row_var = state[0].view(b, r)
        col_var = state[1].view(b, c)
        g2 = g.reshape(b, r, c).double() ** 2
        row_var.lerp_((g2.sum(-1) / c).float(), w)
        col_var.lerp_((g2.sum(-2) / r).float(), w)
        rs, rr, col, rc = factors(row_var, col_var, b, r, c, eps1)
        v = rs.view(b, r, 1) * col.view(b, 1, c)
        scale = torch.where(v < _fp32(eps1 * eps1), h.inv_eps1, rr.view(b, r, 1) * rc.view(b, 1, c))
        u = g.reshape(b, r, c) * scale
    else:
        variance = state[0].view(shape)
        variance.lerp_(g * g, w)
        u = g * _rsqrt(variance.clamp(min=eps1 * eps1))
    neg_step = h.neg_step(p_sumsq, float((u.double() ** 2).sum()), master.numel())
    if h.weight_decay != 0:
        p.mul_(h.decay_mul)
    p.add_(u.reshape(p.shape), alpha=neg_step)
    if keys is not None:
        master.copy_(_sr.round_bf16(p.reshape(-1), keys).view(master.shape))
    if out is not None:
        out.copy_(master)


def _rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x) as the kernels round it: a correctly rounded square root (NOTE [sqrt rounding]), then
    a division."""
    return torch.reciprocal(x.double().sqrt().float())


def factors(
    row_var: torch.Tensor, col_var: torch.Tensor, b: int, r: int, c: int, eps1: float
) -> tuple[torch.Tensor, ...]:
    """rs, rr, col, rc (flat): each row's variance over its batch's mean row variance (clamped at
    eps1, as torch clamps it) and 1/sqrt of it, each column's variance and 1/sqrt of it. The second
    moment of (r, c) is rs[r] * col[c] and its update's factor rr[r] * rc[c] (unless clamped)."""
    row_mean = row_var.view(b, r).mean(dim=-1, keepdim=True).clamp(min=eps1)
    rs = (row_var.view(b, r) / row_mean).reshape(-1)
    col = col_var.reshape(-1)
    return rs, _rsqrt(rs), col, _rsqrt(col)


def _native_step(
    lib,
    master: torch.Tensor,
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
    state: list,
    shape: tuple[int, ...],
    h: AdafactorHyper,
    keys,
) -> None:
    P, C, nt = _native.ptr, _native.code, _native.threads()
    sr = _native.keys(keys)
    n = master.numel()
    if len(shape) >= 2:
        b, r, c = _dims(shape)
        row_var, col_var = state
        row_sum, col_sum = torch.empty(b * r, dtype=torch.float64), torch.empty(b * c, dtype=torch.float64)
        sums = torch.zeros(2, dtype=torch.float64)  # the sums of p^2 and of u^2
        s = h.scalars()
        lib.tm_adafactor_stats(
            b, r, c, P(master), C(master), P(grad), C(grad), _native.floats(s), P(row_sum), P(col_sum), P(sums), nt
        )
        w, eps1 = h.one_minus_beta2, h.eps1_value
        row_var.lerp_((row_sum / c).float(), w)
        col_var.lerp_((col_sum / r).float(), w)
        f = torch.cat(factors(row_var, col_var, b, r, c, eps1))
        u_sumsq = lib.tm_adafactor_rms(b, r, c, P(grad), C(grad), _native.floats(s), P(f), nt)
        s = h.scalars(h.neg_step(sums[0].item(), u_sumsq, n))
        lib.tm_adafactor_apply(
            b, r, c, P(master), C(master), P(grad), C(grad), P(out), C(out), P(f), _native.floats(s), sr, nt
        )
    else:
        (variance,) = state
        sums = torch.zeros(2, dtype=torch.float64)  # the sums of u^2 and of p^2
        lib.tm_adafactor_vec_stats(
            n,
            P(master),
            C(master),
            P(grad),
            C(grad),
            P(variance),
            _native.floats(h.scalars()),
            P(sums),
            sums.data_ptr() + 8,
            nt,
        )
        s = h.scalars(h.neg_step(sums[1].item(), sums[0].item(), n))
        lib.tm_adafactor_vec_apply(
            n, P(master), C(master), P(grad), C(grad), P(out), C(out), P(variance), _native.floats(s), sr, nt
        )
