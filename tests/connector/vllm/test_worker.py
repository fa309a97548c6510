"""The worker half of the vLLM connector against a real daemon (in process, over gRPC): vLLM-shaped
bf16 block tensors, saves and loads, and every way a load can fail reported back for recompute."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from connector.vllm.counters import Counters
from connector.vllm.meta import LoadSpec, SaveSpec, TierKVMetadata
from connector.vllm.worker import GRACE_S, BlockLayout, LayoutError, Worker
from tests.fixtures_kvstore import WAIT_S, Gate, connect, inprocess_daemon

LAYERS, BLOCKS, HEADS, TOKENS, HEAD = 3, 8, 2, 16, 8


def caches(seed: int | None, kv_first: bool = False) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: per layer [blocks, kv_heads, block_size, 2*head_dim]; flash-attn's: [2, blocks, ...]."""
    g = torch.Generator().manual_seed(seed or 0)
    shape = (2, BLOCKS, TOKENS, HEADS, HEAD) if kv_first else (BLOCKS, HEADS, TOKENS, 2 * HEAD)
    make = (lambda: torch.randn(shape, generator=g)) if seed is not None else (lambda: torch.zeros(shape))
    return {f"model.layers.{i}.self_attn.attn": make().to(torch.bfloat16) for i in range(LAYERS)}


def block_bytes(kv: dict[str, torch.Tensor], b: int, kv_first: bool = False) -> bytes:
    return BlockLayout(kv, BLOCKS).gather([b]).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def daemon() -> Iterator[Any]:
    with inprocess_daemon() as d:
        yield d


def worker(d: Any, kv: dict[str, torch.Tensor], **kw: Any) -> Worker:
    c = connect(d, use_shm=False)
    return Worker(BlockLayout(kv, BLOCKS), read=lambda keys, consume, dl: c.read_batches(keys, consume, deadline_s=dl),
                  delete=c.delete, held=lambda keys: c.lookup(keys, read=False).tiers, put=c.put_many,
                  counters=Counters(), save_queue_bytes=kw.get("save_queue_bytes", 1 << 30))  # fmt: skip


def save(w: Worker, keys: list[bytes], ids: list[int]) -> None:
    w.bind(TierKVMetadata(saves=[SaveSpec(keys, ids)]))
    w.after_forward()
    assert w.drain_saves(WAIT_S)


def load(w: Worker, spec: LoadSpec, until: Callable[[], bool] | None = None) -> set[str]:
    w.bind(TierKVMetadata(loads=[spec]))
    w.start_loads()
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        done = w.finished()
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("load never finished")


KEYS = [b"vllm-key-%07d" % i for i in range(4)]


@pytest.mark.parametrize("kv_first", [False, True])
def test_layouts_name_their_shape(kv_first: bool) -> None:
    lay = BlockLayout(caches(1, kv_first), BLOCKS)
    assert lay.kv_first is kv_first
    assert lay.block_shape == ((LAYERS, 2, TOKENS, HEADS, HEAD) if kv_first else (LAYERS, HEADS, TOKENS, 2 * HEAD))
    assert lay.block_bytes == LAYERS * HEADS * TOKENS * 2 * HEAD * 2
    assert lay.layout.startswith("vllm:" + ("kv_first" if kv_first else "block_first") + ":cpu:")


def test_mixed_layer_shapes_are_refused_in_one_line() -> None:
    kv = caches(1)
    kv["model.layers.9.self_attn.attn"] = torch.zeros(BLOCKS, 1, TOKENS, 2 * HEAD, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="one block layout"):
        BlockLayout(kv, BLOCKS)


@pytest.mark.parametrize("kv_first", [False, True])
def test_saved_blocks_load_bit_exact_into_other_block_ids(daemon: Any, kv_first: bool) -> None:
    src, dst = caches(1, kv_first), caches(None, kv_first)
    a, b = worker(daemon, src), worker(daemon, dst)
    save(a, KEYS[:3], [2, 5, 7])
    assert a.counters.take()["blocks:saved"] == 3
    assert load(b, LoadSpec("r", KEYS[:3], [0, 1, 3], ["cpu"] * 3, 5.0)) == {"r"}
    assert b.load_errors() == set()
    for s, t in ((2, 0), (5, 1), (7, 3)):
        assert block_bytes(dst, t, kv_first) == block_bytes(src, s, kv_first)
    assert block_bytes(dst, 2, kv_first) == bytes(len(block_bytes(dst, 2, kv_first)))  # untouched
    (o,) = b.worker_meta().loads  # type: ignore[union-attr]
    assert (o.loaded, o.wanted, o.reason) == (3, 3, "")
    a.close(), b.close()


