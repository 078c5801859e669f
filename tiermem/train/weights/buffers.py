"""The module's buffers: computed with in the working precision, given back as the model wrote them.

# NOTE [Buffers keep their values]
Floating-point buffers (BatchNorm statistics, rotary ``inv_freq``) move to the device in the
working precision while the model is attached, as with ``module.half()``: ops such as
``batch_norm`` need them in the dtype of their inputs. Rounding them must not be for good: each
one's value as given is kept (on the host, in its own dtype). ``state_dict()`` and ``detach()``
give back, for a buffer the model never wrote, that value bit for bit; for one it wrote (it no
longer holds the rounded value, or the module holds another tensor), what it wrote, in the
buffer's own dtype. Checkpoints hold buffers as the model computes with them (in the working
precision); after a load a buffer gives back the loaded value.

A model built for inference (NOTE [Inference only]) keeps its non-persistent buffers (those outside
``state_dict()``, which the model computes when it is built: rotary ``inv_freq``) in their own
dtype, as transformers' ``from_pretrained(..., torch_dtype=...)`` leaves them: its rotary
embedding computes in fp32 from an fp32 ``inv_freq``, and an ``inv_freq`` rounded to bf16 gives
other positions' angles, so other tokens than the model loaded in that dtype. Persistent buffers
(BatchNorm statistics, which kernels need in their input's dtype) take the working precision, as
training's do.
"""

from __future__ import annotations

from typing import Iterator

import torch


class KeptBuffers:
    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, device: torch.device, *, inference: bool = False):
        self.module, self.dtype, self.device = module, dtype, device
        self.inference = inference  # non-persistent buffers keep their own dtype
        self.dtypes: dict[str, torch.dtype] = {}  # every buffer's dtype as given
        self._given: dict[str, torch.Tensor] = {}  # float buffers' values as given (or last loaded)
        self._placed: dict[str, torch.Tensor] = {}  # the tensor put in the module
        for name, owner, bname, buf in self._buffers():
            self.dtypes[name] = buf.dtype
            if buf.is_floating_point():
                self._given[name] = buf.detach().to("cpu", copy=True)
            self._place(name, owner, bname, buf)

    def _buffers(self) -> Iterator[tuple[str, torch.nn.Module, str, torch.Tensor]]:
        for mod_name, mod in self.module.named_modules():
            for bname, buf in list(mod._buffers.items()):
                if buf is not None:
                    yield (f"{mod_name}.{bname}" if mod_name else bname), mod, bname, buf

    def _place(self, name: str, owner: torch.nn.Module, bname: str, value: torch.Tensor) -> None:
        computed = self.inference and bname in owner._non_persistent_buffers_set
        cast = value.is_floating_point() and not computed
        work = value.to(device=self.device, dtype=self.dtype if cast else value.dtype)
        owner._buffers[bname] = work
        self._placed[name] = work

    def value(self, name: str, current: torch.Tensor) -> torch.Tensor:
        """What ``name`` holds for the outside world (a CPU tensor in its own dtype)."""
        placed = self._placed.get(name)
        # the same storage (state_dict() hands out detached views) still holding the rounded value:
        # kernels such as batch_norm update running statistics without bumping the version counter
        given = self._given.get(name)
        if (
            given is not None
            and placed is not None
            and current.data_ptr() == placed.data_ptr()
            and torch.equal(current.detach().cpu(), given.to(current.dtype))
        ):
            return given.clone()
        return current.detach().to("cpu", self.dtypes.get(name, current.dtype), copy=True)

    def give_back(self) -> None:
        """detach(): every buffer back in the module, on the CPU, as :meth:`value` says."""
        for name, owner, bname, buf in self._buffers():
            owner._buffers[bname] = self.value(name, buf)
