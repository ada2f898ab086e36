"""Many ``rsagg run`` nodes sharing one state and one blob store: heartbeats and source leases.

With ``[cluster] enabled = true`` a ``rsagg run`` process is a *node* (``cluster.node``, default
hostname-pid). It harvests only the sources whose lease it holds; every node serves the whole
republished Source from the shared state, so a plain load balancer can sit in front of them.

- **Heartbeat** every third of ``cluster.lease_seconds``: the node's row in ``nodes`` (alive for one
  lease time, with the sources it follows: ``follows``), then its leases are renewed. A lease that could
  not be renewed (it expired: the node was paused, or the state was out of reach) is lost: its task is
  cancelled, nothing of it may be written.
- **Balance**: each node aims at ``ceil(sources / live nodes)`` leases. It claims free or expired ones
  up to that share and releases what it holds beyond it (after its task's in-flight commit), so a node
  that starts takes its share from the others and a dead node's sources are taken over once its leases
  expire: within ``lease_seconds`` plus one beat of its death. The new holder resumes from the cursors.
- **Fencing**: each grant increments the source's epoch. The source's task runs under its ``Fence``
  (``store.interface.fenced``): every state write checks, in its own transaction, that the grant is still
  current, else raises ``LeaseLost`` and writes nothing; the task stops and the loss is counted
  (``rsagg_cluster_fenced_writes_total``). A node that stalls past its lease can never overwrite the
  newer holder's rows, changelog or cursor.
- **Politeness across nodes**: a host's ``harvest.per_host`` is split among the live nodes that hold a
  source on that host (``Fetcher.set_host_shares``; hosts no source names: among all live nodes), so the
  concurrency a host sees does not grow with the number of nodes. Why not host slots leased in the state:
  a state round trip per request would cost more than the request on a fast upstream, and the split is
  exact whenever a host's sources are spread over the nodes that hold them (the usual case: a host's
  sources belong to one node, which then gets the host's whole ``per_host``).

The lease history (``lease_history``: source, epoch, node, from, to) lets anyone check that the grants
of a source never overlapped. Everything here goes through ``StateStore`` methods, so it works the same
on every state backend (docs/cluster.md, "How it holds together").
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import trio

from ..config import Config, SourceConfig
from ..rs.w3cdt import utcnow
from ..store.calls import in_thread
from ..store.interface import Fence, LeaseLost, NodeRow, StateStore, fenced
from ..store.nodes import alive, follows

if TYPE_CHECKING:
    from ..observe.metrics import Metrics

log = logging.getLogger("rsagg.cluster")

#: Seconds a clean stop waits for a source's in-flight commit before releasing its lease anyway (the
#: fence refuses whatever that task would still write).
RELEASE_WAIT = 10.0


def node_name(config: Config) -> str:
    """``cluster.node``, or hostname-pid when unset (a restarted process is a new node)."""
    return config.cluster.node or f"{socket.gethostname()}-{os.getpid()}"


def host_of(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


StartSource = Callable[[SourceConfig, Fence], None]
StopSource = Callable[[str], trio.Event]


class HostShares(Protocol):
    """Where the per-host request limits are split among the nodes (``harvest/fetch.py``'s ``Fetcher``)."""

    def set_host_shares(self, sharers: dict[str, int], default: int) -> None: ...


class Node:
    """This process as a cluster node: it decides which sources the daemon harvests (``run``).

    ``state`` is the node's own handle, opened and closed by whoever built it (compose.py's
    ``start_node``): not the harvester's, so beats never queue behind this process's harvest writes."""

    @property
    def config(self) -> Config:
        """The running configuration."""
        return self.get_config()

    def __init__(
        self,
        get_config: Callable[[], Config],
        *,
        state: StateStore,
        start: StartSource,
        stop: StopSource,
        metrics: Metrics | None,
        fetcher: HostShares | None,
        roles: Mapping[str, Callable[[], Awaitable[Any]]],
    ) -> None:
        """``get_config``: the running configuration (a reload replaces it: the next beat follows);
        ``fetcher``: where the per-host limits are split among the nodes (the harvest's ``Fetcher``)."""
        self.get_config = get_config
        config = get_config()
        self.name = node_name(config)
        self.lease_seconds = config.cluster.lease_seconds
        self.state = state
        self.held: dict[str, Fence] = {}
        self._start, self._stop = start, stop
        self._stopping: dict[str, trio.Event] = {}  # source -> its task's end, while being released
        self.metrics = metrics
        self.fetcher = fetcher
        self.live: list[NodeRow] = []
        self.beats = 0
        self._nursery: trio.Nursery | None = None
        #: Work one node of the cluster does at a time (e.g. "@dumps": building the dumps), each run
        #: while this node holds the lease of that name (names start with "@": never a source's).
        self.roles = dict(roles)
        self.roles_held: dict[str, tuple[Fence, trio.CancelScope]] = {}
        if metrics is not None:
            metrics.cluster_node_info.labels(self.name).set(1)

    @property
    def beat_every(self) -> float:
        return self.lease_seconds / 3

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A state call in a worker thread (on SQLite too: a lease write may wait for another handle's
        commit), never abandoned: a claim or release started is finished."""
        return await in_thread(partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------ the loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Beat until cancelled; then release every lease held (after each task's last commit). The state
        handle stays open: its owner closes it after this returns."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                while True:
                    try:
                        await self.beat()
                    except Exception as exc:  # the state is out of reach: try again; leases lapse
                        log.error("node=%s heartbeat failed: %s: %s", self.name, type(exc).__name__, exc)
                    if self.beats == 1:
                        task_status.started()
                    await trio.sleep(self.beat_every)
        finally:
            with trio.move_on_after(RELEASE_WAIT + 5) as cleanup:
                cleanup.shield = True
                await self._leave()

    async def _leave(self) -> None:
        """A clean stop: stop every task, release its lease once it has finished, mark the node stopped."""
        held = list(self.held.values())
        self.held.clear()
        done = [self._stopping.get(f.source) or self._stop(f.source) for f in held]
        for fence, scope in self.roles_held.values():
            scope.cancel()
            held.append(fence)
        self.roles_held.clear()
        with trio.move_on_after(RELEASE_WAIT):
            for event in done:
                await event.wait()
        for f in held:
            try:
                await self._call(self.state.release_lease, f)
            except Exception as exc:
                log.warning("source=%s lease not released (it expires): %s", f.source, exc)
        try:
            await self._call(self.state.node_stopped, self.name)
        except Exception as exc:
            log.warning("node=%s not marked stopped (its heartbeat expires): %s", self.name, exc)
        log.info("node=%s left the cluster, released %d lease(s)", self.name, len(held))

    async def beat(self) -> None:
        """One heartbeat: be alive, renew, balance (claim or release), split the hosts."""
        self.beats += 1
        config = self.config
        wanted = {s.name: s for s in config.sources if s.enabled}
        mine = [*self.held.values(), *(f for f, _ in self.roles_held.values())]
        if mine:
            kept = set(await self._call(self.state.renew_leases, mine, lease_seconds=self.lease_seconds))
            for f in [f for f in self.held.values() if f not in kept]:
                self.lost(f, "renewal refused")
            for role, (f, scope) in list(self.roles_held.items()):
                if f not in kept:
                    scope.cancel()
                    del self.roles_held[role]
                    log.error("node=%s role %s lost (epoch %d): renewal refused", self.name, role, f.epoch)
        # Stopped before the heartbeat says this node no longer follows them: the "@orphans" role
        # (websub/subscriber.py) never works on a subscription a task of this node still maintains.
        for name in [n for n in self.held if n not in wanted]:  # removed from the config (reload)
            self._release(name)
        # After the renewals, which matter more when the beat comes late (a loaded machine).
        await self._call(
            self.state.node_heartbeat, self.name, lease_seconds=self.lease_seconds, pid=os.getpid(),
            host=socket.gethostname(), url=config.server.base_url, follows=follows(config),
        )  # fmt: skip
        self.live = alive(await self._call(self.state.nodes), utcnow())
        target = math.ceil(len(wanted) / max(1, len(self.live)))
        extra = len(self.held) - target
        if extra > 0:
            for name in sorted(self.held)[-extra:]:
                self._release(name)
        elif extra < 0:
            candidates = [n for n in wanted if n not in self.held and n not in self._stopping]
            grants = await self._call(
                self.state.claim_leases, self.name, candidates, want=-extra, lease_seconds=self.lease_seconds
            )
            for f in grants:
                self.held[f.source] = f
                log.info("node=%s source=%s lease granted (epoch %d)", self.name, f.source, f.epoch)
                self._start(wanted[f.source], f)
            if grants and self.metrics is not None:
                self.metrics.cluster_lease_grants.labels(self.name).inc(len(grants))
        free_roles = [r for r in self.roles if r not in self.roles_held]
        if free_roles:
            for f in await self._call(
                self.state.claim_leases,
                self.name,
                free_roles,
                want=len(free_roles),
                lease_seconds=self.lease_seconds,
            ):
                scope = trio.CancelScope()
                self.roles_held[f.source] = (f, scope)
                log.info("node=%s role %s granted (epoch %d)", self.name, f.source, f.epoch)
                assert self._nursery is not None
                self._nursery.start_soon(self._run_role, f, scope)
        await self._share_hosts(wanted)
        if self.metrics is not None:
            self.metrics.cluster_leases_held.labels(self.name).set(len(self.held))
            self.metrics.cluster_nodes_live.labels(self.name).set(len(self.live))

    async def _share_hosts(self, wanted: dict[str, SourceConfig]) -> None:
        if self.fetcher is None:
            return
        live = {n.name for n in self.live} | {self.name}
        now = utcnow()
        holders: dict[str, set[str]] = {}
        for lease in await self._call(self.state.leases):
            src = wanted.get(lease.source)
            if src is None or lease.node not in live or lease.expires_at is None or lease.expires_at <= now:
                continue
            holders.setdefault(host_of(src.url), set()).add(lease.node)
        self.fetcher.set_host_shares({h: len(n) for h, n in holders.items()}, default=len(live))

    async def _run_role(self, fence: Fence, scope: trio.CancelScope) -> None:
        with scope, fenced(fence):
            try:
                await self.roles[fence.source]()
            except LeaseLost as exc:
                log.error("%s", exc)
            except Exception as exc:  # a failing role must not take the node down; the lease lapses
                log.error("node=%s role %s failed: %s: %s", self.name, fence.source, type(exc).__name__, exc)

    # ------------------------------------------------------------------ losing and releasing

    def lost(self, fence: Fence, reason: str) -> None:
        """The lease of ``fence`` is gone (not renewed in time, or a write was refused): stop its task."""
        if self.held.get(fence.source) != fence:
            return  # already dropped (or a newer grant of ours)
        del self.held[fence.source]
        log.error(
            "node=%s source=%s lease lost (epoch %d): %s; harvesting of it stopped here",
            self.name, fence.source, fence.epoch, reason,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.cluster_leases_lost.labels(self.name, reason).inc()
        self._stop(fence.source)

    def _release(self, name: str) -> None:
        """Give a source up for another node: stop its task, release the lease after its last commit."""
        fence = self.held.pop(name)
        done = self._stop(name)
        self._stopping[name] = done
        log.info("node=%s source=%s released for rebalancing (epoch %d)", self.name, name, fence.epoch)
        assert self._nursery is not None
        self._nursery.start_soon(self._release_after, fence, done)

    async def _release_after(self, fence: Fence, done: trio.Event) -> None:
        try:
            with trio.move_on_after(RELEASE_WAIT):
                await done.wait()
            await self._call(self.state.release_lease, fence)
        except Exception as exc:
            log.warning("source=%s lease not released (it expires): %s", fence.source, exc)
        finally:
            self._stopping.pop(fence.source, None)


__all__ = ["Node", "host_of", "node_name"]
