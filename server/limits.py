"""What a peer can take from a node before it has shown a credential, and logging
that an attacker cannot turn into a flood.

The node's data plane calls these; docs/security.md lists the resulting limits per
path (descriptors, bytes, time, connections)."""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field

from prometheus_client import Counter

log = logging.getLogger(__name__)

# Descriptors kept back from the connection budget: pool memfds are counted apart;
# this covers the index connections, the metrics server, UCX's own sockets and
# event fds, and the slab descriptors a same-host request lends (at most
# SCM_MAX_FD = 253 open at once per request, see DataPlane._lend).
RESERVED_DESCRIPTORS = 512
MAX_CONNECTIONS = 16_384


def raise_descriptor_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (servers need more
    than the usual soft 1,024) and return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d: %s", soft, exc)
    return soft


def connection_budget(descriptor_limit: int, pool_descriptors: int) -> int:
    """Connections (UCX and Unix together) a node with ``descriptor_limit`` open files
    admits at once when ``--max-connections`` is 0: a quarter of what is left after the
    pool's memfds and ``RESERVED_DESCRIPTORS``, so that connections can never take the
    descriptors the node needs to lend slabs, reach the index or accept the next
    connection (each UCX connection also holds a few internal descriptors)."""
    spare = descriptor_limit - pool_descriptors - RESERVED_DESCRIPTORS
    return max(8, min(MAX_CONNECTIONS, spare // 4))


@dataclass
class RateLimitedLog:
    """Logs each kind of line (its message template) at most once per ``interval``
    seconds, with the number of lines of that kind left out since the last one. Who
    calls it: every place where a remote peer can cause a log line (refused
    connections, protocol errors, accept errors, failed handshakes), so that a peer
    cannot flood the log, nor hide one kind of line behind a flood of another."""

    logger: logging.Logger
    interval: float = 10.0
    level: int = logging.WARNING
    _last: dict[str, tuple[float, int]] = field(
        default_factory=dict, repr=False
    )  # template -> (logged at, left out since)

    def __call__(self, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line of this template went out within
        ``interval``; True if logged."""
        now = time.monotonic()
        last, left_out = self._last.get(message, (-1e18, 0))
        if now - last < self.interval:
            self._last[message] = (last, left_out + 1)
            return False
        self._last[message] = (now, 0)
        if left_out:
            self.logger.log(
                self.level,
                message + " (%d more like it in the last %.0f s)",
                *args,
                left_out,
                now - last,
            )
        else:
            self.logger.log(self.level, message, *args)
        return True


class HandshakeFailures(logging.Filter):
    """Turns ucxx's traceback for a connection that failed in its listener handshake
    into a count and a rate-limited line.

    ucxx 0.52 exchanges peer info before it calls the node's listener callback; when
    the client aborts or stalls meanwhile (ordinary: a client that gave up, a port
    scanner, a health probe), its ``_listener_handler_coroutine`` logs "Unexpected
    error in listener handler coroutine" with a whole traceback on the ``ucx`` logger
    (measured: 37 tracebacks in 10,000 connect/abort cycles, and one each time a
    connection stalls past the 5 s handshake timeout). The node installs this filter
    on that logger; every other ucxx record passes untouched."""

    MESSAGE = "Unexpected error in listener handler coroutine"

    def __init__(self, count: Counter, interval: float = 10.0) -> None:
        super().__init__()
        self.count = count  # a prometheus Counter
        self.log = RateLimitedLog(log, interval)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not (args and args[0] == self.MESSAGE):
            return True
        self.count.inc()
        detail = (
            str(args[1]).strip().splitlines()[-1]
            if len(args) > 1 and str(args[1]).strip()
            else "unknown error"
        )
        self.log("a UCX client connection failed during ucxx's handshake: %s", detail)
        return False
