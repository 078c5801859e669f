"""What several bench scripts share: the GPT benches' optimizer settings and the two trainers built
with them (tiermem's and the plain torch anchor's), a device sync, a free port for gloo ranks,
parameter counts, target verdicts, fresh processes, seeded token batches, and the resident set."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import torch

from examples.gpt import lm_loss
from tiermem import AdamW, Report, Tier, TieredModel

# The GPT benches' AdamW, and the global-norm clip both sides apply (step, ddp, zero3, auto, split_step,
# gpu_check): tiermem and its anchor are given the same numbers from here.
LR, BETAS, WD, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0


# The data-parallel GPT (10.7M parameters) that ddp.py, zero3.py and zero3_memory.py compare on, for
# examples.gpt.add_model_args: the anchors' figures in RESULTS.md were taken at this size.
DATA_PARALLEL_GPT: dict[str, Any] = dict(preset="small", n_layer=6, n_embd=384, batch_size=16, seq_len=128)


def tiered(model: torch.nn.Module, policy: Any, *, precision: str = "bf16", **kwargs: Any) -> TieredModel:
    """``model`` under ``policy`` in a TieredModel with tiermem's AdamW at :data:`LR`, :data:`BETAS`,
    :data:`WD`, clipped at :data:`CLIP`, in ``precision``; ``kwargs`` go to TieredModel as they
    are (device, bucket_size, budgets, ...)."""
    return TieredModel(
        model,
        policy,
        optimizer=AdamW(lr=LR, betas=BETAS, weight_decay=WD),
        precision=precision,
        grad_clip=CLIP,
        **kwargs,
    )


def torch_adamw(params: Iterable[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """The plain-torch anchor's optimizer: ``torch.optim.AdamW`` at :data:`LR`, :data:`BETAS`,
    :data:`WD`; ``kwargs`` pick its implementation (``fused=True``, ``foreach=True``)."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, **kwargs)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a timer stops after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class IterationSeconds(NamedTuple):
    """One training iteration's seconds, the device synchronized at each boundary."""

    forward_backward: float
    step: float
    whole: float


def timed_iteration(tm: TieredModel, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> IterationSeconds:
    """One GPT iteration of ``tm`` on tokens ``x`` and targets ``y``: forward and backward, then
    ``tm.step()``, each timed to the end of its device work."""
    sync(device)
    t0 = time.perf_counter()
    tm.backward(lm_loss(tm(x), y))
    sync(device)
    t1 = time.perf_counter()
    tm.step()
    sync(device)
    t2 = time.perf_counter()
    return IterationSeconds(t1 - t0, t2 - t1, t2 - t0)


def llama_config(
    *, hidden: int, layers: int, intermediate: int, heads: int, vocab: int, kv_heads: int | None = None, **extra: Any
) -> Any:
    """A transformers ``LlamaConfig`` of this shape with untied embeddings (``kv_heads`` defaults
    to ``heads``: no grouped-query attention); ``extra`` are further LlamaConfig fields
    (``max_position_embeddings``, ``use_cache``)."""
    from transformers import LlamaConfig  # only the Llama benches need transformers

    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=False,
        **extra,
    )


LLAMA_13B = dict(hidden=5120, layers=40, intermediate=13824, heads=40, vocab=32000)  # Llama-2-13B's shape


def add_llama_shape(p: argparse.ArgumentParser, shape: dict[str, int] = LLAMA_13B) -> None:
    """``--hidden --layers --intermediate --heads --vocab``, defaulting to ``shape``."""
    for name, default in shape.items():
        p.add_argument(f"--{name}", type=int, default=default)


