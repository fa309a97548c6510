"""The Python client of the daemon and how its bytes travel.

``client`` (KVStoreClient: deadlines, retries, batching), ``retry`` (backoff), ``transfer`` (one
batch over shared memory or gRPC streaming), ``stream_client`` (the raw TCP Get channel), ``shm``
(the shared-memory segment, the client's pool of them and its view of the daemon's arena),
``shm_link`` (handing a segment's fd to the daemon over its unix socket).
"""
