"""The worker half of the vLLM connector: bytes between the daemon and vLLM's KV blocks.

vLLM registers one KV tensor per attention layer. A block of the daemon is one vLLM block of every
layer, in layer order: ``(layers, *block)`` where ``block`` is what one block id selects in one
layer's tensor (``t[b]`` when the block dimension leads, as on vLLM's CPU backend; ``t[:, b]``
when K and V lead, as with flash-attn on CUDA). Nothing here imports vLLM.

Loads run on a background thread, so the scheduler keeps stepping other requests while they do
(vLLM holds the request in WAITING_FOR_REMOTE_KVS until ``finished`` names it), except those the
planner marks ``sync``: small loads it predicts to be fast run on the step's thread before the
forward (vLLM scheduled the request over them), bounded by their own short deadline. Either way:

- Every block is checked before it may feed attention: key, dtype, shape and layout from a
  private copy of its header, then the checksum of the payload *as it landed* in vLLM's block
  (on a CPU device: copied and hashed in one native pass, connector/native.py), or of a private host copy before it is uploaded (on an accelerator). The
  bytes may come from shared memory other processes can write, so verifying the source would
  prove nothing about what was copied.
- The leading run of good blocks is the load; every block after the first bad or missing one is
  reported to vLLM as invalid, and vLLM recomputes from there (``kv_load_failure_policy`` must be
  "recompute"; the connector refuses to start otherwise). A block that fails its checksum or
  header is deleted from the daemon, so no replica reads it again.
- A load never writes after it is reported: each copy runs under the load's lock, and a load past
  its deadline (plus ``GRACE_S``) is cancelled under that lock and reported with what had
  landed, even if its thread is still waiting on the daemon.

Saves: after the step's forward (``wait_for_save``), the blocks the scheduler named are gathered
into private host memory right away (vLLM may reuse a block as soon as the step is over: from host
tensors straight into encoded blocks, copied and checksummed in one native pass), then
queued, bounded by ``save_queue_bytes``, to a thread that asks the daemon what it lacks, encodes
and sends. A full queue or a failing daemon drops saves (counted), never stalls a step.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from connector import native
from connector.dtypes import block_dtype, to_block_array
from connector.vllm.counters import Counters
from connector.vllm.meta import LoadOutcome, LoadSpec, SaveSpec, TierKVMetadata, TierKVWorkerMetadata
from kvstore.block import encode_block, encode_header, read_header, set_checksum, verify_payload
from kvstore.errors import BlockFormatError, ChecksumError, KVStoreTimeout

log = logging.getLogger(__name__)

GRACE_S = 1.0  # past a load's deadline, how long its thread may still finish before it is cancelled


class LayoutError(ValueError):
    """vLLM's KV tensors have a shape or layout this connector cannot move (one line)."""


def _layer_index(name: str) -> tuple[int, str]:
    nums = re.findall(r"\d+", name)
    return (int(nums[0]) if nums else -1, name)


