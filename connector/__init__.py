"""The engine side of tierkv: offload evicted KV to the kvstore daemon, look up and load what
pays, with a transfer-versus-recompute cost model (CacheBlend lives in connector/blend/).

Data path of one request (see /work/shared/DESIGN.md):
  1. the scheduler matches the prompt in the local radix cache (one tree per ``cache_salt``);
  2. ``KVConnector.on_admit`` computes the chained keys of the next full pages (namespace =
     model fingerprint + page size + KV dtype + tenant salt), asks the daemon which it holds and
     in which tier (a short deadline);
  3. the cost model (cost_model.py) picks how many to load: all, the first k, or none;
  4. the loader (loader.py) fetches them into fresh pool pages under a deadline, checking every
     block; the contiguous prefix that arrived intact goes into the radix tree at once and the
     prefill continues after it;
  5. evicted radix leaves (and, with ``write_through``, finished requests' pages) are copied out
     at once and sent to the daemon by a background thread (offload.py).

Mapping from the vLLM KV connector V1 API to ours (connector.py):

  =============================  ======================================================
  vLLM (KVConnectorBase_V1)      tierkv
  =============================  ======================================================
  get_num_new_matched_tokens     KVConnector.get_num_new_matched_tokens -> LoadPlan
                                 (lookup + cost-model decision, after the radix match)
  update_state_after_alloc       KVConnector.update_state_after_alloc (fresh pages from
                                 Scheduler.alloc for the pages to load)
  request_finished               KVConnector.on_finish (write-through offload)
  start_load_kv                  KVConnector.start_load (Loader.load into the pages)
  wait_for_layer_load            KVConnector.wait_for_layer_load (no-op: loads finish
                                 before the forward pass; no layer-wise overlap on CPU)
  save_kv_layer                  KVConnector.save (copy pages out, queue for the daemon)
  wait_for_save                  KVConnector.wait_for_save (Offloader.flush)
  get_finished                   not needed: loads are synchronous, saves own copies
  kv_load_failure_policy         always "recompute": a deadline, a dead daemon or a bad
                                 block keeps the intact prefix and recomputes the rest
  =============================  ======================================================

Entry point: ``connector.attach.attach_kvstore(engine, "host:port")`` (``kvengine serve
--kvstore ADDR``).
"""
