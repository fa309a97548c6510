"""bench/cold_disk.py on a real file mapped by another process, as the daemon maps its lmdb file:
the per-file drop alone leaves the mapped pages cached (so the e2e "disk" points were page cache),
paging them out of the mapping process first makes the file cold, and mincore says so."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cold_disk import ColdDiskError, evict, lmdb_files, mapped_ranges, residency

pytestmark = pytest.mark.timeout(60)
MAPPER = """
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
sum(m[i] for i in range(0, len(m), 4096))  # every page faulted in, as lmdb's reads do
print("mapped", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def mapped_file(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "data.mdb"
    with open(path, "wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        os.fsync(f.fileno())
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "mapped"
        yield path, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_file_another_process_maps_stays_cached_without_its_page_out(mapped_file) -> None:
    path, _pid = mapped_file
    assert residency([path]) == 1.0
    res = evict([path])  # the per-file drop alone: the mapper's pages stay
    assert not res.verified and res.resident_after > 0.9 and "MADV_PAGEOUT" not in res.method
    with pytest.raises(ColdDiskError):
        evict([path], require=True)


def test_paging_out_the_mapper_first_makes_it_cold_and_says_how(mapped_file) -> None:
    path, pid = mapped_file
    assert mapped_ranges(pid, [path]) and residency([path]) == 1.0
    res = evict([path], [pid], require=True)
    assert res.verified and res.resident_before == 1.0 and res.resident_after <= 0.05
    assert res.method == "process_madvise(MADV_PAGEOUT)+posix_fadvise(DONTNEED)"
    assert res.paged_out_bytes >= 8 << 20


def test_lmdb_files_lists_the_environment(tmp_path: Path) -> None:
    (tmp_path / "data.mdb").write_bytes(b"x")
    (tmp_path / "lock.mdb").write_bytes(b"y")
    (tmp_path / "other.txt").write_bytes(b"z")
    assert [p.name for p in lmdb_files(tmp_path)] == ["data.mdb", "lock.mdb"]
    assert lmdb_files(tmp_path / "absent") == []
