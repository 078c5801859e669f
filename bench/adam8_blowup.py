"""The 8-bit Adam blow-up of NOTE [8-bit moment bound] (tiermem/optim/kernels/quant.py), side by side:
tiermem's CPUAdam8bit, torchao's AdamW8bit (where torchao is importable; it is not a dependency, so
run with it on PYTHONPATH, e.g. ``pip install --target /tmp/torchao_pkg --no-deps torchao``), and
torch's exact AdamW, on the gradient sequence that triggers it: in one block of 256, a gradient of 1
and one of 1e-4 (whose v quantizes to 0 while its m does not), then zero gradients.

Prints, per step, the largest |weight change| / lr of each, and exact Adam's bound on it at that step
(sqrt(K_t) * sqrt(1 - beta2^t) / (1 - beta1^t), eps = 0). A ratio far above the bound is the blow-up.

    PYTHONPATH=. python bench/adam8_blowup.py
    PYTHONPATH=.:/tmp/torchao_pkg python bench/adam8_blowup.py
"""

from __future__ import annotations

import math

import torch

from tiermem.optim import CPUAdam8bit

LR, BETAS, EPS, N, STEPS = 1e-3, (0.9, 0.999), 1e-8, 4096, 6


def grads() -> list[torch.Tensor]:
    g = torch.zeros(N)
    g[0], g[1] = 1.0, 1e-4
    return [g] + [torch.zeros(N) for _ in range(STEPS - 1)]


def bound(t: int) -> float:
    b1, b2 = BETAS
    gamma = b1 * b1 / b2
    k = (1 - b1) ** 2 / (1 - b2) * sum(gamma**j for j in range(t))
    return math.sqrt(k) * math.sqrt(1 - b2**t) / (1 - b1**t)


def trace(make) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(N))
    opt = make([p])
    out = []
    for g in grads():
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        out.append(float((p.detach() - before).abs().max()) / LR)
    return out


def main() -> None:
    rows = {
        "exact Adam bound": [bound(t) for t in range(1, STEPS + 1)],
        "torch AdamW (fp32)": trace(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)),
        "tiermem CPUAdam8bit": trace(lambda ps: CPUAdam8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)),
    }
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        print(f"torchao: not importable here ({e}); put it on PYTHONPATH to compare")
    else:
        rows["torchao AdamW8bit"] = trace(lambda ps: AdamW8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0))
    print("max |dw| / lr per step")
    print(f"{'':24s}" + "".join(f"{t:>10d}" for t in range(1, STEPS + 1)))
    for name, values in rows.items():
        print(f"{name:24s}" + "".join(f"{v:10.3g}" for v in values))


if __name__ == "__main__":
    main()
