"""Fingerprint blobs are tenant-controlled in size and number (a 30k-message prompt makes a
~1 MB blob; family names can be 1 MB strings): the memory they hold is bounded in bytes, per
tenant and in all, in the writer's queue and in the in-process store."""

from __future__ import annotations

import tracemalloc

from gateway.config.settings import Settings
from gateway.telemetry import Telemetry, store, writer
from gateway.telemetry.store import MemoryStore

MB = 2**20


def test_queued_blobs_are_bounded_in_bytes_per_tenant_and_in_all():
    telemetry = Telemetry(MemoryStore(retention_s=3600), Settings())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(60):  # 60 distinct 1 MB family names, each with a 1 MB blob
            telemetry.put_fingerprints("attacker", f"{i}:" + "f" * MB, b"\x01" * MB)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    queued = telemetry.writer.blob_bytes
    assert 0 < queued <= writer.BLOBS_TENANT_MAX_BYTES
    assert grown < writer.BLOBS_TENANT_MAX_BYTES + 2 * MB, grown  # not 120 MB
    assert telemetry.writer.blobs_dropped >= 60 - writer.BLOBS_TENANT_MAX_BYTES // (2 * MB)

    # Another tenant still gets its own share, and reads back its own latest blob.
    telemetry.put_fingerprints("victim", "gpt", b"victim-blob")
    assert telemetry.writer.pending_blob("victim", "gpt") == b"victim-blob"

    # Replacing a blob counts its new size, not both.
    telemetry.put_fingerprints("victim", "gpt", b"v2" * 1000)
    expected = store.blob_bytes("gpt", b"v2" * 1000)
    assert telemetry.writer._tenant_blob_bytes["victim"] == expected


def test_queue_bound_in_all(monkeypatch):
    monkeypatch.setattr(writer, "BLOBS_MAX_BYTES", 3 * MB)
    telemetry = Telemetry(MemoryStore(retention_s=3600), Settings())
    for tenant in range(10):
        telemetry.put_fingerprints(f"t{tenant}", "gpt", b"\x00" * MB)
    assert telemetry.writer.blob_bytes <= 3 * MB
    assert telemetry.writer.blobs_dropped == 10 - 2  # a MB and a bit each: two fit


async def test_queue_bytes_are_released_once_written():
    telemetry = Telemetry(MemoryStore(retention_s=3600), Settings())
    for i in range(3):
        telemetry.put_fingerprints("acme", f"fam{i}", b"\x02" * 1000)
    assert telemetry.writer.blob_bytes > 3000
    await telemetry.writer.drain()
    assert telemetry.writer.blob_bytes == 0 and telemetry.writer._tenant_blob_bytes == {}
    assert await telemetry.get_fingerprints("acme", "fam1") == b"\x02" * 1000


async def test_memory_store_evicts_a_tenants_oldest_blobs_past_its_share():
    memory = MemoryStore(retention_s=3600)
    await memory.write({}, {("victim", "gpt"): (b"victim-blob", 3600)})
    for i in range(40):
        await memory.write({}, {("attacker", f"{i}:" + "f" * MB): (b"\x01" * MB, 3600)})
    assert memory.blob_bytes <= store.MEMORY_BLOBS_TENANT_MAX_BYTES + 1000
    assert await memory.get_blob("victim", "gpt") == b"victim-blob"
    newest = await memory.get_blob("attacker", "39:" + "f" * MB)
    oldest = await memory.get_blob("attacker", "0:" + "f" * MB)
    assert newest == b"\x01" * MB and oldest is None


async def test_memory_store_total_bound_evicts_from_the_biggest_tenant(monkeypatch):
    monkeypatch.setattr(store, "MEMORY_BLOBS_MAX_BYTES", 4 * MB)
    memory = MemoryStore(retention_s=3600)
    await memory.write({}, {("small", "gpt"): (b"s" * 1000, 3600)})
    for i in range(6):
        await memory.write({}, {(f"t{i % 2}", f"fam{i}"): (b"\x00" * MB, 3600)})
    assert memory.blob_bytes <= 4 * MB
    assert await memory.get_blob("small", "gpt") == b"s" * 1000
    held = {
        t: sum([await memory.get_blob(t, f"fam{i}") is not None for i in range(6)])
        for t in ("t0", "t1")
    }
    assert sorted(held.values()) == [1, 2]


async def test_oversized_blob_is_refused_everywhere():
    memory = MemoryStore(retention_s=3600)
    huge = b"\x00" * (store.MEMORY_BLOBS_TENANT_MAX_BYTES + 1)
    await memory.write({}, {("acme", "gpt"): (huge, 3600)})
    assert memory.blob_bytes == 0 and await memory.get_blob("acme", "gpt") is None
    telemetry = Telemetry(memory, Settings())
    telemetry.put_fingerprints("acme", "gpt", b"\x00" * (writer.BLOBS_TENANT_MAX_BYTES + 1))
    assert telemetry.writer.blob_bytes == 0 and telemetry.writer.blobs_dropped == 1
