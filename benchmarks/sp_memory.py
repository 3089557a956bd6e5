"""Per-rank peak memory of one sequence-parallel (`--sp 2`) MTP training step against one process, target included.

Setup: a target at the embedded shape (6 layers, hidden 256, 4 heads / 2 kv heads × 64, MLP 768, vocab 8192, random
weights, fp32 on CPU), the MTP drafter on its last layer (D = 3 TTT depths, per-depth checkpointing, chunked LM head
and e2e TV: the trainer's defaults), one packed row of T tokens holding 4 documents (40/30/20/10 % of T; the second
crosses the middle, i.e. the boundary between the two ranks' shards). The measured step is what the trainer runs per
step, less the optimizer: the frozen target's features (`train.features.TargetFeatures`: taps and teacher logits),
the rollout, the loss and the backward.

  one process                 the trainer today without --sp: the target's own forward over the whole row
                              (`Decoder.forward` with document_ids: SDPA under a [1, 1, T, T] document gate)
  one process, tiled target   the same step with the target through `train.sequence_parallel.target_forward` at
                              size 1 (the tiled document-masked attention SP uses, no [T, T] gate): separates what
                              the attention kernel saves from what splitting the row saves
  sp=2, rank r                each of two gloo processes (torchrun, launched by this script) on its T/2 tokens:
                              target forward on the shard (Ulysses attention), the teacher's halo of D + 1 positions
                              from the next rank, the drafter step on the shard

Memory as in benchmarks/ttt_memory.py (`peak_bytes`: the CPU allocator's alloc / free events over the step, weights
and the packed row made before it excluded; the features are made inside the step and counted). Under SP a few of
the collectives' buffers (0.25-2 MiB each) are released on gloo's threads, depending on timing, and the profiler
records no free for those: they count as live to the end of the step. An SP rank's measured peak is therefore an
upper bound that varies by a few percent from step to step; each variant runs `--repeats` identical steps and the
smallest peak is reported (one process: the same every time). The loss shares of the SP ranks add up to the
one-process loss (printed, as a check that both ran the same step).

Run:  .venv/bin/python benchmarks/sp_memory.py --seq-len 4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import nullcontext

import torch
from ttt_memory import MiB, limit_heap_fragmentation, peak_bytes

from angelspec.data.packing import Doc, PackedBatch, pack_documents
from angelspec.models import Decoder, DecoderConfig
from angelspec.models.mtp import MTPConfig, MTPDraftModel, concat_taps
from angelspec.train.distributed import global_sum, init_distributed, shutdown
from angelspec.train.features import TargetFeatures
from angelspec.train.losses import LOSSES, LossConfig, global_denominators
from angelspec.train.sequence_parallel import NO_SP, SequenceParallel, init_sequence_parallel, target_forward
from angelspec.train.ttt import RolloutMemory, mtp_chunked_loss_batch, ttt_rollout

D = 3


class TiledTargetFeatures(TargetFeatures):
    """`TargetFeatures` whose one-process target forward is `target_forward` at size 1 (tiled attention)."""

    def __call__(self, batch: PackedBatch, rows: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        out = target_forward(NO_SP, self.target, batch, self.layer_ids)
        return list(out.hidden), self.target.lm_head(out.last_hidden).float()


def make_problem(T: int, seed: int = 1) -> tuple[Decoder, MTPDraftModel, PackedBatch]:
    """The target, its MTP drafter (same weights on every rank) and one packed row of T tokens (4 documents)."""
    cfg = DecoderConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=T,
                        tie_word_embeddings=True)
    target = Decoder(cfg)
    target.init_weights(generator=torch.Generator().manual_seed(seed))
    target.requires_grad_(False)
    model = MTPDraftModel(MTPConfig.for_target(cfg, num_depths=D), target.embed_tokens, target.lm_head)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    sizes = [int(T * f) for f in (0.4, 0.3, 0.2)]
    docs = [Doc(torch.randint(0, cfg.vocab_size, (n,), generator=g)) for n in (*sizes, T - sum(sizes))]
    return target, model, pack_documents(docs, T, pad_id=0)


def step_fn(target: Decoder, model: MTPDraftModel, packed: PackedBatch, sp: SequenceParallel,
            features_cls: type[TargetFeatures] = TargetFeatures, features_only: bool = False):
    """One training step (features, rollout, e2e TV, backward) -> this rank's loss share; `features_only`: the
    target's part alone (taps and teacher logits) -> 0."""
    features = features_cls(target, model.config.target_layer_ids, sp=sp, halo=D + 1)

    def run() -> float:
        taps, teacher = features(packed, [0])
        if features_only:
            return 0.0
        out = ttt_rollout(model, concat_taps(taps), packed.input_ids, packed.positions, packed.document_ids, D, sp=sp,
                          memory=RolloutMemory(keep_logits=False, checkpoint_depths=True))
        with global_denominators(global_sum) if sp.enabled else nullcontext():
            loss = LOSSES["e2e_tv"](mtp_chunked_loss_batch(model, out, packed, teacher, sp=sp), LossConfig()).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    return run


