"""The router's request path, as the server calls it: plan a request, run it, clean up after.

One request's trip through the mesh, module by module:

* `planner.py` chooses its decode instance, then `pd_decider.py` whether a prefill instance
  should prefill it (conditional disaggregation by uncached tokens), with the policies of
  `routing/` as scorers;
* `peer_prefix.py` offers the instance that computes its prompt the leading blocks another
  instance holds, when pulling them beats computing them (cluster-wide prefix caching);
* `load_slots.py` counts it on those instances while it runs (what routing sees as load);
* `request_run.py` runs it: Prefill, then the Decode stream, each under the progress
  watchdog (`watchdog.py`);
* `failures.py` says what a failed call means: re-route it, migrate it, or pass the answer
  on; `recovery.py` moves it (another instance, local prefill, a token-exact migration);
* `responses.py` assembles what goes back: deltas, prompt logprobs, the final message;
* `cleanup.py` frees what it left on instances (Abort, ReleaseKV,
  ReleasePrefix), even after it is gone.
"""

from __future__ import annotations

from pdmesh.auth import ClusterToken
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.metrics import RouterMetrics, router_metrics
from pdmesh.router.cleanup import CleanupCalls
from pdmesh.router.instances import InstancePool
from pdmesh.router.load_slots import LoadSlots
from pdmesh.router.pd_decider import PrefillDecider
from pdmesh.router.peer_prefix import PeerPrefixes, PeerReuse
from pdmesh.router.planner import Planner
from pdmesh.router.request import PreparedRequest
from pdmesh.router.request_run import RequestRun, RunContext
from pdmesh.router.responses import ResponseStream, Send
from pdmesh.router.routing.base import RoutingPolicy


class Orchestrator:
    """Serves prepared requests; shared by every request of the router."""

    def __init__(
        self,
        pool: InstancePool,
        policies: dict[str, RoutingPolicy],
        index: PrefixIndex | None,
        *,
        local_prefill_threshold: int,
        rpc_timeout_s: float,
        migration_limit: int = 3,
        metrics: RouterMetrics | None = None,
        token: ClusterToken | None = None,
        slos: dict[str, float] | None = None,
        stream_kv: bool = True,
        peer_reuse: PeerReuse | None = None,
    ) -> None:
        """`slos`: the goodput SLOs each finished request is judged on (pdmesh/slo.py)."""
        self.metrics = metrics or router_metrics()
        self.slos = slos or {}
        self.planner = Planner(pool, policies, index, PrefillDecider(local_prefill_threshold),
                               self.metrics)
        self.cleanup = CleanupCalls(rpc_timeout_s)
        peers = PeerPrefixes(peer_reuse or PeerReuse(), self.metrics, token)
        self.context = RunContext(pool, self.planner, self.cleanup, self.metrics,
                                  migration_limit, token, stream_kv, peers)

    async def run(self, req: PreparedRequest, send: Send) -> None:
        """Serve `req`, sending GenerateResponses through `send`; RouteError before output."""
        plan = await self.planner.plan(req)
        slots = LoadSlots(req, plan)
        try:
            responses = ResponseStream(req, send, self.metrics, self.slos)
            await RequestRun(self.context, req, plan, responses, slots).execute()
        finally:
            slots.release()

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for cleanup calls still in flight (shutdown)."""
        await self.cleanup.drain(timeout_s)
