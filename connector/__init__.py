"""The engine side of tierkv: offload evicted KV to the kvstore daemon, look up and load what
pays, with a transfer-versus-recompute cost model (CacheBlend lives in connector/blend/).

Design: docs/architecture.md. Data path of one request:
  1. the scheduler matches the prompt in the local radix cache (one tree per ``cache_salt``);
  2. as soon as the request is queued, ``KVConnector.start`` (a loading hook, engine/hooks.py)
     has its lookup worker (fetch.py) compute the chained keys of the next full pages (namespace =
     model fingerprint + page size + KV dtype + tenant salt) and ask the daemon which it holds and
     in which tier (a short deadline); keys it lacks are forgotten from ``KnownKeys`` so that they
     are offloaded again; the request waits in LOADING while the engine steps on;
  3. the load-aware cost model (cost_model.py) picks how many to load: all, the first k, or none,
     given the transfers in flight and the prefill queued ahead (``ConnectorConfig.load_mode``:
     auto = cost model, always, never);
  4. in a poll on the engine thread the connector takes fresh pages for them; its transfer worker
     loads them under a deadline (loader.py), checking every block; the next poll proposes the
     contiguous prefix that arrived intact as an exact PrefixExtension, and the scheduler puts it
     in the radix tree at once; a corrupt block is deleted from the daemon;
  5. evicted radix leaves (and, with ``write_through``, finished requests' exact pages) are copied
     out at once and sent to the daemon by a background thread (offload.py).

Mapping from the vLLM KV connector V1 API to ours (connector.py):

  =============================  ======================================================
  vLLM (KVConnectorBase_V1)      tierkv
  =============================  ======================================================
  get_num_new_matched_tokens     KVConnector.plan_load -> LoadPlan | None (lookup +
                                 load-aware decision, on the lookup worker)
  update_state_after_alloc       the PageSource.alloc call in Fetcher.poll
  start_load_kv                  KVConnector.load (Loader.load into those pages, on
                                 the transfer worker)
  wait_for_layer_load            none: loads finish before the forward pass (no
                                 layer-wise overlap on CPU)
  build_connector_meta           none: scheduler and worker are one process; the
                                 PrefixExtension is the hand-over
  save_kv_layer                  KVConnector.save (copy pages out, queue for the daemon)
  wait_for_save                  KVConnector.flush (Offloader.flush; at shutdown too)
  request_finished               KVConnector.on_finish (write-through offload)
  get_finished                   KVConnector.poll (LoadPoll.done); saves own their copies
  kv_load_failure_policy         always "recompute": a deadline, a dead daemon or a bad
                                 block keeps the intact prefix and recomputes the rest
  =============================  ======================================================

Entry point: ``connector.wiring.attach_tierkv(engine, "host:port")``; ``kvengine serve --kvstore
ADDR`` reaches it by name ("tierkv") through engine/plugins.py.
"""
