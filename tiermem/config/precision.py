"""Precisions: the working dtypes by name, and the choice of one for a device (``"auto"``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from tiermem.errors import ConfigError

log = logging.getLogger("tiermem.config")

#: The working precisions: the dtype of the weights forward and backward use, by name. The one
#: list: ``tiermem plan`` (tiermem.plan.sizing) derives its precisions and bytes per element from it.
PRECISIONS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#: What ``precision=`` takes: a working precision, or "auto" for this device's (NOTE [Choosing the precision]).
PRECISION_CHOICES: tuple[str, ...] = (*PRECISIONS, "auto")


def working_dtype(precision: str) -> torch.dtype:
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ConfigError(
            f"tiermem: precision={precision!r} is not supported; use one of {', '.join(repr(p) for p in PRECISIONS)}"
        ) from None


def precision_of(dtype: torch.dtype) -> str:
    """The name of a working dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    return next(name for name, d in PRECISIONS.items() if d == dtype)


# NOTE [Choosing the precision]
# ``precision="auto"`` becomes a working precision here, once, from the device the weights live on:
# - a GPU that computes bf16 natively (CUDA compute capability 8.0 and later, any ROCm device): "bf16";
# - an older GPU (Volta, Turing): "fp16", with dynamic loss scaling: its tensor cores run fp16 at
#   about 8x its fp32 rate, and it has no bf16 units (torch emulates bf16 there through fp32);
# - a CPU with AVX512-BF16 or AMX, when torch's matmul may use them: torch computes a bf16 matmul
#   on the CPU through oneDNN, so oneDNN must be built in and enabled (torch.backends.mkldnn), and
#   ONEDNN_MAX_CPU_ISA/DNNL_MAX_CPU_ISA, when set, not below AVX512_CORE_BF16: "bf16". ATen's own
#   capability (ATEN_CPU_CAPABILITY) does not decide: capped at AVX2 alone, the bf16 matmul still
#   ran 3x faster than fp32 here; without oneDNN (or capped), 8x slower;
# - any other CPU (AVX2 only, ARM, ...): "fp32". Without those instructions torch has no fast bf16
#   matmul (on an AVX2 EPYC a bf16 F.linear took 11x its fp32 time) and fp16 is no better, so
#   fp32 is the fastest there and needs no loss scaling. A CPU never gets "fp16": where it has fast
#   fp16 (AVX512-FP16, AMX-FP16) it has AMX-BF16 too, and bf16 needs no loss scaling.
# The rule reads what the hardware and torch say, never a timing: the same answer every time on a
# machine, and on every rank alike. How much slower bf16 and fp16 are than fp32 on this CPU is
# measured once into the machine profile (tiermem/model/machine.py): an explicit "bf16" on a CPU
# where it is much slower gets one warning with the figures, and the cost model predicts compute
# at the rate of the precision in use (NOTE [Cost model]).
_BELOW_BF16_ISAS = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


@dataclass(frozen=True)
class CpuFeatures:
    """What decides whether this CPU computes bf16 natively (NOTE [Choosing the precision]).
    Tests make one up; :meth:`detect` asks torch."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ... (shown, not a rule)
    avx512_bf16: bool
    amx: bool
    onednn_max_isa: Optional[str] = None  # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), when set
    onednn: bool = True  # torch's oneDNN (mkldnn) is built in and enabled: it runs the bf16 matmul

    @classmethod
    def detect(cls) -> "CpuFeatures":
        def has(name: str) -> bool:  # private torch probes (torch >= 2.3): absent means "cannot tell", so no
            probe = getattr(torch.cpu, name, None)
            return bool(probe()) if probe is not None else False

        isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        onednn = bool(
            torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            and torch.backends.mkldnn.enabled
        )
        return cls(
            torch.backends.cpu.get_cpu_capability(),
            has("_is_avx512_bf16_supported"),
            has("_is_amx_tile_supported"),
            isa or None,
            onednn,
        )

    @property
    def native_bf16(self) -> bool:
        capped = self.onednn_max_isa is not None and self.onednn_max_isa.upper() in _BELOW_BF16_ISAS
        return (self.avx512_bf16 or self.amx) and self.onednn and not capped

    def __str__(self) -> str:
        isa = [n for n, on in (("AVX512-BF16", self.avx512_bf16), ("AMX", self.amx)) if on]
        cap = f"; oneDNN capped at {self.onednn_max_isa}" if self.onednn_max_isa else ""
        off = "" if self.onednn else "; oneDNN off"
        return f"{self.capability} ({'has ' + ', '.join(isa) if isa else 'no AVX512-BF16, no AMX'}{cap}{off})"


def auto_precision(device: torch.device, *, cpu: Optional[CpuFeatures] = None) -> tuple[str, str]:
    """What ``precision="auto"`` is on ``device``, and why in words (NOTE [Choosing the precision]);
    ``cpu``: this CPU's features (None: detected)."""
    if device.type == "cuda":
        if torch.version.hip is not None:
            return "bf16", "a ROCm GPU computes bf16"
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return "bf16", f"a GPU of compute capability {major}.{minor} computes bf16"
        return "fp16", f"a GPU of compute capability {major}.{minor} has fp16 tensor cores and no bf16"
    cpu = CpuFeatures.detect() if cpu is None else cpu
    if cpu.native_bf16:
        return "bf16", f"this CPU computes bf16 natively: {cpu}"
    return "fp32", f"this CPU has no fast bf16 matmul: {cpu}"


def resolve_precision(precision: Any, device: torch.device, *, cpu: Optional[CpuFeatures] = None) -> str:
    """``precision`` checked, with "auto" made this device's working precision (NOTE [Choosing the
    precision])."""
    if precision == "auto":
        chosen, why = auto_precision(device, cpu=cpu)
        log.info("tiermem: precision='auto' is %r on %s: %s", chosen, device, why)
        return chosen
    if not (isinstance(precision, str) and precision in PRECISIONS):
        raise ConfigError(
            f"tiermem: precision={precision!r} is not supported; use one of "
            f"{', '.join(repr(p) for p in PRECISION_CHOICES)} ('auto': bf16 where the device "
            f"computes it natively, else fp32 on a CPU, fp16 on an older GPU)"
        )
    return precision