class BlockLayout:
    """vLLM's per-layer KV tensors seen as per-block pieces, in the order a block's payload has."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None = None) -> None:
        if not kv_caches:
            raise LayoutError("vLLM registered no KV tensors")
        self.names = sorted(kv_caches, key=_layer_index)
        self.tensors = [kv_caches[n] for n in self.names]
        first = self.tensors[0]
        for n, t in zip(self.names, self.tensors, strict=True):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise LayoutError(f"layer {n} has KV {tuple(t.shape)} {t.dtype} on {t.device}, layer "
                                  f"{self.names[0]} {tuple(first.shape)} {first.dtype} on {first.device}: "
                                  "one block layout for every layer is required")  # fmt: skip
        shape = tuple(first.shape)
        nb = num_blocks if num_blocks is not None else shape[0]
        if shape[0] == nb:
            self.kv_first = False
            self.piece_shape = shape[1:]
        elif len(shape) > 2 and shape[0] == 2 and shape[1] == nb:
            self.kv_first = True
            self.piece_shape = shape[2:]
        else:
            raise LayoutError(f"KV tensor {shape}: no dimension of {nb} blocks in front")
        self.num_blocks = nb
        self.dtype = first.dtype
        self.device = first.device
        self.on_host = first.device.type == "cpu"
        for t in self.tensors:
            for p in self._pieces(t, 0):
                if not p.is_contiguous():
                    raise LayoutError(f"KV tensor {shape} strides {t.stride()}: a block's bytes are not contiguous")
        per = 2 if self.kv_first else 1
        self.block_shape = (len(self.tensors), *((2,) if self.kv_first else ()), *self.piece_shape)
        self.piece_bytes = first[0].numel() * first.element_size() // (nb if self.kv_first else 1)
        self.block_bytes = self.piece_bytes * per * len(self.tensors)
        self.dtype_str = block_dtype(self.dtype)
        #: what the key space folds in: a block of another layout is never read or overwritten
        self.layout = f"vllm:{'kv_first' if self.kv_first else 'block_first'}:{self.device.type}:" \
                      f"{'x'.join(map(str, self.block_shape))}"  # fmt: skip
        # host tensors: byte views per layer, so a block's piece is a numpy view (no torch call per copy)
        self._host = [t.view(torch.uint8).numpy() if self.on_host else None for t in self.tensors]
        # and the address of each piece of block 0, in payload order, plus how far block b's lies
        # on: the native ops copy a block to or from its pieces in one pass, hashing on the way
        self._piece0 = np.array([p.data_ptr() for t in self.tensors for p in self._pieces(t, 0)], np.uint64)
        step = {(p1.data_ptr() - p0.data_ptr()) for t in self.tensors
                for p0, p1 in zip(self._pieces(t, 0), self._pieces(t, 1 if nb > 1 else 0), strict=True)}  # fmt: skip
        self._step = step.pop() if len(step) == 1 else None

    def _pieces(self, t: torch.Tensor, b: int) -> list[torch.Tensor]:
        return [t[0, b], t[1, b]] if self.kv_first else [t[b]]

    def host_pieces(self, b: int) -> list[np.ndarray]:
        """Writable byte views of block ``b`` in every layer (host tensors only), in payload order."""
        out = []
        for arr in self._host:
            assert arr is not None
            if self.kv_first:
                out += [arr[0, b].reshape(-1), arr[1, b].reshape(-1)]
            else:
                out.append(arr[b].reshape(-1))
        return out

    def piece_addrs(self, b: int) -> np.ndarray | None:
        """Addresses of block ``b``'s pieces in payload order (host tensors with one stride per
        block id; else None). ``b`` must have passed ``check``."""
        if not self.on_host or self._step is None:
            return None
        return self._piece0 + np.uint64(b * self._step)

    def encode(self, b: int, key: bytes) -> bytearray:
        """Block ``b`` as an encoded daemon block (header, then its pieces in payload order), gathered
        and checksummed in one pass (host tensors with ``piece_addrs``)."""
        addrs = self.piece_addrs(b)
        assert addrs is not None
        header = encode_header(key, self.dtype_str, self.block_shape, self.layout, self.block_bytes)
        out = bytearray(len(header) + self.block_bytes)
        out[: len(header)] = header
        set_checksum(out, native.gather_checksum(header, addrs, self.piece_bytes, memoryview(out)[len(header):]))
        return out

    def check(self, b: int) -> None:
        if not 0 <= b < self.num_blocks:
            raise ValueError(f"block id {b} outside 0..{self.num_blocks - 1}")

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A private host copy of blocks ``block_ids``: ``[len(block_ids), *block_shape]``."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        dim = 1 if self.kv_first else 0
        per_layer = [t.index_select(dim, idx) for t in self.tensors]  # each a fresh copy
        if self.kv_first:  # [2, n, ...] -> [n, 2, ...]
            per_layer = [p.transpose(0, 1) for p in per_layer]
        return torch.stack(per_layer, dim=1).to("cpu").contiguous()

    def upload(self, b: int, payload: np.ndarray) -> None:
        """Copy a verified private host payload (uint8, ``block_bytes``) into block ``b`` on the device."""
        src = torch.from_numpy(payload).view(self.dtype).view(self.block_shape)
        for layer, t in enumerate(self.tensors):
            if self.kv_first:
                t[0, b].copy_(src[layer, 0], non_blocking=False)
                t[1, b].copy_(src[layer, 1], non_blocking=False)
            else:
                t[b].copy_(src[layer], non_blocking=False)


@dataclass
class _Load:
    spec: LoadSpec
    started: float
    deadline: float  # clock time past which it is cancelled (after GRACE_S)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    landed: list[bool] = field(default_factory=list)
    faults: dict[int, str] = field(default_factory=dict)  # index -> corrupt | key | format
    error: str = ""
    seconds: float = 0.0
    nbytes: int = 0


# reader(keys, consume, deadline_s) -> found flags: the client's read_batches
Reader = Callable[[Sequence[bytes], Callable[[list[tuple[int, memoryview]]], None], float], list[bool]]


class Worker:
    def __init__(self, layout: BlockLayout, read: Reader, delete: Callable[[Sequence[bytes]], object],
                 held: Callable[[Sequence[bytes]], Sequence[str | None]] | None,
                 put: Callable[[list[tuple[bytes, bytes]]], object], counters: Counters,
                 save_queue_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.layout, self._read, self._delete, self._held, self._put = layout, read, delete, held, put
        self.counters, self._clock = counters, clock
        self._loads: dict[str, _Load] = {}
        self._load_q: queue.Queue[_Load | None] = queue.Queue()
        self._loader = threading.Thread(target=self._load_loop, name="tierkv-vllm-load", daemon=True)
        self._loader.start()
        self._save_cap = save_queue_bytes
        self._save_bytes = 0
        self._save_cv = threading.Condition()
        self._save_q: list[tuple[list[bytes], torch.Tensor | list[bytearray]] | None] = []
        self._saver = threading.Thread(target=self._save_loop, name="tierkv-vllm-save", daemon=True)
        self._saver.start()
        self._saved: list[bytes] = []
        self._saved_lock = threading.Lock()
        self._meta: TierKVMetadata | None = None
        self._step_t0 = 0.0
        self._steps: list[tuple[list[tuple[int, int]], float]] = []
        self._outcomes: list[LoadOutcome] = []
        self._invalid: set[int] = set()
        self._closed = False

    # -- the step ---------------------------------------------------------------------------
    def bind(self, meta: TierKVMetadata) -> None:
        self._meta = meta
        self._step_t0 = self._clock()

    def start_loads(self) -> None:
        meta = self._meta
        if meta is None:
            return
        for spec in meta.loads:
            if spec.req_id in self._loads:
                continue
            now = self._clock()
            job = _Load(spec, now, now + spec.deadline_s, landed=[False] * len(spec.keys))
            if spec.sync:
                self._run_sync(job)
                continue
            self._loads[spec.req_id] = job
            self._load_q.put(job)
        meta.loads = []  # bind may be followed by more than one start_load_kv: start each load once

    def after_forward(self) -> None:
        """``wait_for_save``: the step's forward has run; time it and gather its saves."""
        meta = self._meta
        if meta is None:
            return
        if meta.seqs and any(n for n, _ in meta.seqs):
            self._steps.append((list(meta.seqs), self._clock() - self._step_t0))
            meta.seqs = []
        for spec in meta.saves:
            self._enqueue_save(spec)
        meta.saves = []

    def finished(self) -> set[str]:
        """Loads that are over (done, failed or cancelled past their deadline): report them once."""
        out: set[str] = set()
        now = self._clock()
        for req_id, job in list(self._loads.items()):
            if not job.done.is_set():
                if now < job.deadline + GRACE_S:
                    continue
                with job.lock:  # no copy is running once we hold it, and none starts after
                    job.cancelled = True
                    if not job.error:
                        job.error = "deadline"
                    job.seconds = now - job.started
            del self._loads[req_id]
            out.add(req_id)
            self._report(job)
        return out

    def load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def worker_meta(self) -> TierKVWorkerMetadata | None:
        with self._saved_lock:
            saved, self._saved = self._saved, []
        steps, self._steps = self._steps, []
        loads, self._outcomes = self._outcomes, []
        if not (steps or loads or saved):
            return None
        return TierKVWorkerMetadata(steps, loads, saved)

    # -- loads -------------------------------------------------------------------------------
    def _report(self, job: _Load) -> None:
        spec = job.spec
        n = 0
        while n < len(job.landed) and job.landed[n]:
            n += 1
        reason = ""
        if n < len(spec.keys):
            if n in job.faults:
                reason = "corrupt"
            elif job.error:
                reason = job.error
            else:
                reason = "missing"
            self._invalid.update(spec.block_ids[n:])
            self.counters.add(f"failed:{reason}", len(spec.keys) - n)
        self.counters.add("blocks:loaded", n)
        self.counters.add("bytes:loaded", n * self.layout.block_bytes)
        self.counters.add("loads")
        self.counters.add("load_seconds", job.seconds)
        bad = [spec.keys[i] for i in sorted(job.faults)]
        self._outcomes.append(LoadOutcome(spec.req_id, n, len(spec.keys), spec.tiers[:n], job.seconds,
                                          n * self.layout.block_bytes, reason, bad))  # fmt: skip
        if reason:
            log.info("tierkv: load of %s stopped at block %d of %d (%s)", spec.req_id, n, len(spec.keys), reason)

    def _run_sync(self, job: _Load) -> None:
        """A load inside the step, on the step's thread, before the forward: bounded by its own
        (short) deadline; what did not land is in ``load_errors`` after this step, never in
        ``finished`` (vLLM scheduled the request already and recomputes from the first bad block)."""
        self._execute(job)
        self.counters.add("sync_loads")
        self._report(job)

    def _load_loop(self) -> None:
        while True:
            job = self._load_q.get()
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: _Load) -> None:
        """Run one load (in the step or on the load thread): its time, and done whatever happens."""
        try:
            self._run_load(job)
        except Exception as e:  # noqa: BLE001 - a failed load is a recompute, never a crash
            with job.lock:
                job.error = job.error or "error"
            log.warning("tierkv: load of %s failed: %s", job.spec.req_id, e)
        finally:
            job.seconds = job.seconds or self._clock() - job.started
            job.done.set()

    def _run_load(self, job: _Load) -> None:
        spec, lay = job.spec, self.layout
        left = job.deadline - self._clock()
        if left <= 0:
            job.error = "deadline"
            return
        for b in spec.block_ids:
            lay.check(b)

        def consume(items: list[tuple[int, memoryview]]) -> None:
            for i, mv in items:
                with job.lock:
                    if job.cancelled:
                        raise _Cancelled
                    self._land(job, i, mv)
            if job.faults:  # the rest is recomputed from the first bad block: stop reading
                raise _Stop

        try:
            self._read(spec.keys, consume, left)
        except (_Cancelled, _Stop):
            pass
        except KVStoreTimeout:
            with job.lock:
                job.error = "deadline"
        except Exception as e:  # noqa: BLE001 - the daemon failed mid-load: keep what landed
            with job.lock:
                job.error = "error"
            log.warning("tierkv: daemon read for %s failed: %s", spec.req_id, e)
        job.seconds = self._clock() - job.started
        bad = [spec.keys[i] for i in job.faults]
        if bad:
            try:
                self._delete(bad)
            except Exception as e:  # noqa: BLE001
                log.warning("tierkv: could not delete %d corrupt blocks: %s", len(bad), e)

    def _land(self, job: _Load, i: int, mv: memoryview) -> None:
        lay, spec = self.layout, job.spec
        try:
            hdr = read_header(mv)
            if hdr.key != spec.keys[i]:
                raise BlockFormatError(f"block {i} carries key {hdr.key.hex()[:16]}")
            if hdr.dtype != lay.dtype_str or tuple(hdr.shape) != lay.block_shape or hdr.layout != lay.layout:
                raise BlockFormatError(f"block {i} is {hdr.dtype} {hdr.shape} {hdr.layout!r}, "
                                       f"vLLM's is {lay.dtype_str} {lay.block_shape} {lay.layout!r}")  # fmt: skip
            if hdr.payload_len != lay.block_bytes:
                raise BlockFormatError(f"block {i} has {hdr.payload_len} payload bytes, not {lay.block_bytes}")
            src = np.frombuffer(mv, dtype=np.uint8, offset=hdr.size, count=hdr.payload_len)
            b = spec.block_ids[i]
            addrs = lay.piece_addrs(b)
            if addrs is not None:
                native.scatter_verify(hdr, src, addrs, lay.piece_bytes)  # checks what landed
            elif lay.on_host:
                pieces = lay.host_pieces(b)
                off = 0
                for p in pieces:
                    p[:] = src[off : off + p.nbytes]
                    off += p.nbytes
                verify_payload(hdr, pieces)  # what landed, not what was sent
            else:
                private = src.copy()
                verify_payload(hdr, [private])
                lay.upload(b, private)
            job.landed[i] = True
        except ChecksumError:
            job.faults[i] = "corrupt"
        except BlockFormatError:
            job.faults[i] = "format"
        self.counters.add("bytes:read", mv.nbytes)

    # -- saves -------------------------------------------------------------------------------
    def _enqueue_save(self, spec: SaveSpec) -> None:
        n = len(spec.keys)
        need = n * self.layout.block_bytes
        with self._save_cv:
            if self._save_bytes + need > self._save_cap:
                self.counters.add("blocks:save_dropped", n)
                return
            self._save_bytes += need
        try:
            lay = self.layout
            data: torch.Tensor | list[bytearray]
            if lay.piece_addrs(0) is not None:  # host: encoded now, in one pass per block
                for b in spec.block_ids:
                    lay.check(b)
                data = [lay.encode(b, k) for b, k in zip(spec.block_ids, spec.keys, strict=True)]
            else:
                data = lay.gather(spec.block_ids)
        except Exception as e:  # noqa: BLE001 - a save that cannot be gathered is dropped, counted
            with self._save_cv:
                self._save_bytes -= need
            self.counters.add("blocks:save_dropped", n)
            log.warning("tierkv: could not gather %d blocks to save: %s", n, e)
            return
        with self._save_cv:
            self._save_q.append((list(spec.keys), data))
            self._save_cv.notify_all()

    def _save_loop(self) -> None:
        while True:
            with self._save_cv:
                while not self._save_q:
                    self._save_cv.wait()
                item = self._save_q.pop(0)
            if item is None:
                return
            keys, data = item
            try:
                self._send(keys, data)
            except Exception as e:  # noqa: BLE001 - saves are best effort: a miss later, never an error now
                self.counters.add("blocks:save_dropped", len(keys))
                log.warning("tierkv: save of %d blocks failed: %s", len(keys), e)
            finally:
                with self._save_cv:
                    self._save_bytes -= len(keys) * self.layout.block_bytes
                    self._save_cv.notify_all()

    def _send(self, keys: list[bytes], data: torch.Tensor | list[bytearray]) -> None:
        todo = list(range(len(keys)))
        if self._held is not None:
            held = self._held(keys)
            todo = [i for i in todo if held[i] is None]
            self.counters.add("blocks:save_skipped", len(keys) - len(todo))
        items: list[tuple[bytes, bytes | bytearray]] = []
        for i in todo:
            if isinstance(data, list):  # encoded when it was gathered
                items.append((keys[i], data[i]))
                continue
            arr, dt = to_block_array(data[i])
            items.append((keys[i], encode_block(keys[i], arr, dtype=dt, shape=self.layout.block_shape,
                                                layout=self.layout.layout)))  # fmt: skip
        if items:
            self._put(items)
            self.counters.add("blocks:saved", len(items))
            self.counters.add("bytes:saved", sum(len(v) for _, v in items))
        with self._saved_lock:
            self._saved += [keys[i] for i in todo]

    def drain_saves(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save is sent (or dropped); False on timeout."""
        end = self._clock() + timeout_s
        with self._save_cv:
            while self._save_q or self._save_bytes:
                left = end - self._clock()
                if left <= 0:
                    return False
                self._save_cv.wait(min(left, 0.1))
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain_saves(timeout_s)
        for job in self._loads.values():
            with job.lock:
                job.cancelled = True
        self._load_q.put(None)
        with self._save_cv:
            self._save_q.append(None)
            self._save_cv.notify_all()
        self._loader.join(timeout_s)
        self._saver.join(timeout_s)


class _Cancelled(Exception):
    pass


class _Stop(Exception):
    pass
