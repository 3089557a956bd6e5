"""Peak memory of one block-drafter (DFly) training step, head and loss included, at several sequence lengths:
the mask-free linear path with and without per-layer activation checkpointing, and the dense-mask reference.

Setup: `models.block.presets.dfly_embedded` (L2-B8, hidden-correction and confidence heads, the embedded target's
shape: C=256, V=8192), random weights, one packed row of T tokens holding 4 documents, N = T/32 anchors (long rows
get more anchors, as the report's 64 per 3k-token row), random target taps and teacher logits made before the
measured region, fp32 on CPU. Each variant runs the trainer's step: backbone, head, the D-PACE LK objective plus the
confidence term, backward.

  linear          `forward_train(compute_logits=False)` (anchored tiled attention, no mask) +
                  `block_chunked_loss_batch` + `with_confidence_term`: what the trainer runs
  linear+ckpt     the same with `checkpoint_layers=True` (each draft layer recomputed in the backward)
  dense (legacy)  SDPA under the [R, 1, N·B, T + N·B] `training_mask`, whole [R·N, K, V] logits,
                  `block_loss_batch` + `confidence_loss` (only for T <= --legacy-max)

Memory is measured as in benchmarks/ttt_memory.py (`peak_bytes`: the CPU allocator's alloc/free events; on a GPU,
`--device cuda`, the CUDA allocator's peak).

Run:  .venv/bin/python benchmarks/block_memory.py --seq-len 4096 16384 [--device cuda]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from ttt_memory import MiB, limit_heap_fragmentation, peak_bytes

from angelspec.data.packing import Doc, pack_documents
from angelspec.models import DecoderConfig
from angelspec.models.block.drafter import BackboneOptions, BlockDrafter
from angelspec.models.block.presets import dfly_embedded
from angelspec.train.block import block_chunked_loss_batch, block_loss_batch, confidence_loss
from angelspec.train.confidence import confidence_targets
from angelspec.train.losses import LOSSES, LossConfig, with_confidence_term


def variants(T: int, legacy: bool, device: torch.device | str = "cpu") -> dict[str, Callable[[], float]]:
    """name -> one training step at T (returns the loss value); the model and inputs are made here, unmeasured, drawn
    on the host and moved to `device`."""
    tcfg = DecoderConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=T)
    g = torch.Generator().manual_seed(1)
    embed = torch.nn.Embedding(tcfg.vocab_size, tcfg.hidden_size)
    torch.nn.init.normal_(embed.weight, generator=g)
    head = torch.nn.Linear(tcfg.hidden_size, tcfg.vocab_size, bias=False)
    head.weight = embed.weight
    model = BlockDrafter(dfly_embedded(tcfg), embed, head)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    sizes = [int(T * f) for f in (0.4, 0.3, 0.2)]
    docs = [Doc(torch.randint(0, tcfg.vocab_size, (n,), generator=g)) for n in (*sizes, T - sum(sizes))]
    packed = pack_documents(docs, T, pad_id=0)
    N = max(1, T // 32)
    anchors = torch.randperm(T - 8, generator=g)[:N].sort().values[None]
    taps = torch.randn(1, T, 3 * tcfg.hidden_size, generator=g)
    teacher = torch.randn(1, T, tcfg.vocab_size, generator=g) * 3
    model, packed, anchors, taps, teacher = (x.to(device) for x in (model, packed, anchors, taps, teacher))
    config = LossConfig()
    objective = LOSSES["dpace_lk"]

    def targets(lb):  # the confidence head's targets, as the trainer computes them (per chunk on the linear path)
        return confidence_targets(model.config, lb.student_logits.detach(), lb.teacher_logits, lb.mask)

    def forward(**kw):
        return model.forward_train(taps, packed.input_ids, packed.positions, anchors,
                                   document_ids=packed.document_ids, loss_mask=packed.loss_mask, **kw)

    def linear(ckpt: bool) -> Callable[[], float]:
        def run() -> float:
            out = forward(compute_logits=False, backbone=BackboneOptions(checkpoint_layers=ckpt))
            clb = block_chunked_loss_batch(model, out, teacher, confidence_targets=targets)
            loss = with_confidence_term(objective, 1.0)(clb, config).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.item()
        return run

    def dense() -> float:
        lb = block_loss_batch(forward(backbone=BackboneOptions(attention="dense")), teacher, targets)
        loss = objective(lb, config).loss + confidence_loss(lb.confidence_logits, lb.confidence_targets, lb.mask,
                                                            lb.mask.sum())
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    out = {"linear": linear(False), "linear+ckpt": linear(True)}
    if legacy:
        out["dense (legacy)"] = dense
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, nargs="+", default=[1024])
    ap.add_argument("--legacy-max", type=int, default=4096, help="run the dense reference up to this T")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of a CPU run")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: on a GPU the peak is the CUDA allocator's")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    limit_heap_fragmentation()
    for step in variants(256, True, device).values():  # warm-up: one-off allocations stay out of the measured steps
        step()
    where = f"{args.threads} threads" if device.type == "cpu" else str(device)
    print(f"DFly (dfly_embedded: L2-B8, C=256, V=8192), N = T/32 anchors, fp32, {where}")
    print(f"{'T':>6} {'variant':<16} {'peak MiB':>10} {'KiB/token':>10} {'loss':>10} {'s':>7}")
    for T in args.seq_len:
        for name, step in variants(T, T <= args.legacy_max, device).items():
            peak, dt, value = peak_bytes(step, device)
            print(f"{T:>6} {name:<16} {peak / MiB:>10.1f} {peak / T / 1024:>10.1f} {value:>10.6f} {dt:>7.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
