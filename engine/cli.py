"""`kvengine serve` (OpenAI-compatible server) and `kvengine generate` (one-off run)."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from importlib.metadata import PackageNotFoundError, version

from engine import plugins
from engine.config import ENV, ENV_PREFIX, EngineConfig
from engine.env import EnvDeclaration, parse_size
from engine.errors import ConfigError

log = logging.getLogger("kvengine")
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
#: the plug-in ``serve`` attaches for `documents` / `blend_separator` requests (``--no-blend``: none)
DOCUMENTS_PLUGIN = "cacheblend"
#: the bounds on what one API client may ask (engine/limits.py), one integer flag each
LIMIT_FLAGS = {"max_waiting": "API requests in flight beyond --max-num-seqs; past it: 429",
               "max_tenant_in_flight": "API requests one tenant may have in flight; past it: 429 for that tenant "
                                       "only (0 = half of --max-num-seqs + --max-waiting with --api-keys)",
               "max_stop_strings": "stop strings per request", "max_stop_chars": "characters of one stop string",
               "max_stop_token_ids": "stop_token_ids per request",
               "max_prompt_chars": "characters of a text prompt before tokenising (0 = 16 per token of context)",
               "max_salt_bytes": "UTF-8 bytes of a cache_salt",
               "max_body_bytes": "bytes of one request body, refused 413 before it is read (0 = 128 per token of "
                                 "context, at least 1 MiB)"}


def _field_help(text: str, field: str, shown: object = None) -> str:
    """``text (default: D; env TIERKV_ENGINE_FIELD)``: the flag overrides the variable."""
    default = _DEFAULTS[field] if shown is None else shown
    return f"{text} (default: {default if default != '' else 'none'}; env {ENV_PREFIX}{field.upper()})"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=_field_help("local HF dir or .gguf", "model", "bundled SmolLM2-135M"))
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"], help=_field_help("device", "device"))
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help=_field_help("KV and weight dtype (auto: fp32 on CPU, bf16 on CUDA)", "dtype"))
    p.add_argument("--kv-memory", default=None, metavar="SIZE",
                   help=_field_help("KV pool budget, e.g. 512Mi (Gi = 2^30, G = 10^9, bare = bytes)", "kv_memory",
                                    "512Mi"))
    p.add_argument("--num-pages", type=int, default=None, help=_field_help("KV pages (overrides --kv-memory)",
                                                                           "num_pages", "0 = from --kv-memory"))
    p.add_argument("--page-size", type=int, default=None, help=_field_help("tokens per KV page", "page_size"))
    p.add_argument("--max-num-seqs", type=int, default=None, help=_field_help("running requests", "max_num_seqs"))
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help=_field_help("prompt tokens one step adds to its running decodes (chunked prefill): "
                                    "smaller keeps streams flowing behind long prompts, larger gives a long "
                                    "prompt its first token in fewer steps; see docs/operations.md",
                                    "max_prefill_tokens"))
    p.add_argument("--cross-tenant-step-share", type=float, default=None,
                   help=_field_help("of those, prompts of tenants other than those decoding in a step may add at "
                                    "most this share of a decode-only step to it, learnt from the engine's steps: "
                                    "what another tenant's load adds to a stream's gap between tokens (with several "
                                    "tenants; engine/step_budget.py; 0 = no bound)", "cross_tenant_step_share"))
    p.add_argument("--max-model-len", type=int, default=None,
                   help=_field_help("context length", "max_model_len", "0 = the model's"))
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "flashinfer"],
                   help=_field_help("attention kernels", "attention_backend"))
    p.add_argument("--threads", type=int, default=None, dest="num_threads",
                   help=_field_help("torch threads on CPU", "num_threads", "0 = torch's"))
    p.add_argument("--cpu-gemm", default=None, choices=["auto", "torch", "linear"],
                   help=_field_help("linear layers of small steps on the CPU: auto times the native and mm forms "
                                    "against F.linear at start-up (engine/cpu_gemm.py); torch: without the "
                                    "native form", "cpu_gemm"))
    p.add_argument("--kvstore", default=None, metavar="HOST:PORT",
                   help=_field_help("kvstore daemon address (attaches the connector)", "kvstore"))
    p.add_argument("--kv-connector", default=None,
                   help=_field_help("connector plug-in --kvstore attaches (engine/plugins.py)", "kv_connector"))
    p.add_argument("--shared-prefix-file", default=None, metavar="FILE",
                   help=_field_help("YAML list of prompts ({text: ...} or {ids: [...]}) whose KV every tenant shares "
                                    "(docs/operations.md, Tenants)", "shared_prefix_file"))
    p.add_argument("--tenant", default=None, metavar="NAME",
                   help=_field_help("the one tenant of an engine without API keys: its requests' KV namespace; "
                                    "cache_salt only sub-divides it (engine/tenancy.py)", "tenant"))
    for field, text in LIMIT_FLAGS.items():
        p.add_argument("--" + field.replace("_", "-"), type=int, default=None, help=_field_help(text, field))
    p.add_argument("--check-config", action="store_true", help="validate flags and environment, then exit")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _misspelt_family(var: str, decl: EnvDeclaration) -> bool:
    """``var`` is one of ``decl``'s variables under a misspelt prefix (TIERKV_ENGIN_PAGE_SIZE)."""
    for name in decl.names():
        field = name[len(decl.prefix):] if name.startswith(decl.prefix) else ""
        if field and var.endswith(field) and var != name and \
                difflib.SequenceMatcher(None, var[: -len(field)], decl.prefix).ratio() >= 0.75:
            return True
    return False


