"""Configuration: optimizer specs and their param groups, torch optimizers read as specs, the generic path's optimizers, hyperparameter rules, precisions and byte budgets."""
