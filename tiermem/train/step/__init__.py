"""The optimizer step: grads leaving the device, the update, loss scaling, param groups, updates in backward."""