def unknown_env_warnings(declared: Sequence[EnvDeclaration] = (ENV,), environ: dict[str, str] | None = None) -> list[str]:
    """One line per TIERKV_* variable that belongs to what is loaded and is no variable of it, with the
    closest real name.

    ``declared``: the engine's own declaration and those of the plug-ins it loads (engine/plugins.py
    ``env_declarations``). A variable is judged if it has the prefix of one of them, or is one of
    their variables under a misspelt prefix; any other TIERKV_* variable belongs to another program
    (the kvstore daemon, a plug-in not loaded) and is left to it."""
    environ = dict(os.environ if environ is None else environ)
    ours = sorted(v for v in environ if v.startswith("TIERKV_"))
    if not ours:
        return []
    known = sorted(set().union(*(d.names() for d in declared)))
    prefixes = tuple(d.prefix for d in declared)
    lines = []
    for var in ours:
        if var in known or not (var.startswith(prefixes) or any(_misspelt_family(var, d) for d in declared)):
            continue
        match = difflib.get_close_matches(var, known, n=1, cutoff=0.75)
        lines.append(f"unknown environment variable {var} ignored" + (f" (did you mean {match[0]}?)" if match else ""))
    return lines


def package_version() -> str:
    try:
        return version("tierkv")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_env(
        model=a.model, device=a.device, dtype=a.dtype,
        kv_memory=parse_size(a.kv_memory) if a.kv_memory else None, num_pages=a.num_pages,
        page_size=a.page_size, max_num_seqs=a.max_num_seqs, max_prefill_tokens=a.max_prefill_tokens,
        cross_tenant_step_share=a.cross_tenant_step_share,
        max_model_len=a.max_model_len, attention_backend=a.attention_backend, num_threads=a.num_threads,
        cpu_gemm=a.cpu_gemm, kv_connector=a.kv_connector, shared_prefix_file=a.shared_prefix_file, tenant=a.tenant,
        api_keys_file=getattr(a, "api_keys_file", None), **{field: getattr(a, field) for field in LIMIT_FLAGS})


def build_engine(cfg: EngineConfig, kvstore: str | None = None):
    """Load, build and warm up an engine, logging each stage (model load can take a while).

    With a kvstore address the connector named by ``cfg.kv_connector`` is resolved through the
    plug-in registry (engine/plugins.py) and attaches itself."""
    from engine.engine import LLMEngine
    from engine.model_loader import load_model
    from engine.sampling import SamplingParams

    t0 = time.perf_counter()
    log.info("loading model %s ...", cfg.model or "SmolLM2-135M-Instruct (bundled)")
    loaded = load_model(cfg.model)
    log.info("model loaded in %.1fs; building KV pool ...", time.perf_counter() - t0)
    engine = LLMEngine(cfg, loaded=loaded)
    kvstore = kvstore or cfg.kvstore
    if kvstore:
        plugins.resolve(cfg.kv_connector)(engine, kvstore)
        log.info("connected to kvstore daemon at %s (%s connector)", kvstore, cfg.kv_connector)
    log.info("warming up ...")
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.radix.reset()
    log.info("ready in %.1fs (%d KV pages of %d tokens)", time.perf_counter() - t0, engine.pool.num_pages,
             engine.pool.page_size)
    return engine


def host_port(value: str, flag: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); '[::1]:8000' works too. ConfigError names the flag."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{flag} must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _serve_address(a: argparse.Namespace) -> tuple[str, int]:
    return host_port(a.listen, "--listen") if a.listen else (a.host, a.port)


def _plugins_wanted(a: argparse.Namespace, cfg: EngineConfig) -> list[tuple[str, tuple[str, ...]]]:
    """The plug-ins these flags ask for, with their arguments (ConfigError for a bad address)."""
    wanted: list[tuple[str, tuple[str, ...]]] = []
    kvstore = a.kvstore or cfg.kvstore
    if kvstore:
        host_port(kvstore, "--kvstore")
        wanted.append((cfg.kv_connector, (kvstore,)))
    if a.cmd == "serve" and not a.no_blend:
        wanted.append((DOCUMENTS_PLUGIN, ()))
    return wanted


