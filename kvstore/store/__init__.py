"""The TieredStore and what it is made of: levels, eviction, spilling, tenants, circuit breakers.

``tiered_store`` (TieredStore: put/read/lookup/delete/stats over the chain), ``tier_bookkeeping``
(one level: a tier plus the store's index, counters and breaker for it), ``shared_state`` (what the
store's front and its spill worker share), ``top_writer`` (puts and promotions into the top tier,
copied outside the store lock), ``spiller`` + ``spill_queue`` (write-back), ``eviction``
(policies), ``miss_reasons`` (recently evicted keys: why a lookup missed), ``tenants`` (bytes per
tenant, quotas), ``breaker`` (detach and probe a failing tier), ``replay`` (the writes a detached
shared tier skipped, replayed when it is attached again), ``results`` (what the store
returns), ``observers`` (the hooks metrics and traces plug into), ``signed_tier`` (the MAC on every block in
Redis and S3), ``tier_factory`` (tiers and the store from a StoreConfig). No gRPC here: the store is embeddable.
"""
