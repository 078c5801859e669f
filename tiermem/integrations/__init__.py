"""Integrations with training frameworks, each imported only when used (``import tiermem`` imports
none of them, nor the framework): ``tiermem.integrations.transformers`` for the Hugging Face
Trainer (what its loop holds in place of the optimizer and the model:
``tiermem.integrations.hf_loop``)."""