def test_saves_skip_what_the_daemon_holds(daemon: Any) -> None:
    a = worker(daemon, caches(1))
    save(a, KEYS[:2], [0, 1])
    a.counters.take()
    save(a, KEYS[:3], [0, 1, 2])
    c = a.counters.take()
    assert c["blocks:saved"] == 1 and c["blocks:save_skipped"] == 2
    a.close()


def test_a_full_save_queue_drops_and_counts_never_blocks(daemon: Any) -> None:
    kv = caches(1)
    a = worker(daemon, kv, save_queue_bytes=BlockLayout(kv, BLOCKS).block_bytes)  # room for one block
    a.bind(TierKVMetadata(saves=[SaveSpec(KEYS[:2], [0, 1])]))
    a.after_forward()
    assert a.counters.take()["blocks:save_dropped"] == 2
    a.close()


def test_a_missing_block_ends_the_load_and_the_rest_is_recomputed(daemon: Any) -> None:
    src, dst = caches(1), caches(None)
    a, b = worker(daemon, src), worker(daemon, dst)
    save(a, [KEYS[0], KEYS[2]], [0, 2])  # KEYS[1] was evicted
    load(b, LoadSpec("r", KEYS[:3], [4, 5, 6], ["cpu"] * 3, 5.0))
    assert b.load_errors() == {5, 6}
    (o,) = b.worker_meta().loads  # type: ignore[union-attr]
    assert (o.loaded, o.reason) == (1, "missing")
    assert b.counters.take()["failed:missing"] == 2
    a.close(), b.close()


def test_a_corrupt_block_is_recomputed_and_deleted_from_the_daemon(daemon: Any) -> None:
    src, dst = caches(1), caches(None)
    a, b = worker(daemon, src), worker(daemon, dst)
    save(a, KEYS[:3], [0, 1, 2])
    inner = daemon.store.read

    def flip(key: bytes, sink: Callable[[memoryview], Any]) -> Any:
        if key != KEYS[1]:
            return inner(key, sink)
        return inner(key, lambda mv: sink(memoryview(bytes(mv[:-1]) + bytes([mv[-1] ^ 1]))))

    daemon.store.read = flip
    load(b, LoadSpec("r", KEYS[:3], [3, 4, 5], ["cpu"] * 3, 5.0))
    assert b.load_errors() == {4, 5}
    (o,) = b.worker_meta().loads  # type: ignore[union-attr]
    assert (o.loaded, o.reason, o.bad_keys) == (1, "corrupt", [KEYS[1]])
    daemon.store.read = inner
    held = connect(daemon, use_shm=False).lookup(KEYS[:3], read=False).tiers
    assert held[0] and held[1] is None and held[2]  # the corrupt block is gone, no replica reads it again
    a.close(), b.close()


def test_a_block_of_another_layout_is_refused(daemon: Any) -> None:
    a = worker(daemon, caches(1, kv_first=True))
    save(a, KEYS[:1], [0])
    b = worker(daemon, caches(None))
    load(b, LoadSpec("r", KEYS[:1], [0], ["cpu"], 5.0))
    assert b.load_errors() == {0} and b.worker_meta().loads[0].reason == "corrupt"  # type: ignore[union-attr]
    a.close(), b.close()


def test_a_hung_read_is_cancelled_past_its_deadline_and_never_writes_after(daemon: Any) -> None:
    src, dst = caches(1), caches(None)
    a, b = worker(daemon, src), worker(daemon, dst)
    save(a, KEYS[:3], [0, 1, 2])
    gate = Gate(KEYS[1])
    daemon.store.on_read = gate
    daemon.store.read = gate.read(daemon.store)
    t0 = time.monotonic()
    done = load(b, LoadSpec("r", KEYS[:3], [3, 4, 5], ["cpu"] * 3, 0.3))
    assert done == {"r"} and time.monotonic() - t0 < 0.3 + GRACE_S + WAIT_S / 2
    assert gate.entered.is_set() and not gate.done.is_set()  # reported while the read still hangs
    assert b.load_errors() >= {4, 5}
    (o,) = b.worker_meta().loads  # type: ignore[union-attr]
    assert o.reason == "deadline"
    before = [block_bytes(dst, i) for i in (4, 5)]
    gate.release.set()
    assert gate.done.wait(WAIT_S)
    time.sleep(0.2)
    assert [block_bytes(dst, i) for i in (4, 5)] == before  # nothing landed after the report
    a.close(), b.close()


