"""carpool's Ray Serve request router: prefix affinity under a load bound
(``routing.choose``), plus pinning a request to a named replica (the ingress's
/metrics and /health fan-out).

Ray Serve builds one router per deployment handle, in the handle's process (here the
ingress replica), and calls it from one event loop. It tells the router the replica set
(``update_replicas``); the router publishes each set it is given in ``replica_book``
so that the ingress, in the same process, can address every replica by name. Ray
Serve copies this module by value into that process: keep no shared state here.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from carpool.distributed import replica_book
from carpool.distributed.forward import ForwardedRequest
from carpool.distributed.routing import AffinityTable, choose, power_of_two, prefix_chain


class PrefixAffinityRouter(RequestRouter):
    """Sends a generation request to the replica that most likely holds its prompt's
    prefix in its KV cache unless that replica is ``max_imbalance`` requests busier than
    the least busy; everything else to the least busy replica. Ray Serve then checks that
    the chosen replica has room (``max_ongoing_requests``) and otherwise tries the next
    in rank. With ``policy="power_of_two"`` it routes as Ray Serve's default router
    does (for comparison), still honouring pins.

    Not FIFO (no ``FIFOMixin``): a replica chosen for a request must go to that request,
    not to the oldest one waiting, or neither pins nor prefixes hold under concurrency
    (a /health fan-out pinned to two replicas was answered twice by one)."""

    def initialize_state(self, max_imbalance: int = 16, policy: str = "prefix", **_: Any) -> None:
        self.max_imbalance = max_imbalance
        self.by_prefix = policy == "prefix"
        self.table = AffinityTable()
        self.rng = random.Random()
        # Requests this router assigned and that have not completed, per replica,
        # counted when assigned: Ray Serve's queue-length cache is empty or stale in a
        # burst (64 new streams all read 0 there). A request gets the first of its
        # rank unless that replica is full, which its cap (set above its own admission
        # limits) makes rare.
        self.assigned: Counter[str] = Counter()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        name = replica_id.to_full_id_str()
        if self.assigned[name] > 0:
            self.assigned[name] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.to_full_id_str() for r in replicas}
        key = replica_book.deployment_key(self._deployment_id.app_name, self._deployment_id.name)
        for gone in set(replica_book.known_replicas(key)) - live:
            self.table.forget(gone)
        replica_book.publish(key, tuple(sorted(live)))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.to_full_id_str())
        self.assigned.pop(replica_id.to_full_id_str(), None)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = _forwarded(pending_request)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        if request is not None and request.replica in by_id:
            # The named replica first; another if it cannot take it (a report says
            # which replica answered, and the ingress keeps one answer per replica).
            self.assigned[request.replica] += 1
            others = [r for k, r in by_id.items() if k != request.replica]
            return [[by_id[request.replica]], others]
        if request is not None and request.avoid:
            by_id = {k: r for k, r in by_id.items() if k not in request.avoid} or by_id
        if not self.by_prefix:  # two at random; Ray Serve takes the shorter queue
            return [[by_id[rid] for rid in power_of_two(by_id, self.rng)]]
        in_flight = {rid: self.assigned[rid] for rid in by_id}
        chain = prefix_chain(request.prefix_text) if request is not None else []
        ranked = choose(self.table, chain, in_flight, self.max_imbalance, self.rng).ranked
        self.assigned[ranked[0]] += 1
        return [[by_id[rid]] for rid in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request = _forwarded(pending_request)
        if self.by_prefix and request is not None and request.prefix_text and not request.replica:
            self.table.record(prefix_chain(request.prefix_text), replica_id.to_full_id_str())


def _forwarded(pending: PendingRequest | None) -> ForwardedRequest | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, ForwardedRequest) else None
