"""A DeepSpeed config read as TieredModel options, in three parts: :mod:`~tiermem.integrations.deepspeed.reader`
(the JSON or dict, and the reader every mapping writes its values and notes through),
:mod:`~tiermem.integrations.deepspeed.optimizer_block` (the ``optimizer`` block as a tiermem spec) and
:mod:`~tiermem.integrations.deepspeed.zero_block` (``zero_optimization``'s offload settings as a policy).
:mod:`tiermem.integrations.deepspeed.walk` walks a whole config with them (NOTE [DeepSpeed config])."""