def _check_plugins(wanted: Sequence[tuple[str, tuple[str, ...]]]) -> None:
    """The plug-ins these flags ask for exist and accept their environment (ValueError if not)."""
    for name, args in wanted:
        plugins.check(name, *args)


def _check(a: argparse.Namespace, cfg: EngineConfig) -> int:
    """--check-config: validate every flag and the environment, load nothing, serve nothing."""
    kvstore = a.kvstore or cfg.kvstore
    if a.cmd == "serve":
        host, port = _serve_address(a)
        metrics = f", metrics on {a.metrics_listen}" if a.metrics_listen else ""
        print(f"kvengine: configuration OK: serve on {host}:{port}{metrics}, kvstore {kvstore or 'none'}")
    else:
        print(f"kvengine: configuration OK, kvstore {kvstore or 'none'}")
    print(f"  {cfg}")
    return 0


def _compute_threads(engine: object) -> int:
    """The threads an engine keeps busy: torch's intra-op threads on CPU, the step thread on CUDA."""
    import torch

    return 1 if engine.device.type == "cuda" else torch.get_num_threads()  # type: ignore[attr-defined]


def _note_signal(signum: int, _frame: object) -> None:
    log.info("%s: shutting down", signal.Signals(signum).name)


def settle_heap() -> int:
    """Freeze what start-up built (the tokenizer's vocabulary, the weights' metadata: ~300k objects
    for SmolLM2-135M), kept for the process's life: a full collection no longer walks it. Unfrozen,
    each full collection under load took 0.17 s on the engine thread, a stream's gap between two
    tokens 3-4x its usual. Returns the number of objects frozen."""
    import gc

    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("froze %d start-up objects (out of reach of the garbage collector's full passes)", n)
    return n


def http_stack() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools (C) where installed, else asyncio and
    h11 (pure Python), with a warning. Why: the HTTP side shares the interpreter with the step loop,
    and every byte it handles in Python holds the interpreter lock the step thread then waits for. A
    refused 16 MB body (a 413 before it is read) cost the engine 561 us of CPU on asyncio + h11 and
    286 us on uvloop + httptools; a stream's ITL p99 under such a flood was 1.4-1.6x its own."""
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError as e:
        log.warning("HTTP on asyncio + h11 (%s): each request holds the step loop's interpreter longer; "
                    "pip install uvloop httptools", e)
        return "asyncio", "h11"
    return "uvloop", "httptools"


def _serve(a: argparse.Namespace, cfg: EngineConfig) -> int:
    import uvicorn

    from engine import limits
    from engine.async_engine import AsyncEngine
    from engine.gate import GateProcess, available_cpus, listening_socket, wanted
    from engine.http_protocol import refusing_protocol
    from engine.server import create_app
    from engine.tenancy import ApiKeys

    engine = build_engine(cfg, a.kvstore)
    documents = None if a.no_blend else plugins.resolve(DOCUMENTS_PLUGIN)(engine)  # before AsyncEngine: collectors
    aengine = AsyncEngine(engine)
    aengine.start()
    name = a.served_model_name or cfg.served_model_name or engine.loaded.name
    api_keys = ApiKeys.load(cfg.api_keys_file) if cfg.api_keys_file else None
    app = create_app(aengine, name, documents=documents, api_keys=api_keys, tenant=cfg.tenant)
    host, port = _serve_address(a)
    if a.metrics_listen:  # /metrics also on its own address (the API's port keeps serving it too)
        from prometheus_client import start_http_server

        m_host, m_port = host_port(a.metrics_listen, "--metrics-listen")
        start_http_server(m_port, addr=m_host, registry=aengine.metrics.registry)
        log.info("metrics on http://%s:%d/metrics", m_host, m_port)
    settle_heap()
    loop, http = http_stack()
    body_bound = limits.body_bytes_limit(cfg, engine.max_model_len)
    gate, sock = None, None
    cpus, threads = available_cpus(), _compute_threads(engine)
    try:  # the API's port: the gate's (the engine then serves on a unix socket behind it), or ours
        if wanted(a.gate, cpus, threads):
            gate = GateProcess(host, port, body_bound, cfg.api_keys_file)
            gate.start()
            port = gate.port
        else:
            try:
                sock = listening_socket(host, port)
            except OSError as e:
                raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except ConfigError as e:
        log.error("%s", e)
        aengine.shutdown()
        engine.close_plugins(0.0)
        return 2
    if gate is not None and gate.proc is not None:
        log.info("gate (pid %d) on %s:%d: refuses oversized bodies and unknown keys in a process of its own",
                 gate.proc.pid, host, port)
    else:
        log.info("no gate in front of the API (--gate %s; %d CPUs, %d compute threads)", a.gate, cpus, threads)
    log.info("serving %s on http://%s:%d/v1 (%s, %s)", name, host, port, loop, http)
    # uvicorn stops serving on SIGTERM/SIGINT, then re-raises the signal under the handler it found:
    # with ours in place that returns here (the default handler would kill us before the flush)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _note_signal)
    try:
        if sock is not None:
            proto = refusing_protocol(body_bound) if http == "httptools" else http  # 413s before any ASGI work
            uvicorn.Server(uvicorn.Config(app, log_level="warning", loop=loop, http=proto)).run(sockets=[sock])
        else:
            assert gate is not None
            uvicorn.run(app, log_level="warning", loop=loop, http=http, uds=gate.socket)
    finally:
        if gate is not None:
            gate.stop()
    log.info("shutting down: no new requests; flushing offloads (grace %.0fs)", a.shutdown_grace_s)
    aengine.shutdown()
    engine.close_plugins(a.shutdown_grace_s)
    log.info("stopped")
    return 0