def test_a_dead_daemon_fails_the_load_not_the_step(daemon: Any) -> None:
    dst = caches(None)
    c = connect("127.0.0.1:1", use_shm=False, deadline_s=0.5)
    w = Worker(BlockLayout(dst, BLOCKS), read=lambda k, f, dl: c.read_batches(k, f, deadline_s=dl),
               delete=c.delete, held=None, put=c.put_many, counters=Counters(), save_queue_bytes=1 << 30)
    load(w, LoadSpec("r", KEYS[:2], [0, 1], ["cpu"] * 2, 1.0))
    assert w.load_errors() == {0, 1}
    assert w.worker_meta().loads[0].reason in ("error", "deadline")  # type: ignore[union-attr]
    save(w, KEYS[:1], [0])  # a save to a dead daemon is dropped, counted
    assert w.counters.take()["blocks:save_dropped"] == 1
    w.close()


def test_step_times_are_reported_for_calibration() -> None:
    w = Worker(BlockLayout(caches(None), BLOCKS), read=lambda *a: [], delete=lambda k: 0, held=None,
               put=lambda items: [], counters=Counters(), save_queue_bytes=0)  # fmt: skip
    w.bind(TierKVMetadata(seqs=[(100, 0), (1, 50)]))
    w.start_loads()
    w.after_forward()
    (steps,) = w.worker_meta().steps  # type: ignore[union-attr]
    assert steps[0] == [(100, 0), (1, 50)] and steps[1] >= 0
    assert w.worker_meta() is None  # drained
    w.close()


def test_host_pieces_are_views_of_vllm_tensors() -> None:
    kv = caches(None)
    lay = BlockLayout(kv, BLOCKS)
    for p in lay.host_pieces(3):
        p[:] = 1
    t = next(iter(kv.values()))
    assert t[3].view(torch.uint8).numpy().min() == 1 and t[2].view(torch.uint8).numpy().max() == 0
    assert np.all([p.flags.writeable for p in lay.host_pieces(0)])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_first", [False, True])
def test_blocks_round_trip_through_cuda_block_tensors(daemon: Any, kv_first: bool) -> None:
    """The GPU path (bench/gpu_check.sh runs the gpu-marked tests): blocks saved from CUDA tensors
    (a host copy per save) load bit-exact into other CUDA tensors (verified on the host, uploaded)."""
    src = {n: t.cuda() for n, t in caches(1, kv_first).items()}
    dst = {n: t.cuda() for n, t in caches(None, kv_first).items()}
    a, b = worker(daemon, src), worker(daemon, dst)
    assert a.layout.layout.startswith("vllm:" + ("kv_first" if kv_first else "block_first") + ":cuda:")
    save(a, KEYS[:3], [2, 5, 7])
    assert load(b, LoadSpec("r", KEYS[:3], [0, 1, 3], ["cpu"] * 3, 5.0)) == {"r"} and b.load_errors() == set()
    for s, t in ((2, 0), (5, 1), (7, 3)):
        assert block_bytes(dst, t, kv_first) == block_bytes(src, s, kv_first)
    a.close(), b.close()


@pytest.mark.parametrize("kv_first", [False, True])
def test_one_pass_encode_is_the_block_the_general_path_makes(kv_first: bool) -> None:
    """Host blocks are gathered and checksummed natively into an encoded block; it must be byte for
    byte the block the torch gather + encode_block path makes (CUDA replicas still use that one,
    and both kinds of replica read each other's blocks)."""
    from connector.dtypes import to_block_array
    from kvstore.block import encode_block

    lay = BlockLayout(caches(3, kv_first), BLOCKS)
    assert lay.piece_addrs(5) is not None
    arr, dt = to_block_array(lay.gather([5])[0])
    want = encode_block(KEYS[0], arr, dtype=dt, shape=lay.block_shape, layout=lay.layout)
    assert bytes(lay.encode(5, KEYS[0])) == want


def test_an_in_step_load_lands_before_start_loads_returns_and_is_never_finished(daemon: Any) -> None:
    """vLLM scheduled the request over an in-step load: the blocks are in place when start_load_kv
    returns, get_finished never names it (vLLM would assert), and a missing block is a load error
    after this very step, so vLLM recomputes from it."""
    src, dst = caches(1), caches(None)
    a, b = worker(daemon, src), worker(daemon, dst)
    save(a, KEYS[:2], [2, 5])
    b.bind(TierKVMetadata(loads=[LoadSpec("r", KEYS[:3], [0, 1, 3], ["cpu"] * 3, 0.5, sync=True)]))
    b.start_loads()
    assert block_bytes(dst, 0) == block_bytes(src, 2) and block_bytes(dst, 1) == block_bytes(src, 5)
    assert b.load_errors() == {3} and b.finished() == set()
    (o,) = b.worker_meta().loads  # type: ignore[union-attr]
    assert (o.loaded, o.wanted, o.reason) == (2, 3, "missing")
    assert b.counters.take()["sync_loads"] == 1
    a.close(), b.close()
