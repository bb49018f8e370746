"""A request's share of its instances' load, as routing sees it.

Polled loads lag, so the router counts the requests (and their KV blocks) it has in flight on
each instance itself (`Instance.request_started`/`request_finished`); the policies take the
larger of the two views. A request holds one slot per role: on its decode instance, the KV
it will need at most (prompt + every token of every sequence); on its prefill instance, the
prompt's blocks. A slot moves with the request when it is re-routed or migrated, and both
are given back when it ends, however it ends.
"""

from __future__ import annotations

import math

from pdmesh.engine.request_rules import request_kv_blocks
from pdmesh.router.instance import Instance
from pdmesh.router.request import Plan, PreparedRequest


class LoadSlot:
    """One request's share of an instance's in-flight count; it moves with the request."""

    def __init__(self, instance: Instance | None, blocks: int) -> None:
        self.blocks = blocks
        self.instance: Instance | None = None
        self.started = 0.0
        self.move(instance)

    def move(self, instance: Instance | None) -> None:
        self.release()
        if instance is not None:
            self.started = instance.request_started(self.blocks)
        self.instance = instance

    def release(self) -> None:
        if self.instance is not None:
            self.instance.request_finished(self.blocks, self.started)
            self.instance = None


class LoadSlots:
    """A request's slots by role ("decode", "prefill"), taken where its plan puts it."""

    def __init__(self, req: PreparedRequest, plan: Plan) -> None:
        block_size = plan.route.block_size
        prompt_tokens = len(req.prompt_token_ids)
        self._slots = {
            "decode": LoadSlot(
                plan.decode, request_kv_blocks(prompt_tokens, req.max_tokens, req.n, block_size)),
            "prefill": LoadSlot(plan.prefill, math.ceil(prompt_tokens / block_size)),
        }

    def move(self, role: str, instance: Instance | None) -> None:
        """The request's `role` call now runs on `instance` (None: nowhere)."""
        self._slots[role].move(instance)

    def release(self) -> None:
        for slot in self._slots.values():
            slot.release()
