"""A small decoder-only GPT (nanoGPT-style) and a character tokenizer, for the examples and benchmarks.

The output head shares its weight with the token embedding (GPT's tied weights), so a wrapper
that manages parameters must see one parameter under two names: ``wte.weight`` and ``head.weight``.

    from examples.gpt import GPT, GPTConfig, CharTokenizer, lm_loss
    tok = CharTokenizer(text)
    model = GPT(GPTConfig.preset("small", vocab_size=tok.vocab_size))
    loss = lm_loss(model(x), y)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``GPTConfig.preset(name, **overrides)`` gives the sizes the repo uses."""

    vocab_size: int = 96  # set from the tokenizer; 96 covers printable ASCII plus newline
    block_size: int = 128  # longest context; position embeddings are learned for exactly this many
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    # 0 by default: the corpus is small but the runs are short, so the model never gets to
    # overfit, and without dropout two runs from one seed differ only if the optimizer differs.
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dropout":
                if not 0.0 <= value < 1.0:
                    raise ValueError(f"GPTConfig.dropout={value}: must be in [0, 1)")
            elif f.name != "bias" and value < 1:
                raise ValueError(f"GPTConfig.{f.name}={value}: must be >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not a multiple of n_head={self.n_head}; "
                "pick sizes where n_embd / n_head is a whole head dimension"
            )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> "GPTConfig":
        """One of ``PRESETS`` (``tiny``, ``small``, ``gpt50m``), with fields overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


def add_model_args(
    p,
    *,
    preset: str = "gpt50m",
    n_layer: int | None = None,
    n_embd: int | None = None,
    batch_size: int = 4,
    seq_len: int = 256,
    batch_help: str | None = None,
) -> None:
    """The model and batch options the benchmarks share (read back by :func:`config_from_args`)."""
    p.add_argument("--preset", choices=sorted(PRESETS), default=preset)
    p.add_argument("--n-layer", type=int, default=n_layer, help="override the preset's depth")
    p.add_argument("--n-embd", type=int, default=n_embd, help="override the preset's width (heads of 64)")
    p.add_argument("--vocab-size", type=int, default=96, help="tokens are random ids below this")
    p.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    p.add_argument("--seq-len", type=int, default=seq_len)


def config_from_args(args) -> GPTConfig:
    """A preset sized by a benchmark's command line: ``args.preset``, ``vocab_size``, ``seq_len``
    and, when given, ``n_layer`` and ``n_embd`` (heads of 64)."""
    over: dict[str, int] = {"vocab_size": args.vocab_size, "block_size": args.seq_len}
    if args.n_layer is not None:
        over["n_layer"] = args.n_layer
    if args.n_embd is not None:
        over.update(n_embd=args.n_embd, n_head=max(1, args.n_embd // 64))
    return GPTConfig.preset(args.preset, **over)


PRESETS: dict[str, GPTConfig] = {
    # Tests: ~0.1M parameters, a step takes milliseconds.
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),
    # The example's default: ~0.8M parameters, learns visible structure on a 2-core CPU in minutes.
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    # bench/step.py: ~50M parameters (12 * n_layer * n_embd^2 in the blocks), head dimension 64.
    "gpt50m": GPTConfig(block_size=256, n_layer=10, n_head=10, n_embd=640),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, 3c) -> three tensors of (b, heads, t, head_dim)
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx)`` maps token ids (b, t) to logits (b, t, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, two names
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # Linear and Embedding weights; LayerNorm weights keep their ones
                std = 0.02
                if name.endswith("proj.weight"):
                    # GPT-2: the last layer of each residual branch shrinks by 1/sqrt(number of branches)
                    std /= math.sqrt(2 * self.cfg.n_layer)
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(
                f"GPT: sequence of {t} tokens is longer than block_size={self.cfg.block_size}; "
                "crop the input or build the model with a larger block_size"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        """Distinct parameters (the tied head weight counted once)."""
        return sum(p.numel() for p in self.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class CharTokenizer:
    """One token per distinct character of the text it was built from."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = set(text) - self.index.keys()
        if unknown:
            raise ValueError(
                f"CharTokenizer: characters {sorted(unknown)!r} are not in the vocabulary "
                f"of {self.vocab_size}; build the tokenizer from text that contains them"
            )
        return torch.tensor([self.index[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_corpus(data_dir: Path = DATA_DIR) -> str:
    """The text shipped in ``examples/data`` (every ``*.txt``, in name order, joined)."""
    files = sorted(Path(data_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt files under {data_dir}; the corpus ships in examples/data")
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def load_tokens(data_dir: Path = DATA_DIR) -> tuple["CharTokenizer", torch.Tensor]:
    """The shipped corpus as a tokenizer built from it and the token ids of the whole text."""
    text = load_corpus(data_dir)
    tok = CharTokenizer(text)
    return tok, tok.encode(text)


@torch.no_grad()
def generate(
    forward: Callable[[torch.Tensor], torch.Tensor],
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    block_size: int,
    temperature: float = 0.8,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after ``idx`` (b, t). ``forward`` is the model or its wrapper."""
    for _ in range(max_new_tokens):
        logits = forward(idx[:, -block_size:])[:, -1, :].float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
