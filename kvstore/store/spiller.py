"""The write-back half of the TieredStore: one worker thread landing queued blocks.

Only this thread writes to levels below the top, which keeps each level's capacity accounting
single-writer: it picks victims, moves them one level down (a new queued job), deletes them,
and only then writes the new block, so a tier never holds more than its configured bytes.
Victims stay readable while they move (``Level.leaving``, then ``StoreState.pending``). A level
that is detached is skipped and counted (the block goes on below); a level whose admission rule
refuses the block drops it. A level that says it is full (TierFull: a fragmented lmdb map) gets
victims worth the block evicted and one more try; then the block goes on below. A victim of a
shared level (Redis, S3) is copied down but not deleted from the shared server: other nodes may
be reading it, and that server's own policy reclaims it.

The worker also replays a level's backlog when the prober attaches it again (``replay``,
kvstore/store/replay.py): a batch of keys per turn, each read from where it still lives and
landed like a write-through copy, then the rest queued again behind the jobs that came meanwhile,
so a long backlog neither delays other spills for long nor holds more than one block in memory.
A block that could land nowhere while a level below that skipped it is detached is parked for its
replay (kvstore/store/parked.py) rather than dropped.
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore.store.replay import BATCH, Replay
from kvstore.store.shared_state import Job, StoreState
from kvstore.store.spill_queue import ByteBoundedQueue
from kvstore.store.tier_bookkeeping import Level
from tiers.errors import TierFull

log = logging.getLogger(__name__)
WARN_EVERY_S = 10.0  # the spill-queue timeout's log line, at most this often


class Spiller:
    def __init__(self, state: StoreState, max_bytes: int, put_timeout_s: float | None = None) -> None:
        """``put_timeout_s``: how long a client's call may wait for room in the full queue (None: for ever)."""
        self._c = state
        self._queue: ByteBoundedQueue[Job | Replay] = ByteBoundedQueue(max_bytes, _queued_bytes)
        self._put_timeout_s = put_timeout_s
        self.timeouts = 0  # jobs a client's call could not queue in time (not stored below)
        self._warned_at = -WARN_EVERY_S
        self._thread = threading.Thread(target=self._work, name="tierkv-spill", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[Job], force: bool = False) -> None:
        """Queue jobs; waits while the queue is full unless ``force`` (the worker's own jobs).

        A job that cannot be queued within ``put_timeout_s`` (all of them together) is given up:
        the block is not stored below (a block leaving a level is no longer pending, so no level
        claims it), counted in ``timeouts``. The caller's call goes on; a cache may drop a copy."""
        deadline = None if force or self._put_timeout_s is None else time.monotonic() + self._put_timeout_s
        for i, job in enumerate(jobs):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._queue.put(job, force=force, timeout=left):
                self._give_up(jobs[i:])
                return

    def _give_up(self, jobs: list[Job]) -> None:
        with self._c.lock:
            self.timeouts += len(jobs)
            for job in jobs:
                if job.move and self._c.pending.get(job.key) is job:
                    del self._c.pending[job.key]
                    self._c.forget_if_gone(job.key)
            now, warn = time.monotonic(), self._warned_at
            self._warned_at = now if now - warn >= WARN_EVERY_S else warn
        if now - warn >= WARN_EVERY_S:  # one line per WARN_EVERY_S, however many give up
            log.warning("spill queue full for %.1f s: %d block(s) not stored below (%d so far)",
                        self._put_timeout_s or 0, len(jobs), self.timeouts)

    def replay(self, target: int, keys: list[bytes]) -> None:
        """Queue the replay of ``keys`` (a level's backlog) into level ``target``, just attached again
        (the prober's call, under the store lock: it never waits; the item holds keys, not bytes)."""
        if keys:
            self._queue.put(Replay(target, keys), force=True)

    def flush(self, timeout: float | None = None) -> bool:
        return self._queue.join(timeout)

    @property
    def pending_jobs(self) -> int:
        return self._queue.unfinished

    @property
    def pending_bytes(self) -> int:
        return self._queue.pending_bytes

    def close(self) -> None:
        self._queue.close()
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if isinstance(job, Replay):
                    self._replay(job)
                else:
                    self._land(job)
            except Exception:  # noqa: BLE001 - the worker must survive anything
                what = f"replay into level {job.target}" if isinstance(job, Replay) else f"spill of {job.key.hex()[:16]}"
                log.exception("%s failed", what)
            finally:
                self._queue.task_done()

    def _still_wanted(self, job: Job) -> bool:
        return self._c.pending.get(job.key) is job if job.move else self._c.holds(job.key)

    def _land(self, job: Job) -> bool:
        """Write a queued block into its target level (or below, if that level is down): whether it
        was written somewhere."""
        size = len(job.value)
        for i in range(job.target, len(self._c.levels) if job.move else job.target + 1):
            lv = self._c.levels[i]
            with self._c.lock:
                if not self._still_wanted(job):
                    return False
                if job.key in lv.index:  # already there (inclusive chain): nothing to write
                    lv.touch(job.key)
                    break
                if not lv.available():
                    self._c.skipped(lv, job.key)
                    continue
                if size > lv.capacity:
                    continue
                if self._c.hits.get(job.key, 0) < lv.options.admit_min_hits:
                    lv.counters.dropped += 1
                    break
                victims = lv.pick_victims(size)
            for vkey, _ in victims:
                self._evict_lower(i, vkey)
            err = self._write(i, lv, job)
            if err is not None:
                if not isinstance(err, TierFull):  # a refusal for room is not retried: the tier chose
                    with self._c.lock:  # failed: replayed at its next attach, or by the prober's retry
                        lv.remember(job.key)  # of an attached level's backlog
                    self._c.prober.wake()
                continue
            with self._c.lock:
                if self._still_wanted(job):
                    lv.add(job.key, size)
                    lv.counters.spills += 1
                    lv.counters.write_bytes += size
                    if job.move:
                        self._c.pending.pop(job.key, None)
                    self._c.unpark(job.key)  # a replay landed a parked block: a level holds it now
                    return True
            self._c.guard(lv, lambda lv=lv: lv.tier.delete(job.key))  # deleted meanwhile
            return False
        with self._c.lock:  # nowhere to land (admission, or every level below is down)
            if job.move and self._c.pending.get(job.key) is job:
                if (waiting := self._replay_level(job)) is not None and self._c.park(job):
                    waiting.counters.replay_parked += 1  # kept for that replay (kvstore/store/parked.py)
                    return False
                if self._c.pending.get(job.key) is job:
                    del self._c.pending[job.key]
                    self._c.forget_if_gone(job.key)
        return False

    def _replay_level(self, job: Job) -> Level | None:
        """The first level at or below ``job``'s target that skipped its block and will replay it
        once attached again (None: none will; caller holds the lock)."""
        return next((lv for lv in self._c.levels[job.target:] if job.key in lv.backlog), None)

    def _replay(self, r: Replay) -> None:
        """Replay one batch of a backlog, then queue the rest behind the jobs queued meanwhile."""
        end = r.start + BATCH
        for key in r.keys[r.start:end]:
            self._replay_one(r.target, key)
        if end < len(r.keys):
            self._queue.put(Replay(r.target, r.keys, end), force=True)

    def _replay_one(self, i: int, key: bytes) -> None:
        """Write ``key`` into level ``i`` from wherever the store still holds it (verified as any
        read), as a write-through copy; a key held nowhere any more is skipped."""
        lv = self._c.levels[i]
        with self._c.lock:
            if not lv.available():  # detached again: kept for its next attach
                lv.remember(key)
                return
            if key in lv.index:  # landed meanwhile (a spill): nothing to write
                return
            job = self._c.pending.get(key)  # on its way down: its queued bytes are immutable
            src = None if job is not None else self._c.first_level(key)
        if job is not None:
            data: bytes | None = job.value
        else:  # read from the level holding it; None: deleted, or evicted with nowhere to go
            data = None if src is None else self._read(src, key)
        if data is None:
            with self._c.lock:
                lv.counters.replay_skipped += 1
            return
        if self._land(Job(key, data, i, False)):
            with self._c.lock:
                lv.counters.replayed += 1

    def _read(self, src: int, key: bytes) -> bytes | None:
        """``key``'s intact bytes from level ``src`` (None: gone meanwhile, a tier error, or a bad
        block, deleted there and counted by ``intact``)."""
        lv = self._c.levels[src]
        raw = self._c.guard(lv, lambda: lv.tier.get(key))
        if raw is None:
            return None
        data = bytes(raw)
        del raw  # the top tier's view pinned its bytes while they were copied
        if not lv.tier.in_process and not self._c.intact(lv, key, data):
            return None
        return data

    def _write(self, i: int, lv: Level, job: Job) -> Exception | None:
        """Put the block into level i; a TierFull evicts victims worth it and tries once more. The
        error that stopped it (None: written)."""
        err: Exception | None = None
        for again in (False, True):
            t0 = time.perf_counter()
            try:
                lv.tier.put(job.key, job.value)
            except Exception as e:  # noqa: BLE001 - counted (a TierFull as a refusal), never raised
                self._c.fail(lv, e)
                if again or not isinstance(e, TierFull):
                    return e
                err = e
                with self._c.lock:
                    victims = lv.make_room(len(job.value))
                for vkey, _ in victims:
                    self._evict_lower(i, vkey)
                continue
            self._c.ok(lv)
            self._c.obs.write(lv.name, len(job.value), time.perf_counter() - t0)
            return None
        return err

    def _evict_lower(self, i: int, vkey: bytes) -> None:
        """Move a victim of level i (i > 0) one level down; runs on the worker thread."""
        lv = self._c.levels[i]
        raw = self._c.guard(lv, lambda: lv.tier.get(vkey))
        if raw is not None and not self._c.intact(lv, vkey, raw):  # deleted and counted: a bad block is
            return  # never carried down (a shared tier below would sign it, and then serve it)
        jobs: list[Job] = []
        with self._c.lock:
            if lv.remove(vkey) is None:  # deleted meanwhile
                return
            self._c.evicted(lv, vkey)
            if raw is not None and not self._c.holds(vkey):
                jobs = self._c.move_down(vkey, bytes(raw), i + 1)
            self._c.forget_if_gone(vkey)
        if not lv.options.shared:  # a shared server's own policy (maxmemory, TTL) reclaims it
            self._c.guard(lv, lambda: lv.tier.delete(vkey))
        self.submit(jobs, force=True)


def _queued_bytes(item: Job | Replay) -> int:
    """What an item holds in the queue's memory: a block's bytes (a replay holds keys only)."""
    return len(item.value) if isinstance(item, Job) else 0
