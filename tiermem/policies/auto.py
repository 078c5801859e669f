"""Auto: the placement with the least predicted step time that fits, chosen per model.

    tm = TieredModel(model, Auto(), budgets=Budgets(device="20GiB", host="64GiB"), nvme_dir="/mnt/nvme/x")
    print(tm.report())        # what it chose, and the predicted against the measured stages

# NOTE [How Auto chooses]
Auto decides per trainable parameter, in the order forward uses them (ModelInfo.params), and keeps
activations on the device. A candidate is a tier for the weights (device, host or NVMe) and three
runs of parameters: the first ``d`` keep their grads and optimizer state on the device (the split
step, NOTE [Which optimizer state goes to the device first]: only with weights on the device), the
next ``h`` keep them on the host, the rest keep their state on NVMe with their grads on the host
(or on NVMe, when even that leaves the host short). The weights stay on the device whenever some
candidate with them there fits; only then are the host and NVMe tried, in that order (the cost
model does not price the per-module fetches of off-device weights, which cost more than their
bytes, so it would rank them too well). For each weights tier it finds, by bisection,
the largest ``d`` whose device part fits (less ``device_reserve`` of the device, left for
activations and temporaries), and for ``d`` and a few smaller values the largest ``h`` that fits
the host (the candidate with the least on NVMe, so the one to judge against the disk); every candidate is judged by the planner (NOTE [Choosing a placement]): the constructor's
own footprint and limits, and the cost model's predicted seconds per stage (NOTE [Cost model]). The
fastest candidate that fits wins; among those within 1% of it, the one with the most bytes on
the device (on a machine whose "device" is the CPU, every split predicts the same Adam time). So,
at the extremes: memory to spare puts everything on the
device; when 16 B/param of grads and state do not fit there, the state splits with the largest
device share that fits; when the host is short too, the state that does not fit goes to NVMe; and
a candidate the constructor would refuse is never chosen (when none fits, the error says what is
short by how much).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from tiermem.config.specs import is_int, is_number
from tiermem.errors import ConfigError, checked_arguments, fmt_bytes
from tiermem.plan.policy import Evaluation, ModelInfo, Policy, asked_alone, check_reserve, over_reserve
from tiermem.types import TensorClass, TensorInfo, Tier


class Assigned(Policy):
    """A placement decided per trainable parameter: the weights on one tier, each parameter's state
    (and grads) on the tiers given; activations on the device."""

    def __init__(self, label: str, weights: Tier, state: dict[str, Tier], grads: dict[str, Tier]):
        self.label, self.weights, self.state, self.grads = label, weights, state, grads

    def place(self, info: TensorInfo) -> Tier:
        if info.kind is TensorClass.PARAM:
            return self.weights
        if info.kind is TensorClass.ACTIVATION:
            return Tier.DEVICE
        assert info.param is not None  # a GRAD or OPTIM_STATE info names its parameter
        if info.kind is TensorClass.GRAD:
            return self.grads[info.param]
        return self.state[info.param]

    def places_activations_by_module(self) -> bool:
        return False  # every activation on the device: no module hooks

    def __repr__(self) -> str:
        return f"Assigned({self.label!r})"


class Verdict(enum.Enum):
    """What Auto made of a candidate."""

    CHOSEN = "chosen"
    FITS = "fits"  # judged, before the fastest was picked
    AS_FAST = "as fast within 1%"  # fits, as fast as the chosen one, with less on the device
    SLOWER = "slower"  # fits, predicted slower than the chosen one
    DOES_NOT_FIT = "does not fit"
    REFUSED = "refused"  # a combination the constructor refuses


@dataclass(frozen=True)
class Choice:
    label: str
    policy: Policy
    evaluation: Evaluation
    outcome: Verdict
    why: str = ""  # the figures behind the outcome, in words

    @property
    def verdict(self) -> str:
        """The outcome and why, in words (what ``tiermem plan --policy auto`` prints)."""
        return f"{self.outcome.value}: {self.why}" if self.why else self.outcome.value


@checked_arguments
class Auto(Policy):
    """Chooses the placement from the machine profile, the model's sizes and the budgets (NOTE [How
    Auto chooses]): among the candidates the constructor would accept, the one with the least
    predicted step time. ``tm.placement`` shows the choice and every rejected alternative.

    Args:
        profile: a machine profile (a ``tiermem.plan.profile.Profile`` or its data as a dict) to use
            instead of this machine's (saved by ``tiermem bench``; measured on first use when none is).
        forward_backward: the measured seconds of one forward and backward, when known (they decide
            how much of the grads' trip hides behind backward); 0 when unknown.
        tokens_per_step: when ``forward_backward`` is unknown, the tokens (rows each weight
            multiplies) of a step, which predict it at the matmul rate of the precision in use
            (NOTE [Cost model]); 0 when unknown.
        device_reserve: the share of the device's limit left for activations (NOTE [Device reserve]
            in tiermem/plan/policy.py), from 0 up to (not including) 1.
    """

    def __init__(
        self,
        *,
        profile: Any = None,
        forward_backward: float = 0.0,
        tokens_per_step: int = 0,
        device_reserve: float = 0.1,
    ):
        if not is_number(forward_backward) or not forward_backward >= 0:
            raise ConfigError(
                f"tiermem: Auto.forward_backward={forward_backward!r} is invalid: the seconds of one "
                f"forward and backward, a number >= 0 (0 when unknown)"
            )
        if not is_int(tokens_per_step) or tokens_per_step < 0:
            raise ConfigError(
                f"tiermem: Auto.tokens_per_step={tokens_per_step!r} is invalid: the tokens of one step "
                f"(batch x sequence x micro-batches), an int >= 0 (0 when unknown)"
            )
        if (
            profile is not None
            and not isinstance(profile, Mapping)
            and not isinstance(getattr(profile, "data", None), Mapping)
        ):
            raise ConfigError(
                f"tiermem: Auto.profile={profile!r} is invalid: pass a machine profile (a "
                f"tiermem.plan.profile.Profile, e.g. load_profile(path), or its data as a dict), or "
                f"None for this machine's"
            )
        self.profile, self.forward_backward, self.tokens_per_step = profile, float(forward_backward), tokens_per_step
        self.device_reserve = check_reserve(device_reserve, "Auto")  # NOTE [Device reserve]

    def place(self, info: TensorInfo) -> Tier:
        if info.kind is TensorClass.ACTIVATION:
            return Tier.DEVICE
        raise asked_alone(self, info)  # the choice needs the whole model: AutoChoice answers

    def places_activations_by_module(self) -> bool:
        return False

    def for_model(self, model: ModelInfo) -> Policy:
        if model.evaluate is None:
            raise ConfigError(
                "tiermem: Auto() needs the planner to judge placements; use it through "
                "TieredModel(module, Auto(), ...) or `tiermem plan --policy auto`"
            )
        judged = _Search(self, model).run()
        fitting = sorted((c for c in judged if c.outcome is Verdict.FITS), key=lambda c: c.evaluation.seconds)
        if not fitting:
            raise ConfigError(
                f"tiermem: Auto() found no placement that fits: {_closest(judged)}; raise the "
                f"Budgets, pass nvme_dir=... for NVMe, or lower device_reserve"
            )
        # within 1% of the fastest, the one with the most on the device: the cost model cannot tell
        # such candidates apart, and it leaves out costs that grow with what is off the device
        # (driving the copies, the memory bandwidth they share with Adam)
        near = [c for c in fitting if c.evaluation.seconds <= 1.01 * fitting[0].evaluation.seconds]
        best = max(near, key=lambda c: c.evaluation.need.get(Tier.DEVICE, 0))
        rest = []
        for c in judged:
            if c is best:
                continue
            if c.outcome is Verdict.FITS and c in near:
                c = Choice(
                    c.label,
                    c.policy,
                    c.evaluation,
                    Verdict.AS_FAST,
                    f"{_ms(c.evaluation.seconds)} predicted, with less on the device",
                )
            elif c.outcome is Verdict.FITS:
                c = Choice(
                    c.label,
                    c.policy,
                    c.evaluation,
                    Verdict.SLOWER,
                    f"{_ms(c.evaluation.seconds)} predicted against {_ms(best.evaluation.seconds)}",
                )
            rest.append(c)
        chosen = Choice(best.label, best.policy, best.evaluation, Verdict.CHOSEN)
        return AutoChoice((chosen, *rest), self.profile)

    def __repr__(self) -> str:
        return "Auto()"


@dataclass(frozen=True, repr=False, eq=False)
class AutoChoice(Policy):
    """What ``Auto`` chose for one model (NOTE [How Auto chooses]): it places every tensor as the
    chosen candidate does. ``choices``: every candidate judged, the chosen one first;
    ``profile``: the machine profile it was chosen with (None: this machine's), which
    ``tm.report()`` predicts the step from."""

    choices: tuple[Choice, ...]
    profile: Any = None

    @property
    def chosen(self) -> Choice:
        return self.choices[0]

    def place(self, info: TensorInfo) -> Tier:
        return self.chosen.policy.place(info)

    def places_activations_by_module(self) -> bool:
        return self.chosen.policy.places_activations_by_module()

    def __repr__(self) -> str:
        return f"Auto(chose {self.chosen.label!r})"


class _Search:
    """The candidates of NOTE [How Auto chooses], judged once each."""

    def __init__(self, auto: Auto, model: ModelInfo):
        assert model.evaluate is not None, "the planner binds a policy with its evaluator"
        self.auto, self.model, self.evaluate = auto, model, model.evaluate
        self.names = [p.name for p in model.params]
        self.numel = [p.numel for p in model.params]
        self.total = max(1, sum(self.numel))
        self.judged: dict[tuple[object, ...], Choice] = {}

    def run(self) -> list[Choice]:
        m = len(self.names)
        for weights in (Tier.DEVICE, Tier.HOST, Tier.NVME):
            if any(c.outcome is Verdict.FITS for c in self.judged.values()):
                break  # weights leave the device only when they cannot stay (NOTE [How Auto chooses])
            # the bisections call their lambdas at once, within this iteration (hence the noqa: B023)
            d_max = (
                self._largest(lambda d: self._device_ok(self._judge(weights, d, m - d, Tier.HOST)), m)  # noqa: B023
                if weights == Tier.DEVICE
                else 0
            )
            if d_max is None:
                continue  # not even the weights fit on the device
            for d in sorted({d_max, d_max * 3 // 4, d_max // 2, d_max // 4, 0}, reverse=True):
                for grads in (Tier.HOST, Tier.NVME):
                    # the host's part shrinks as h does, NVMe's grows: the largest h the host holds
                    # is the one with the least on NVMe, so it fits if any h does
                    h = self._largest(lambda h: self._host_ok(self._judge(weights, d, h, grads)), m - d)  # noqa: B023
                    if h is not None and self._fits(self._judge(weights, d, h, grads)):
                        break
        return list(self.judged.values())

    @staticmethod
    def _largest(ok: Callable[[int], bool], hi: int) -> Optional[int]:
        """The largest k in [0, hi] with ok(k), for ok true up to some k and false after; None if ok(0) is false."""
        if ok(hi):
            return hi
        if not ok(0):
            return None
        lo = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    def _judge(self, weights: Tier, d: int, h: int, grads_rest: Tier) -> Choice:
        if weights != Tier.DEVICE:
            d = 0  # the device updates on-device weights only (placement's rule)
        m = len(self.names)
        h = min(h, m - d)
        if d + h == m:
            grads_rest = Tier.HOST  # nothing on NVMe: the grads' rest tier does not matter
        key = (weights, d, h, grads_rest)
        if key not in self.judged:
            state, grads = {}, {}
            for i, name in enumerate(self.names):
                state[name] = Tier.DEVICE if i < d else Tier.HOST if i < d + h else Tier.NVME
                grads[name] = Tier.DEVICE if i < d else Tier.HOST if i < d + h else grads_rest
            label = self._label(weights, d, h, grads_rest)
            policy = Assigned(label, weights, state, grads)
            ev = self.evaluate(
                policy,
                profile=self.auto.profile,
                forward_backward=self.auto.forward_backward,
                tokens=self.auto.tokens_per_step,
            )
            self.judged[key] = Choice(label, policy, ev, *self._verdict(ev))
        return self.judged[key]

    def _label(self, weights: Tier, d: int, h: int, grads_rest: Tier) -> str:
        share = [sum(self.numel[:d]), sum(self.numel[d : d + h]), sum(self.numel[d + h :])]
        counts = [d, h, len(self.names) - d - h]
        parts = [
            f"{100 * n / self.total:.0f}% {t} ({k} params)"
            for n, k, t in zip(share, counts, ("device", "host", "NVMe"))
            if k
        ]
        grads = "" if not share[2] or grads_rest == Tier.HOST else ", grads of the NVMe part on NVMe"
        return f"weights on {weights}; grads and optimizer state: {' / '.join(parts) or 'none'}{grads}"

    def _over_reserve(self, ev: Evaluation) -> Optional[str]:
        return over_reserve(ev.need[Tier.DEVICE], self.model.limits, self.auto.device_reserve)

    def _device_ok(self, c: Choice) -> bool:
        ev = c.evaluation
        return ev.refused is None and Tier.DEVICE not in ev.short and self._over_reserve(ev) is None

    def _host_ok(self, c: Choice) -> bool:
        ev = c.evaluation
        return ev.refused is None and not {Tier.DEVICE, Tier.HOST} & set(ev.short)

    def _fits(self, c: Choice) -> bool:
        return c.outcome is Verdict.FITS

    def _verdict(self, ev: Evaluation) -> tuple[Verdict, str]:
        if ev.refused is not None:
            return Verdict.REFUSED, ev.refused
        if ev.short:
            return Verdict.DOES_NOT_FIT, ", ".join(f"{t} short by {fmt_bytes(n)}" for t, n in ev.short.items())
        words = self._over_reserve(ev)
        return (Verdict.FITS, "") if words is None else (Verdict.DOES_NOT_FIT, words)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _closest(judged: list[Choice]) -> str:
    short = [c for c in judged if c.evaluation.short]
    if not short:
        return "; ".join(sorted({c.verdict for c in judged}))[:400]
    c = min(short, key=lambda c: sum(c.evaluation.short.values()))
    return f"the closest ({c.label}) {c.verdict}"
