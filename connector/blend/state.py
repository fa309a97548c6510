"""What a CacheBlend request carries in its declared ``blend`` slot: the spec, then what was done."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from connector.blend.spec import BlendSpec
from engine.request import HookState


class BlendStats(NamedTuple):
    ratio: float  # recompute ratio used
    recomputed: int  # positions recomputed at layers >= 2
    selected: int  # document tokens picked at the check layer
    document_tokens: int
    exact_prefix: int  # tokens loaded exact (radix / daemon) before blending


@dataclass
class BlendState(HookState):
    spec: BlendSpec
    stats: BlendStats | None = None  # set once the prompt was blended (None: prefilled in full)
