"""tierkv's KV block store: the TieredStore, and the daemon that serves it over gRPC.

Subpackages: ``store`` (the TieredStore: levels, eviction, spilling, tenants, breakers), ``server``
(the daemon: servicer, auth, shared-memory sessions, the raw Get channel, metrics, health),
``client`` (KVStoreClient and how bytes travel), ``config`` (StoreConfig: defined, loaded,
validated; the flag table), ``ops`` (traces, tier sizing, dashboard, stats views). At the top:
what every side shares (``keys``, ``block``, ``errors``) and the entry points.

Entry points (imported from their modules, so importing ``kvstore.keys`` never pulls in gRPC):
``kvstore.keys`` (Namespace, chain_keys), ``kvstore.block`` (encode_block, decode_block),
``kvstore.client.client`` (KVStoreClient), ``kvstore.store.tiered_store`` (TieredStore, embedded use),
``kvstore.store.tier_factory`` (build_store from a StoreConfig), ``kvstore.cli`` (``kvstore serve``).
"""
