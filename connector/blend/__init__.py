"""CacheBlend: reuse cached document KV at any position, recomputing the tokens that deviate most.

Server entry points: ``build_blend_request`` / ``split_by_separator`` (spec.py) to turn
documents into a BlendSpec, ``BlendHook.attach(engine)`` once at start-up, then
``hook.add_request(spec, params, rid, cache_salt)`` per request; ``hook.metrics.snapshot()``
for /metrics.
"""

from connector.blend.blender import Blender, BlendPlan, BlendResult
from connector.blend.chunk_cache import ChunkCache, ChunkStore, InProcessChunkStore, chunk_key
from connector.blend.errors import BlendError, BlendUnsupportedError, InvalidBlendRequestError
from connector.blend.hook import BlendConfig, BlendHook
from connector.blend.metrics import BlendMetrics
from connector.blend.ratio import RatioPolicy
from connector.blend.selfcheck import rerotate, self_check
from connector.blend.spec import (
                                 BlendSpec,
                                 Segment,
                                 build_blend_request,
                                 build_chat_blend_request,
                                 split_by_separator,
)

__all__ = [
    "BlendConfig", "BlendError", "BlendHook", "BlendMetrics", "BlendPlan", "BlendResult", "BlendSpec", "Blender",
    "BlendUnsupportedError", "ChunkCache", "ChunkStore", "InProcessChunkStore", "InvalidBlendRequestError",
    "RatioPolicy", "Segment", "build_blend_request", "build_chat_blend_request", "chunk_key", "rerotate", "self_check", "split_by_separator",
]
