"""CacheBlend: reuse cached document KV at any position, recomputing the tokens that deviate most.

Wiring (connector/wiring.py; ``kvengine serve`` does it through the "cacheblend" plug-in)::

    hook = attach_cacheblend(engine, BlendConfig(ratio=0.15))  # raises BlendUnsupportedError;
                                                               # chunks via the daemon if a connector is attached
    ids, spec = build_chat_blend_request(tok, messages, documents, ratio)   # chat completions
    ids, spec = build_blend_request(tok, system, documents, question, ratio)  # plain pieces
    system, docs, question = split_by_separator(prompt, sep)                  # plain prompt + separator
    rid = add_blend_request(engine, spec, params, rid=rid, cache_salt=salt)   # or engine.add_request(...,
                                                    # extras=blend_extras(BlendState(spec)))
    hook.metrics.snapshot()  # also exported on /metrics via engine.metric_collectors
"""

from connector.blend.blender import Blender, BlendPlan, BlendResult
from connector.blend.chunk_cache import ChunkCache, ChunkStore, InProcessChunkStore, chunk_key
from connector.blend.errors import BlendError, BlendUnsupportedError, InvalidBlendRequestError
from connector.blend.frontend import BlendFrontend, add_blend_request
from connector.blend.hook import BlendConfig, BlendHook
from connector.blend.metrics import BlendMetrics
from connector.blend.ratio import RecomputeRatio
from connector.blend.selfcheck import rerotate, self_check
from connector.blend.spec import (
                                 BlendSpec,
                                 Segment,
                                 build_blend_request,
                                 build_chat_blend_request,
                                 split_by_separator,
)
from connector.blend.state import BlendState, BlendStats, blend_extras, blend_state

__all__ = [
    "BlendConfig", "BlendError", "BlendHook", "BlendMetrics", "BlendPlan", "BlendResult", "BlendSpec", "BlendState",
    "BlendStats", "Blender",
    "BlendUnsupportedError", "ChunkCache", "ChunkStore", "InProcessChunkStore", "InvalidBlendRequestError",
    "RecomputeRatio", "Segment", "build_blend_request", "build_chat_blend_request", "chunk_key", "rerotate", "self_check", "split_by_separator",
    "BlendFrontend", "add_blend_request", "blend_extras", "blend_state",
]
