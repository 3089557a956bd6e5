"""Speculative decoding vs peers at T=0, batch 1: our engine with the n-gram and draft-LM drafters vs HF
transformers' prompt lookup (`prompt_lookup_num_tokens=`) and assisted generation (`assistant_model=`,
the same draft LM), each measured against its own AR decoding in the same run. Prints speed-ups, the
wall-clock ratio ours/theirs for the same drafter (goal: >= 1.5x HF's), our MAL, and whether our
speculative outputs equal our AR outputs token for token (they must at T=0, up to fp ties).

    .venv/bin/python benchmarks/spec_vs_peers.py                    # default target, fp32
    .venv/bin/python benchmarks/spec_vs_peers.py --target DIR --draft DIR --new-tokens 128

Without a trained embedded target and draft LM this runs on random weights of the embedded shape and a
stand-in draft LM (the target's embeddings and first layer): the speeds are real, the acceptance is not
what a trained pair gets, and a random target's greedy output loops, which flatters prompt lookup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from angelspec.decoding.drafters import DraftLMDrafter, NGramDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.models import Decoder, load_target, save_target

sys.path.insert(0, str(Path(__file__).parent))
from ar_decode import DTYPES, make_prompts, resolve_target  # noqa: E402


def stand_in_draft(target: Decoder) -> Decoder:
    """A 1-layer draft LM sharing the target's embeddings, first layer and final norm (untrained)."""
    cfg = dataclasses.replace(target.config, num_hidden_layers=1)
    draft = Decoder(cfg).to(target.embed_tokens.weight.dtype)
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft.eval()


def benchmark_prompts(target_dir: Path, n: int, prompt_len: int, target: Decoder) -> tuple[list[list[int]], str]:
    """Chat-formatted sample prompts when the target folder has a tokenizer, else random token ids."""
    if (target_dir / "tokenizer.json").is_file():
        from angelspec.data.tokenizer import load_tokenizer
        from angelspec.train.target import SAMPLE_PROMPTS

        tok = load_tokenizer(target_dir)
        texts = list(SAMPLE_PROMPTS.values())
        ids = [tok.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(n)]
        return ids, "chat-formatted sample prompts (code / maths / chat / docs)"
    cfg = target.config
    return make_prompts(n, prompt_len, cfg.vocab_size, set(cfg.eos_token_ids)), f"random ids, {prompt_len} tokens"


def timed(fn, repeats: int) -> tuple[float, object]:
    out, best = fn(), float("inf")  # warm-up
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="HF-layout target folder (default: embedded target, else random weights)")
    p.add_argument("--draft", help="HF-layout draft LM folder (default: a stand-in built from the target)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true",
                   help="also time our engine with EngineConfig(compile=True) (AR decode step; verify forward and "
                        "draft-LM steps), after one untimed warm-up generation that pays the compilation")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, desc = resolve_target(args.target, Path(tmp) / "target")
        target = load_target(target_dir, dtype=dtype)
        if args.draft:
            draft_dir, draft_desc = Path(args.draft), args.draft
        else:
            draft_dir, draft_desc = Path(tmp) / "draft", "stand-in (target embeddings + layer 0, untrained)"
            save_target(stand_in_draft(target), draft_dir)
        draft = load_target(draft_dir, dtype=dtype)
        draft_vocab = (json.loads((draft_dir / "config.json").read_text()).get("angelspec") or {}).get("draft_vocab")
        hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
        hf_draft = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()

        prompts, prompts_desc = benchmark_prompts(target_dir, args.prompts, args.prompt_len, target)
    k, new = args.num_draft_tokens, args.new_tokens
    requests = [Request(pr, max_new_tokens=new, stop_ids=()) for pr in prompts]
    cfg = EngineConfig(max_batch_size=1, num_draft_tokens=k)

    def ours(drafter, compile_: bool = False):
        engine = SpecEngine(target, drafter, dataclasses.replace(cfg, compile=compile_))
        if compile_:
            engine.generate([Request(prompts[0], max_new_tokens=2 * k + 2, stop_ids=())])  # pays the compilation

        def run():
            return [r.token_ids for r in engine.generate(requests)], engine.metrics.mean_accepted_length
        return run

    def new_draft_lm() -> DraftLMDrafter:
        """Our drafter over the same draft model, with the folder's draft vocabulary (`angelspec draft-vocab`)
        when it has one; HF's assisted generation always scores the whole vocabulary."""
        return DraftLMDrafter(draft, draft_vocab=draft_vocab)

    def theirs(**kw):
        def run():
            outs = []
            for pr in prompts:
                ids = torch.tensor([pr])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, **kw)
                outs.append(out[0, ids.shape[1]:].tolist())
            return outs, None
        return run

    runs = {
        "ours AR": ours(None),
        "ours n-gram": ours(NGramDrafter(max_ngram=3)),
        "ours draft-LM": ours(new_draft_lm()),
        **({"ours AR compiled": ours(None, True), "ours n-gram compiled": ours(NGramDrafter(max_ngram=3), True),
            "ours draft-LM compiled": ours(new_draft_lm(), True)} if args.compile else {}),
        "HF AR": theirs(),
        "HF prompt lookup": theirs(prompt_lookup_num_tokens=k),
        "HF assisted": theirs(assistant_model=hf_draft),
    }
    res = {}
    with torch.inference_mode():
        for name, fn in runs.items():
            res[name] = timed(fn, args.repeats)
            print(f"  {name}: {res[name][0]:.2f}s", file=sys.stderr, flush=True)
    n_tok = len(prompts) * new

    def ms(name: str) -> float:
        return res[name][0] / n_tok * 1e3

    ar_tokens = res["ours AR"][1][0]
    if draft_vocab:
        draft_desc += f" (ours drafts from its {len(draft_vocab)}-token draft vocabulary)"
    print(f"\nT=0, batch 1, {len(prompts)} prompts x {new} new tokens, K={k}, {args.dtype}, best of {args.repeats}, "
          f"{args.threads} thread(s), EOS disabled\ntarget: {desc}\ndraft LM: {draft_desc}\nprompts: {prompts_desc}")
    head = f"{'':24}{'ms/token':>10}{'vs own AR':>11}{'MAL':>7}  same tokens as own AR"
    print(head + "\n" + "-" * len(head))
    for name, (_, (tokens, mal)) in res.items():
        own_ar = "HF AR" if not name.startswith("ours") else "ours AR compiled" if name.endswith("compiled") \
            else "ours AR"
        same = sum(a == b for a, b in zip(tokens, res[own_ar][1][0], strict=True))
        mal_s = f"{mal:7.2f}" if mal is not None else f"{'':7}"
        print(f"{name:24}{ms(name):>10.2f}{ms(own_ar) / ms(name):>10.2f}x{mal_s}  {same}/{len(prompts)}")
    print("\nours / theirs wall-clock speed (same drafter):")
    for ours_name, hf_name in (("ours AR", "HF AR"), ("ours n-gram", "HF prompt lookup"),
                               ("ours draft-LM", "HF assisted")):
        for variant in (ours_name, f"{ours_name} compiled"):
            if variant in res:
                print(f"  {variant:23} vs {hf_name:17} {ms(hf_name) / ms(variant):.2f}x")
    same_ar = sum(a == b for a, b in zip(ar_tokens, res["HF AR"][1][0], strict=True))
    print(f"ours AR == HF AR: {same_ar}/{len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
