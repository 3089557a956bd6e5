"""The EAGLE-3 drafter: `MTPDrafter` (draft KV cache, recurrent depths, rollback on commit) around an
`Eagle3DraftModel`, which conditions on fc over three target taps (`models.eagle3`).

Build it with `Eagle3Drafter.from_pretrained(dir, target=...)` (the target's embedding and LM head are shared;
a target without the folder's tap layers is refused with DrafterMismatchError) or `Eagle3Drafter(model)`.
"""

from __future__ import annotations

from angelspec.decoding.drafters.mtp import MTPDrafter


class Eagle3Drafter(MTPDrafter):
    """EAGLE-3 drafts through the MTP family's engine drafter; only the saved-folder kind differs."""

    kind = "eagle3"
