"""The reader of a DeepSpeed config: the JSON file or dict, and :class:`Reader`, which every
mapping (:mod:`tiermem.integrations.deepspeed.optimizer_block`, :mod:`tiermem.integrations.deepspeed.zero_block`,
:mod:`tiermem.integrations.deepspeed.walk`) asks for values (the config's, or a keyword's for ``"auto"``)
and tells what it does not honour (NOTE [DeepSpeed config] in :mod:`tiermem.integrations.deepspeed.walk`)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from tiermem.errors import ConfigError

__all__ = ["ABSENT", "NO_SUCH_SETTING", "Reader", "block", "read_config", "short"]

#: a key the config leaves out (and a keyword not given)
ABSENT = object()

#: why a key is not honoured, when tiermem has nothing like it
NO_SUCH_SETTING = "tiermem has no such setting"


class Reader:
    """Walks one config, collecting TieredModel options and one note per key not honoured."""

    def __init__(self, overrides: Mapping[str, Any]):
        self.overrides = dict(overrides)
        self.notes: list[str] = []

    def note(self, where: str, value: Any, why: str) -> None:
        self.notes.append(f"tiermem: DeepSpeed config {where}={short(value)} not honoured: {why}")

    def deprecated(self, where: str, value: Any, read_as: str) -> None:
        """A key DeepSpeed still reads but calls deprecated: read as DeepSpeed reads it, and said so
        (as DeepSpeed's own warning does)."""
        self.notes.append(
            f"tiermem: DeepSpeed config {where}={short(value)} is deprecated (DeepSpeed warns too); "
            f"read as {read_as}: write that instead"
        )

    def take(self, where: str, value: Any, name: str, *, default: Any = ABSENT, norm=lambda v: v) -> Any:
        """The value of ``where``: the config's, or keyword ``name``'s where the config says "auto"
        or nothing; a keyword that disagrees with the config is an error."""
        given = self.overrides.get(name, ABSENT)
        given = given if given is ABSENT else norm(given)
        if value == "auto":
            if given is ABSENT:
                raise ConfigError(
                    f"tiermem: DeepSpeed config {where}='auto' needs a value: pass {name}=... "
                    f"(the HF Trainer fills it from TrainingArguments) or write it in the config"
                )
            return given
        if value is ABSENT:
            return default if given is ABSENT else given
        value = norm(value)
        if given is not ABSENT and given != value:
            raise ConfigError(
                f"tiermem: DeepSpeed config {where}={short(value)} but {name}={given!r} was given; "
                f"make them agree, or write 'auto' in the config to take {name}"
            )
        return value


def short(value: Any) -> str:
    """``value`` as the config writes it, cut to 60 characters for a message."""
    text = json.dumps(value) if isinstance(value, (dict, list, str, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def block(cfg: Mapping, key: str, where: str) -> dict:
    """The object at ``cfg[key]`` (empty when absent); ``where``: the path to ``cfg``, for the error."""
    value = cfg.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(
            f"tiermem: DeepSpeed config {where}{key}={short(value)} is not an object; write it as "
            f'{{"...": ...}} or leave it out'
        )
    return value


def read_config(config: Any) -> dict:
    """A DeepSpeed config as a dict: from a JSON file, or a deep copy of the dict given."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))  # a deep copy, and a check that it is JSON
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"tiermem: from_deepspeed_config needs a path to a DeepSpeed JSON file or a dict, got "
            f"{type(config).__name__}"
        )
    try:
        with open(config) as f:
            cfg = json.load(f)
    except OSError as e:
        raise ConfigError(
            f"tiermem: cannot read the DeepSpeed config {str(config)!r}: {e.strerror}; "
            f"pass the path of an existing JSON file"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"tiermem: the DeepSpeed config {str(config)!r} is not valid JSON (line {e.lineno}, "
            f"column {e.colno}: {e.msg}); fix the file"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"tiermem: the DeepSpeed config {str(config)!r} is not a JSON object; it must be {{...}}")
    return cfg
