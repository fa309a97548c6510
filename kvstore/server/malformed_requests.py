"""Requests whose bytes are no protobuf message: refused with INVALID_ARGUMENT, never INTERNAL.

Why: grpcio parses each request before the handler runs; when parsing fails it answers INTERNAL
("Exception deserializing request!") and logs a full traceback at ERROR level — for every such
message, so a peer sending garbage both reads as a server fault and fills the daemon's log.
Malformed input is the caller's fault: ``MalformedRequests`` wraps every handler's deserializer
so that a message that does not parse reaches the handler as a marker, and the call ends with
INVALID_ARGUMENT naming the method and protobuf's reason, before the servicer sees anything.
It sits inside the auth check (kvstore/server/auth.py): a call without a valid token is refused first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

log = logging.getLogger(__name__)

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class _Malformed:
    """What the tolerant deserializer returns for bytes that do not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, or anything else it raises on bad bytes
            return _Malformed(f"{type(e).__name__}: {e}")

    return deserialize


def _refuse(context: grpc.ServicerContext, method: str, bad: _Malformed) -> None:
    log.debug("malformed request to %s: %s", method, bad.reason)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method.rpartition('/')[2]} request: {bad.reason}")


def _checked(requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Iterator[Any]:
    for r in requests:
        if isinstance(r, _Malformed):
            _refuse(context, method, r)
        yield r


class MalformedRequests(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        h = continuation(details)
        if h is None or h.request_deserializer is None:
            return h
        method = details.method
        kind = (h.request_streaming, h.response_streaming)
        inner = {(False, False): h.unary_unary, (False, True): h.unary_stream,
                 (True, False): h.stream_unary, (True, True): h.stream_stream}[kind]  # fmt: skip
        if h.request_streaming:
            def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                return inner(_checked(requests, context, method), context)
        else:
            def behavior(request: Any, context: grpc.ServicerContext, *send: Any) -> Any:
                if isinstance(request, _Malformed):
                    _refuse(context, method, request)
                return inner(request, context, *send)

            # a non-blocking handler (health Watch) stays so: it answers through a callback and
            # holds no worker thread while its stream is open
            if getattr(inner, "experimental_non_blocking", False):
                behavior.experimental_non_blocking = True  # type: ignore[attr-defined]
        return _FACTORIES[kind](behavior, request_deserializer=_tolerant(h.request_deserializer),
                                response_serializer=h.response_serializer)  # fmt: skip
