"""tierkv's KV block store: the TieredStore, and the daemon that serves it over gRPC.

Entry points (imported from their modules, so importing ``kvstore.keys`` never pulls in gRPC):
``kvstore.keys`` (Namespace, chain_keys), ``kvstore.block`` (encode_block, decode_block),
``kvstore.client`` (KVStoreClient), ``kvstore.tiered_store`` (TieredStore, embedded use),
``kvstore.tier_factory`` (build_store from a StoreConfig), ``kvstore.cli`` (``kvstore serve``).
"""
