"""The daemon around one TieredStore: gRPC servicer, auth, shared-memory sessions, the raw Get
channel, metrics and health.

``daemon`` (Daemon, ``serve``: the process; gRPC connection limits), ``servicer`` (protobuf <->
store calls, every request's limits), ``put_streams`` (Put streams: how many at once, how long),
``auth`` (bearer tokens, TLS; the client's credentials too), ``credentials`` (which tenants each
token may touch: the one check of every key, shared memory's included), ``malformed_requests``
(bytes that are no message: INVALID_ARGUMENT), ``shm_sessions`` (the segments clients attached),
``shm_listener`` (the unix socket they are handed over on), ``stream_server`` + ``stream_wire``
(the raw TCP Get channel and its framing), ``metrics`` (Prometheus), ``health`` (gRPC health per
tier).
"""
