"""Homes: where each class of a bucket's training state lives (host, NVMe, a rank's shard), and how new weights reach theirs."""