def meta_llama(args: argparse.Namespace, positions: int) -> torch.nn.Module:
    """A transformers ``LlamaForCausalLM`` of ``args``' shape (:func:`add_llama_shape`) on the meta
    device, with ``positions`` positions."""
    from transformers import LlamaForCausalLM

    config = llama_config(
        hidden=args.hidden,
        layers=args.layers,
        intermediate=args.intermediate,
        heads=args.heads,
        vocab=args.vocab,
        max_position_embeddings=positions,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def interleaved_times(
    fns: dict[str, Callable[[], None]], repeat: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, list[float]]:
    """Each of ``fns`` called once untimed (page faults, lazy state, builds, thread pools), then
    ``repeat`` rounds that call every one once in turn, so drift and other work on the machine hit
    them alike; the ``clock`` seconds of each call, by name."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            times[k].append(clock() - t0)
    return times


def fastest_of(
    fns: dict[str, Callable[[], None]], repeat: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """The fastest of each one's :func:`interleaved_times`."""
    return {k: min(t, default=float("inf")) for k, t in interleaved_times(fns, repeat, clock).items()}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the gloo ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def at_most(ratio: float, limit: float) -> str:
    """The verdict on a ratio whose target is ``limit`` or less: ``target <= 1.10x: met``."""
    return f"target <= {limit:.2f}x: {'met' if ratio <= limit else 'NOT met'}"


def at_least(ratio: float, limit: float) -> str:
    """The verdict on a ratio whose target is ``limit`` or more: ``target >= 0.90x: met``."""
    return f"target >= {limit:.2f}x: {'met' if ratio >= limit else 'NOT met'}"


def counts(text: str) -> list[int]:
    """``--batches 1,16``: a comma-separated list of counts."""
    return [int(x) for x in text.split(",")]


def token_prompts(vocab: int, batch: int, length: int) -> dict[str, torch.Tensor]:
    """``generate``'s inputs: ``batch`` prompts of ``length`` random token ids (seed 0; ids 0..2, pad,
    bos and eos, left out), no padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def cpu_seconds() -> float:
    """The process's CPU time so far, every thread, user and system."""
    t = os.times()
    return t.user + t.system


def run_again(script: str, argv: list[str], what: str, *, keep_stderr: bool = False) -> dict:
    """``script`` (a bench script's ``__file__``) run again with ``argv`` in a fresh process; its last
    output line is the JSON result. Its stderr goes to ours, or with ``keep_stderr`` is held and its
    tail shown if the run fails."""
    res = subprocess.run(
        [sys.executable, str(Path(script).resolve()), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if keep_stderr else None,
        text=True,
    )
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        tail = f":\n{res.stderr[-2000:]}" if keep_stderr else ""
        raise RuntimeError(f"bench/{Path(script).name}: the run of {what} exited {res.returncode}{tail}")
    return json.loads(lines[-1])


def token_batches(
    vocab: int, batch: int, seq_len: int, n: int, *, device: str | torch.device = "cpu", rank: int = 0, world: int = 1
) -> list[torch.Tensor]:
    """``n`` random batches of ``batch`` x ``seq_len + 1`` token ids below ``vocab``, the same ones in
    every process (seed 0); with ``world`` ranks, every rank draws the global batches and keeps its
    ``rank``-th share of the rows. Each on ``device``."""
    gen = torch.Generator().manual_seed(0)
    share = batch // world
    return [
        torch.randint(vocab, (batch, seq_len + 1), generator=gen)[rank * share :][:share].to(device) for _ in range(n)
    ]


def peak_rss() -> int:
    """The process's peak resident set so far, in bytes (``ru_maxrss``, which Linux gives in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_gb() -> float:
    """:func:`peak_rss` in GB (10^9 bytes)."""
    return peak_rss() / 1e9


def du_bytes(path: str) -> int:
    """The bytes ``path`` takes on disk (``du``: blocks allocated, holes not counted)."""
    out = subprocess.run(["du", "-s", "--block-size=1", path], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def nvme_bytes(rep: Report) -> tuple[int, int]:
    """(bytes read from NVMe, bytes written to NVMe) so far, from a :class:`~tiermem.Report`."""
    read = sum(n for (src, dst), n in rep.bytes_moved.items() if src is Tier.NVME and dst is not Tier.NVME)
    written = sum(n for (src, dst), n in rep.bytes_moved.items() if dst is Tier.NVME and src is not Tier.NVME)
    return read, written


class RssSampler:
    """The resident set's peak, sampled from ``/proc/self/statm`` every ``interval`` seconds by a
    daemon thread. ``ru_maxrss`` (:func:`peak_rss`) is the kernel's high-water mark, which Linux
    updates only when memory is unmapped: pages glibc hands back with ``madvise`` leave it behind,
    so it can miss a peak by gigabytes (seen on bench/largest_llama.py: 7.1 GB against 11.1 GB
    sampled). Start with ``with RssSampler() as rss:``; ``rss.peak`` (bytes) since the last
    ``rss.reset()``."""

    def __init__(self, interval: float = 0.02):
        import os
        import threading

        self.interval, self.peak = interval, 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.now())

    def reset(self) -> int:
        """The peak so far (bytes), then start again from the resident set now."""
        peak, self.peak = max(self.peak, self.now()), self.now()
        return peak

    def __enter__(self) -> "RssSampler":
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
