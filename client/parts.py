"""The parts of a client, each with one job, built from its options and handed to one
another at construction: ``NodeDirectory`` (``client.nodes.directory``: registry,
suspects, connections), ``NamespaceRegistration`` (``client.lookups.registration``),
``PrefixLookup`` (``client.lookups.prefix``), ``Publisher`` (``client.puts.publish``),
``PageWriter`` (``client.puts.writes``: every put, as a plan through its source's
handler), ``ReplicaFetcher`` (``client.gets.fetch``), ``PageReader`` (``client.gets.reads``: the get
variants, landing as ``client.gets.landing`` chooses) and ``LookupBuffer``
(``client.sequences``: insert/select). Host buffers are
``client.memory.staging.HostBuffers`` (one pool per process).

Called once per client, by ``AsyncKVCacheClient.__init__`` (``client_parts``). It
guarantees that the parts of one client share one index connection, one node directory,
one ``ClientStats``, the process's host buffers and one device copier, and that nothing
here connects, reads or starts a thread: ``AsyncKVCacheClient.start`` does that."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from client.gets.fetch import ReplicaFetcher
from client.gets.reads import PageReader
from client.lookups.prefix import PrefixLookup
from client.lookups.registration import NamespaceRegistration
from client.memory.device_pages import DeviceCopier
from client.memory.staging import HostBuffers, host_buffers
from client.nodes.directory import NodeDirectory
from client.puts.publish import Publisher
from client.puts.writes import PageWriter
from client.sequences import LookupBuffer
from client.stats import ClientStats
from kvstore.index import AsyncPageIndex
from kvstore.index.routing import INDEX_TIMEOUT
from kvstore.pages.heads import RankUnits
from kvstore.pages.namespace import Namespace
from kvstore.settings.client import ClientOptions


@dataclass(frozen=True, slots=True)
class ClientParts:
    """One client's parts, as ``client_parts`` built and wired them."""

    stats: ClientStats
    device: DeviceCopier | None
    index: AsyncPageIndex
    nodes: NodeDirectory
    registration: NamespaceRegistration
    lookups: PrefixLookup
    publisher: Publisher
    writer: PageWriter
    buffers: HostBuffers
    reader: PageReader
    sequences: LookupBuffer


def client_parts(
    opts: ClientOptions,
    namespace: Namespace,
    heads: RankUnits,
    device: Callable[[ClientStats], DeviceCopier | None],
) -> ClientParts:
    """The parts of a client of ``namespace`` whose rank holds the head groups
    ``heads``, under ``opts``; ``device`` builds the device copier that gets land with
    (CUDA's where a GPU is, else none: ``client.memory.device_pages.default_copier``; a
    test passes ``HostCopier``)."""
    storage = namespace.storage
    stats = ClientStats()
    copier = device(stats)
    index = AsyncPageIndex(
        opts.redis_url,
        timeout=min(opts.timeout, INDEX_TIMEOUT),
        lease_ms=opts.lease_ms,
        password=opts.redis_password.get_secret_value() or None,
    )
    nodes = NodeDirectory(
        index,
        stats,
        token=opts.auth_token.get_secret_value(),
        same_host=opts.same_host,
        refresh=opts.node_refresh,
        device=copier,
    )
    registration = NamespaceRegistration(index, storage)
    lookups = PrefixLookup(index, storage, heads, nodes, registration, stats)
    fetcher = ReplicaFetcher(nodes, stats, storage.key, opts.timeout)
    publisher = Publisher(
        nodes,
        registration,
        stats,
        namespace,
        heads,
        replicas=opts.replicas,
        timeout=opts.timeout,
    )
    writer = PageWriter(publisher, lookups, namespace, heads)
    buffers = host_buffers()
    reader = PageReader(
        lookups, fetcher, namespace, heads, stats, buffers, opts.transfer_mode, copier
    )
    sequences = LookupBuffer(namespace, heads, writer, reader)
    return ClientParts(
        stats,
        copier,
        index,
        nodes,
        registration,
        lookups,
        publisher,
        writer,
        buffers,
        reader,
        sequences,
    )
