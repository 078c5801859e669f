"""Integrations with training frameworks, each imported only when used (``import tiermem`` imports
none of them, nor the framework): ``tiermem.integrations.transformers`` for the Hugging Face Trainer."""
