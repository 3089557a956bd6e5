"""Peak memory of the D=3 TTT rollout vs one causal pass of the MTP draft model (report §2.2 / §6.1 claim:
"close to a single causal pass"; our goal ≤ 1.3×).

Setup: the embedded target's shape (hidden 256, 4 heads / 2 kv heads × 64, MLP 768, vocab 8192), random
weights, one packed row of T=1024 tokens holding 4 documents, fp32 on CPU. Each variant runs a full training
step's autograd work — forward, LM head, CE over the valid depth-shifted labels, backward — and, separately,
the forward alone under no_grad:

  causal-sdpa   `MTPDraftModel.forward`: one causal pass, SDPA with the [B, 1, T, T] document gate (what the
                base MTP trains with), head + CE on depth 0
  ttt D=1       `ttt_rollout(num_depths=1)`: the fast path's attention code at depth 0 only
  ttt D=3 fast  `ttt_rollout(num_depths=3)`: prefix matmul + masked LSE + diagonal keys, merged by LSE
  ttt D=3 fast+ckpt  the same with per-depth activation checkpointing (`checkpoint_depths=True`)
  ttt D=3 ref   the explicit (D·T)×(D·T) mask reference

Two loss settings: "rollout only" (loss = mean of the h^(k) squared; isolates the rollout's activations and
attention from the LM head) and "with LM head + CE" (a real step: the D×T×V logits and CE buffers enter).

How memory is measured: `torch.profiler` with `profile_memory=True`; `export_memory_timeline(...json,
device="cpu")` gives the bytes of live tensors (categorised from the allocator's alloc/free events) at every
allocation event. We report max over time of the total minus its value at the start of the profiled region,
i.e. the peak of tensors allocated by the step (weights and inputs created before it are excluded). This is
the CPU allocator's view of tensor storage, not RSS: it excludes allocator slack and oneDNN scratch outside
tensors.

Run:  .venv/bin/python benchmarks/ttt_memory.py [--seq-len 1024] [--depths 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from angelspec.data.packing import Doc, mtp_labels, pack_documents
from angelspec.models import DecoderConfig
from angelspec.models.mtp import MTPConfig, MTPDraftModel
from angelspec.train.ttt import depth0_inputs, ttt_rollout

MiB = 2**20


def peak_bytes(fn: Callable[[], None]) -> tuple[float, float]:
    """-> (peak bytes of tensors allocated inside fn, seconds)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)  # sizes: per event, bytes per category
    finally:
        os.unlink(path)
    totals = [sum(s) for s in sizes]
    return (max(totals) - totals[0]) if totals else 0.0, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    T, D = args.seq_len, args.depths

    tcfg = DecoderConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=T)
    # Only the target's (tied) embedding and head enter the model; taps are random, so no target is built.
    embed = torch.nn.Embedding(tcfg.vocab_size, tcfg.hidden_size)
    head = torch.nn.Linear(tcfg.hidden_size, tcfg.vocab_size, bias=False)
    head.weight = embed.weight
    model = MTPDraftModel(MTPConfig.for_target(tcfg, num_depths=D), embed, head)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    docs = [Doc(torch.randint(0, tcfg.vocab_size, (n,), generator=g)) for n in (400, 300, 200, 124)]
    packed = pack_documents(docs, T, pad_id=0)
    ids, pos, doc = packed.input_ids, packed.positions, packed.document_ids
    hidden = torch.randn(1, T, tcfg.hidden_size, generator=g)
    # Depth-shifted labels and the depth-shift gate, depth k at i -> x_{i+k+2} (data.packing.mtp_labels).
    gated = [mtp_labels(packed, k) for k in range(D)]
    labels_all = torch.stack([lab.clamp_min(0) for lab, _ in gated], dim=-1)  # [1, T, D]
    valid_all = torch.stack([val for _, val in gated], dim=-1)  # [1, T, D]

    def causal_step(train: bool, head: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(train):
                h = model(hidden, depth0_inputs(ids, doc, 0), pos, doc)
                m = valid_all[..., 0]
                loss = F.cross_entropy(model.logits(h)[m], labels_all[..., 0][m]) if head else h.square().mean()
                if train:
                    loss.backward()
        return run

    def ttt_step(depths: int, attention: str, train: bool, head: bool, ckpt: bool = False) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(train):
                out = ttt_rollout(model, hidden, ids, pos, doc, depths, attention=attention,  # type: ignore[arg-type]
                                  keep_logits=head, checkpoint_depths=ckpt)
                if head:
                    assert out.logits is not None
                    m = valid_all[..., :depths]
                    loss = F.cross_entropy(out.logits[m], labels_all[..., :depths][m])
                else:
                    loss = out.hidden.square().mean()
                if train:
                    loss.backward()
        return run

    print(f"MTP draft model at the embedded shape, T={T}, D={D}, fp32, {args.threads} threads")
    for head in (False, True):
        print("\n" + ("with LM head + CE over the valid (position, depth) rows of every depth" if head else
                      "rollout only: loss = mean(h^(k)^2) over depths (logits only for the argmax, no grad)"))
        variants = [("causal-sdpa (D=1)", lambda tr, h=head: causal_step(tr, h)),
                    ("ttt D=1 fast", lambda tr, h=head: ttt_step(1, "fast", tr, h)),
                    (f"ttt D={D} fast", lambda tr, h=head: ttt_step(D, "fast", tr, h)),
                    (f"ttt D={D} fast+ckpt", lambda tr, h=head: ttt_step(D, "fast", tr, h, True)),
                    (f"ttt D={D} reference", lambda tr, h=head: ttt_step(D, "reference", tr, h))]
        print(f"{'variant':<22} {'train peak MiB':>15} {'s':>6} {'no-grad peak MiB':>17} {'s':>6}")
        results = {}
        for name, make in variants:
            make(True)()  # warm-up (oneDNN primitives, RoPE tables) outside the measured region
            model.zero_grad(set_to_none=True)
            tr, tr_s = peak_bytes(make(True))
            model.zero_grad(set_to_none=True)
            ng, ng_s = peak_bytes(make(False))
            results[name] = (tr, ng)
            print(f"{name:<22} {tr / MiB:>15.1f} {tr_s:>6.2f} {ng / MiB:>17.1f} {ng_s:>6.2f}")
        base_tr, base_ng = results["causal-sdpa (D=1)"]
        for label in (f"ttt D={D} fast", f"ttt D={D} fast+ckpt", f"ttt D={D} reference"):
            tr, ng = results[label]
            print(f"ratio {label} / one causal pass: train {tr / base_tr:.2f}x, no-grad {ng / base_ng:.2f}x"
                  + (" (goal <= 1.3x)" if "fast" in label else ""))
    logits_mib = T * tcfg.vocab_size * 4 / MiB
    print(f"for scale: one depth's fp32 logits [T, V] = {logits_mib:.0f} MiB; fp32 scores [H, T, T] = "
          f"{tcfg.num_attention_heads * T * T * 4 / MiB:.0f} MiB")


if __name__ == "__main__":
    main()
