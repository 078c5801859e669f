"""``tm.save_pretrained(directory)``: the weights in the ecosystem's format, streamed from their homes.

NOTE [Saving in the Hugging Face format]
The weights are read from their homes one tensor at a
time (:meth:`tiermem.train.state.ModelState.stream_weights`) and written as safetensors shards of
at most ``max_shard_size`` bytes each (one tensor larger than that gets a shard of its own), with
``model.safetensors.index.json`` when there is more than one shard, and the model's
``config.json`` (and ``generation_config.json``) when it is a transformers model, so that
``AutoModel*.from_pretrained(directory)`` and ``TieredModel(..., weights=directory)`` read it.
Host memory is one shard. A tied weight is written once, under the module's own name for it (the
first in ``named_parameters()``), as transformers writes it. Everything is written into a new
directory beside ``directory`` and moved in when complete: a save that fails leaves what was there;
a save over an earlier one removes that one's shards and index, and nothing else.

A peft model (``peft.get_peft_model(...)``) is saved as peft's own ``save_pretrained`` saves it:
its active adapter only, ``adapter_model.safetensors`` under peft's names (from
``peft.get_peft_model_state_dict``, given the trained values: the frozen base is never read) and
``adapter_config.json``, which ``PeftModel.from_pretrained(base, directory)`` loads.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator, Optional

import torch

from tiermem.budgets import parse_bytes
from tiermem.errors import ConfigError, StoreError
from tiermem.observe.progress import Progress

__all__ = ["save_pretrained"]

INDEX = "model.safetensors.index.json"
ADAPTER = "adapter_model.safetensors"


def _shards(tensors: Iterator[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``tensors`` grouped, in order, into lists of at most ``limit`` bytes (a larger tensor alone)."""
    shard: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > limit:
            yield shard
            shard, size = [], 0
        shard.append((name, t))
        size += nbytes
    if shard:
        yield shard


def _tensors(state: Any, dtype: Optional[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    for names, value in state.stream_weights():
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        yield names[0], value.contiguous()
    for name, value in state.buffer_values():
        yield name, value.contiguous()


def save_pretrained(
    state: Any,
    module: torch.nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "2GiB",
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write ``state``'s weights (fp32 masters, or ``dtype``) and buffers to ``directory`` as
    safetensors shards, with the config of a transformers ``module`` (NOTE [Saving in the Hugging
    Face format])."""
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    if _adapter(module) is not None:
        return _save_adapter(state, module, directory, dtype)
    limit = parse_bytes(max_shard_size, what="max_shard_size")
    if limit < 1:
        raise ConfigError(f"tiermem: max_shard_size={max_shard_size!r} is invalid: must be at least 1 byte")
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):
        raise ConfigError(f"tiermem: save_pretrained({directory!r}): {parent!r} does not exist; create it first")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"tiermem: save_pretrained({directory!r}): it is a file; pass a directory")
    work = os.path.join(parent, f".{os.path.basename(os.path.abspath(directory))}.tiermem-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)  # our own leftover of a save killed in this process's pid
    os.makedirs(work, mode=0o700)
    width = torch.finfo(dtype).bits // 8 if dtype is not None else 4
    progress = Progress(f"writing {directory}", sum(p.numel() * width for p in module.parameters()))
    try:
        weight_map, total, files = {}, 0, []
        for i, shard in enumerate(_shards(_tensors(state, dtype), limit)):
            file = f"part-{i:05d}.safetensors"
            save_file(dict(shard), os.path.join(work, file), metadata={"format": "pt"})
            files.append([name for name, _ in shard])
            nbytes = sum(t.numel() * t.element_size() for _, t in shard)
            total += nbytes
            progress.advance(nbytes)
        progress.close()
        names = _final_names(len(files))
        for i, (names_in, final) in enumerate(zip(files, names)):
            os.replace(os.path.join(work, f"part-{i:05d}.safetensors"), os.path.join(work, final))
            weight_map.update(dict.fromkeys(names_in, final))
        if len(names) > 1:
            with open(os.path.join(work, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        _save_config(module, work)
        _publish(work, directory)
    except OSError as e:
        raise StoreError(
            f"tiermem: save_pretrained({directory!r}) failed ({e}); nothing in {directory!r} changed: free space "
            f"or choose another directory, and save again"
        ) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _adapter(module: torch.nn.Module) -> Optional[str]:
    """The active adapter of a peft model; None for any other module."""
    if type(module).__module__.split(".")[0] != "peft" or not hasattr(module, "peft_config"):
        return None
    active = getattr(module, "active_adapter", None)
    return active if isinstance(active, str) else None


def _save_adapter(state: Any, module: torch.nn.Module, directory: str, dtype: Optional[torch.dtype]) -> None:
    """peft's ``adapter_model.safetensors`` and ``adapter_config.json`` of the active adapter, from
    the trained values alone (NOTE [Saving in the Hugging Face format])."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter = _adapter(module)
    assert adapter is not None
    trained = {names[0]: value for names, value in state.stream_weights(frozen=False)}
    if dtype is not None:
        trained = {k: v.to(dtype) if v.is_floating_point() else v for k, v in trained.items()}
    values = get_peft_model_state_dict(module, state_dict=trained, adapter_name=adapter)
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):
        raise ConfigError(f"tiermem: save_pretrained({directory!r}): {parent!r} does not exist; create it first")
    work = os.path.join(parent, f".{os.path.basename(os.path.abspath(directory))}.tiermem-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, mode=0o700)
    try:
        save_file(
            {k: v.contiguous() for k, v in values.items()}, os.path.join(work, ADAPTER), metadata={"format": "pt"}
        )
        peft_model: Any = module  # peft is not typed here
        peft_model.peft_config[adapter].save_pretrained(work)
        _publish(work, directory, replaces_shards=False)
    except OSError as e:
        raise StoreError(
            f"tiermem: save_pretrained({directory!r}) failed ({e}); nothing in {directory!r} changed: free space "
            f"or choose another directory, and save again"
        ) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _final_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _save_config(module: torch.nn.Module, work: str) -> None:
    """A transformers model's config (and generation config) beside its weights."""
    for attr in ("config", "generation_config"):
        config = getattr(module, attr, None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(work)


def _publish(work: str, directory: str, *, replaces_shards: bool = True) -> None:
    """Move what ``work`` holds into ``directory``: a new directory is renamed into place; into an
    existing one the files are moved one by one, and (``replaces_shards``) an earlier save's shards
    and index removed."""
    if not os.path.exists(directory):
        os.rename(work, directory)
        return
    new = set(os.listdir(work))
    for name in sorted(new):
        os.replace(os.path.join(work, name), os.path.join(directory, name))
    for name in os.listdir(directory) if replaces_shards else ():  # the earlier save's files not replaced
        if name not in new and (name == INDEX or (name.startswith("model") and name.endswith(".safetensors"))):
            os.remove(os.path.join(directory, name))