def _generate(a: argparse.Namespace, cfg: EngineConfig) -> int:
    from engine.sampling import SamplingParams

    engine = build_engine(cfg, a.kvstore)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    prompt = a.prompt
    if a.chat:
        tok = engine.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
        prompt = tok(prompt, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    if cfg.tenant:  # the engine's one tenant's namespace, as a served request's
        from engine.tenancy import scoped_salt

        rid = engine.add_request(prompt, params, cache_salt=scoped_salt(cfg.tenant, None))
        req = engine.requests[rid]
        while not req.finished:
            engine.step()
    else:
        req = engine.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    print(req.text)
    log.info("%d tokens in %.2fs (%s)", len(req.output_ids), dt, req.finish_reason)
    engine.close_plugins(30.0)  # a write-through offload of this run reaches the daemon
    return 0


def main(argv: list[str] | None = None) -> int:
    from engine.gate import MODES as GATE_MODES

    ap = argparse.ArgumentParser(prog="kvengine", description="tierkv paged-attention LLM engine",
                                 epilog="Precedence per field: flag > TIERKV_ENGINE_* env > default.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to serve on (default %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port to serve on (default %(default)s)")
    s.add_argument("--listen", default=None, help="HOST:PORT to serve on (overrides --host/--port)")
    s.add_argument("--metrics-listen", default=None,
                   help="also serve Prometheus /metrics on HOST:PORT (it is always on the API port)")
    s.add_argument("--served-model-name", default=None, help=_field_help("model name in the API", "served_model_name", "the model's"))
    s.add_argument("--no-blend", action="store_true", help="refuse CacheBlend (`documents`) requests")
    s.add_argument("--api-keys", default=None, metavar="FILE", dest="api_keys_file",
                   help=_field_help("YAML mapping API key -> tenant: /v1/* then need 'Authorization: Bearer KEY' "
                                    "(401 without), and a request's KV namespace is its key's tenant "
                                    "(engine/tenancy.py)", "api_keys_file"))
    s.add_argument("--gate", choices=GATE_MODES, default="auto",
                   help="a process of its own in front of the API that refuses oversized bodies and unknown "
                        "keys without the engine (engine/gate.py); auto: on where the engine has 2 CPUs beyond "
                        "its compute threads (default: %(default)s)")
    s.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, wait this long for staged KV offloads to reach the daemon (default: %(default)s)")
    g = sub.add_parser("generate", help="one-off generation")
    _engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = _config(a)
        if a.cmd == "serve":
            _serve_address(a)
            if a.metrics_listen:
                host_port(a.metrics_listen, "--metrics-listen")
        wanted = _plugins_wanted(a, cfg)
        declared = [ENV, *(d for name, _ in wanted for d in plugins.env_declarations(name))]
        for line in unknown_env_warnings(declared):
            log.warning("%s", line)
        _check_plugins(wanted)  # before the model loads: a bad TIERKV_* value is one line, not a traceback
        if cfg.shared_prefix_file:
            from engine.shared_prefix import read_entries

            read_entries(cfg.shared_prefix_file)  # a bad file is one line too
        if cfg.api_keys_file:
            from engine.tenancy import ApiKeys

            ApiKeys.load(cfg.api_keys_file)  # likewise
        if a.check_config:
            return _check(a, cfg)
    except ValueError as e:  # a bad flag or env value (ConfigError is one): one line, no traceback
        print(f"kvengine: {e}", file=sys.stderr)
        return 2
    return _serve(a, cfg) if a.cmd == "serve" else _generate(a, cfg)


if __name__ == "__main__":
    sys.exit(main())
