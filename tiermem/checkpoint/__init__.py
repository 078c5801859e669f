"""Checkpoints: the model's state as a checkpoint sees it, tiermem's own files, DCP directories, users' weight files and save_pretrained."""
