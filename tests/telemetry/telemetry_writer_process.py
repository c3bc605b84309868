"""A stand-alone "gateway process" for the merge test: records seeded events into Redis and exits.

usage: python telemetry_writer_process.py REDIS_URL KEY_PREFIX SEED COUNT NOW
"""

import asyncio
import sys

from tests.telemetry.telemetry_events import make_events, make_telemetry


async def main(url: str, prefix: str, seed: int, count: int, now: float) -> None:
    telemetry = make_telemetry(url, metrics_key_prefix=prefix, flush_batch=200)
    await telemetry.start()
    for event in make_events(seed, count, now=now):
        telemetry.record(event)
        if telemetry.writer.buffered >= 1000:
            await asyncio.sleep(0)  # let the writer run, as a serving loop would
    await telemetry.aclose(timeout_s=10)
    print(f"written={telemetry.writer.written} dropped={telemetry.dropped}")


if __name__ == "__main__":
    url, prefix, seed, count, now = sys.argv[1:6]
    asyncio.run(main(url, prefix, int(seed), int(count), float(now)))
