"""Drop-in torch.optim optimizers for CPU parameters, on tiermem's fused kernels."""
