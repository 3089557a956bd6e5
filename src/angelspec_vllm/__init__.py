"""AngelSpec's vLLM plugin (`pip install angelspec[vllm]` beside vLLM 0.32): registers, through vLLM's
`vllm.general_plugins` entry point, the drafter classes vLLM has none of, so that `angelspec export --format vllm`
folders of these kinds are served by vLLM's own proposers:

  AngelSpecMTPEagle3   MTP (Eq. 1-2, trained with TTT): one decoder layer over W_proj [RMSNorm(h); RMSNorm(E(x))],
                       driven by vLLM's EAGLE-3 proposer (`method: "eagle3"`), which hands it the target tap as its one
                       auxiliary hidden state and its own pre-norm output at the next depth (`mtp.py`)
  AngelSpecDFlyDFlash  DFly (shared + per-layer tap fusion, hidden-correction head, fused anchor input), driven by
                       vLLM's DFlash proposer (`method: "dflash"`): one block pass, then the head left to right over
                       greedy predecessors in `compute_logits` (`dfly.py`)

No proposer or runner of vLLM is patched. The classes read everything from the export's config.json and
model.safetensors; nothing here imports `angelspec` (vLLM brings its own torch). Written against vLLM 0.32.0: the
classes subclass its Eagle3Qwen3ForCausalLM / DFlashQwen3ForCausalLM, whose internals they rely on.
"""

from __future__ import annotations

ARCHITECTURES = {
    "AngelSpecMTPEagle3": "angelspec_vllm.mtp:AngelSpecMTPEagle3",
    "AngelSpecDFlyDFlash": "angelspec_vllm.dfly:AngelSpecDFlyDFlash",
}


VLLM_SERIES = "0.32."  # the vLLM the classes are written against


def register() -> None:
    """The `vllm.general_plugins` entry point: register the classes with vLLM's ModelRegistry (lazily, by name, so
    loading the plugin imports no model code); safe to call more than once, as vLLM may. Another vLLM version gets a
    warning, not a failure: the plugin loads in every vLLM process, also those that serve no AngelSpec drafter."""
    import vllm
    from vllm import ModelRegistry

    if not vllm.__version__.startswith(VLLM_SERIES):
        from vllm.logger import init_logger

        init_logger(__name__).warning("the AngelSpec drafter classes are written against vLLM %sx; this is vLLM %s",
                                      VLLM_SERIES, vllm.__version__)
    for arch, target in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