def least_of(repeats: int, fn) -> tuple[float, float]:
    """(the smallest peak of `repeats` runs of fn, each an upper bound of the true one; fn's last value)."""
    runs = [peak_bytes(fn) for _ in range(repeats)]
    return min(r[0] for r in runs), runs[-1][2]


def sp_rank(T: int, repeats: int) -> None:
    """One rank of the `--sp 2` launch: warm up, measure, print one JSON line."""
    info = init_distributed()
    sp = init_sequence_parallel(2, info, "ddp")
    step_fn(*make_problem(256), sp)()
    problem = make_problem(T)
    target_peak, _ = least_of(repeats, step_fn(*problem, sp, features_only=True))
    peak, share = least_of(repeats, step_fn(*problem, sp))
    total = float(global_sum(torch.tensor(share, dtype=torch.float64)))
    print(json.dumps({"rank": sp.rank, "peak": peak, "target": target_peak, "loss": total}), flush=True)
    shutdown(info)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="steps measured per variant (the smallest peak counts)")
    ap.add_argument("--sp-rank", action="store_true", help=argparse.SUPPRESS)  # set by the torchrun launch
    args = ap.parse_args()
    torch.set_num_threads(1)
    limit_heap_fragmentation()
    if args.sp_rank:
        sp_rank(args.seq_len, args.repeats)
        return
    T = args.seq_len
    for cls in (TargetFeatures, TiledTargetFeatures):  # warm-up at a small T (one-off allocations stay out)
        step_fn(*make_problem(256), NO_SP, cls)()
    peaks, targets = {}, {}
    print(f"T={T}; peak MiB of the whole step, and of its target part alone (taps + teacher logits)")
    for name, cls in (("one process", TargetFeatures), ("one process, tiled target", TiledTargetFeatures)):
        problem = make_problem(T)
        targets[name], _ = least_of(args.repeats, step_fn(*problem, NO_SP, cls, features_only=True))
        peaks[name], loss = least_of(args.repeats, step_fn(*problem, NO_SP, cls))
        print(f"{name:<28} step {peaks[name] / MiB:8.1f}  target {targets[name] / MiB:8.1f}  loss {loss:.6f}",
              flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(29500 + os.getpid() % 1000), __file__, "--sp-rank", "--seq-len", str(T),
           "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"the --sp 2 launch failed:\n{proc.stderr[-3000:]}")
    ranks = sorted((json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")), key=lambda r: r["rank"])
    for r in ranks:
        print(f"{'sp=2, rank ' + str(r['rank']):<28} step {r['peak'] / MiB:8.1f}  target {r['target'] / MiB:8.1f}  "
              f"loss {r['loss']:.6f} (all ranks)")
    worst, worst_target = max(r["peak"] for r in ranks), max(r["target"] for r in ranks)
    one, tiled = "one process", "one process, tiled target"
    print(f"\nT={T}: per-rank peak of an --sp 2 step / one process: {worst / peaks[one]:.2f}x "
          f"(/ one process with the tiled target: {worst / peaks[tiled]:.2f}x); its target part: "
          f"{worst_target / targets[one]:.2f}x ({worst_target / targets[tiled]:.2f}x)")


if __name__ == "__main__":
    main()
