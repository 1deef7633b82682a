"""A slow link where the kernel has no netem: a relay in the router namespace that holds
each packet to and from one host for a delay with jitter (and drops a share of them).

tests/support/netns_fixtures.py ``Network.slow`` steers the host's traffic through two TUN
devices of the router's with policy routing:

- toward the host: the router's main table sends the host's /32 into ``<tun>i``; the
  relay reads each packet there and, after its delay, writes it back into the same
  device, where a rule for packets coming in from it (``iif``) routes them out of the
  host's veth;
- from the host: a rule for packets coming in from the host's veth routes everything
  into ``<tun>o``; written back after the delay, they take the main table on.

Packets keep their order in each direction (a packet never leaves before the one ahead
of it, as netem keeps order unless told to reorder). Run as ``python -m tests.support.slow_link
<in-tun> <out-tun> <delay-ms> <jitter-ms> <loss>`` inside the router namespace; prints
"ready" once both devices are open, and runs until killed."""

from __future__ import annotations

import asyncio
import fcntl
import os
import random
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name: str) -> int:
    """A TUN device ``name`` (made if missing), non-blocking, without packet info."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Direction:
    """One way through the relay: packets read from ``fd`` go back into it after
    ``delay`` +- ``jitter`` seconds, in order; ``loss`` of them never do."""

    def __init__(self, fd: int, delay: float, jitter: float, loss: float) -> None:
        self.fd, self.delay, self.jitter, self.loss = fd, delay, jitter, loss
        self.last_due = 0.0
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    def on_readable(self) -> None:
        while True:
            try:
                packet = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            if random.random() < self.loss:
                continue
            due = time.monotonic() + self.delay + random.uniform(-self.jitter, self.jitter)
            self.last_due = max(due, self.last_due)  # in order, as netem keeps it
            self.queue.put_nowait((self.last_due, packet))

    async def send(self) -> None:
        while True:
            due, packet = await self.queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                os.write(self.fd, packet)
            except OSError:
                pass  # a packet the stack refused is a lost packet


async def relay(tun_in: str, tun_out: str, delay_ms: float, jitter_ms: float, loss: float) -> None:
    loop = asyncio.get_running_loop()
    directions = [
        Direction(open_tun(name), delay_ms / 1000, jitter_ms / 1000, loss)
        for name in (tun_in, tun_out)
    ]
    for d in directions:
        loop.add_reader(d.fd, d.on_readable)
    print("ready", flush=True)
    await asyncio.gather(*(d.send() for d in directions))


if __name__ == "__main__":
    tun_in, tun_out, delay, jitter, loss = sys.argv[1:6]
    asyncio.run(relay(tun_in, tun_out, float(delay), float(jitter), float(loss)))
