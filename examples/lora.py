"""LoRA with its base weights on NVMe: a tiny Llama, peft's adapters, tiermem's ZeroInfinity.

    python examples/lora.py                     # ~1 min on a CPU; --steps, --nvme-dir, --precision

A Llama built from a config (nothing is downloaded; a character vocabulary from the text in
``examples/data``) gets peft LoRA adapters on its attention projections and on its token embedding
(``lora.Embedding`` reads ``lora_embedding_A[name].T`` of a ParameterDict: a weight read by code
that is not its own module's). The frozen base weights, and every weight but the adapters', live on
NVMe (ZeroInfinity) and come to the device only while something computes with them; gradient
checkpointing recomputes the layers in backward (non-reentrant, transformers' default). The base is
random, so the adapters learn what they can; the loss falls all the same. At the end the model is
detached, the adapters are merged into the base (``merge_and_unload``) and the plain model writes a
sample. Needs the ``hf`` extra and peft: ``pip install -e '.[hf]' peft``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/lora.py` from anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import peft
import transformers

from examples.gpt import load_tokens
from tiermem import AdamW, TieredModel
from tiermem.policies import ZeroInfinity


def build(vocab: int, seq: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "embed_tokens"])
    model = peft.get_peft_model(model, lora)
    kw = {"use_reentrant": False}  # transformers' default mode, spelled out
    if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--nvme-dir", default=None, help="where the weights live (default: a temporary directory)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    tok, data = load_tokens()
    model = build(tok.vocab_size, a.seq_len)
    trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
    total = sum(q.numel() for q in model.parameters())
    print(f"tiny Llama + LoRA: {total:,} parameters, {trainable:,} trainable (the adapters)")
    tmp = tempfile.TemporaryDirectory() if a.nvme_dir is None else None
    nvme_dir = a.nvme_dir or tmp.name
    tm = TieredModel(
        model,
        ZeroInfinity(),
        optimizer=AdamW(lr=3e-3, weight_decay=0.0),
        precision=a.precision,
        grad_clip=1.0,
        nvme_dir=nvme_dir,
    )
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        starts = torch.randint(0, len(data) - a.seq_len - 1, (a.batch_size,), generator=g)
        ids = torch.stack([data[s : s + a.seq_len] for s in starts.tolist()])
        out = tm(input_ids=ids, labels=ids)
        tm.backward(out.loss)
        res = tm.step()
        if step == 1 or step % max(1, a.steps // 6) == 0 or step == a.steps:
            print(
                f"step {step:4d}  loss {out.loss.item():.3f}  grad norm {res.grad_norm:.3f}"
                + ("  (skipped)" if res.skipped else ""),
                flush=True,
            )
    seconds = time.perf_counter() - t0
    print(f"{a.steps} steps in {seconds:.1f} s ({seconds / a.steps * 1e3:.0f} ms/step)")
    print(tm.report())
    merged = tm.detach().merge_and_unload()  # a plain transformers model: the adapters folded into its weights
    merged.eval()
    prompt = data[:16].unsqueeze(0)
    with torch.no_grad():
        sample = merged.generate(prompt, max_new_tokens=48, do_sample=False, pad_token_id=0)
    print("sample:", repr(tok.decode(sample[0].tolist())))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
