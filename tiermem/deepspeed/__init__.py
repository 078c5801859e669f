"""A DeepSpeed config read as TieredModel options, in three parts: :mod:`~tiermem.deepspeed.reader`
(the JSON or dict, and the reader every mapping writes its values and notes through),
:mod:`~tiermem.deepspeed.optimizer` (the ``optimizer`` block as a tiermem spec) and
:mod:`~tiermem.deepspeed.placement` (``zero_optimization``'s offload settings as a policy).
:mod:`tiermem.deepspeed_config` walks a whole config with them (NOTE [DeepSpeed config])."""
