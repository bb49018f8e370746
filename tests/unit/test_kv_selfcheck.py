"""`pdmesh selftest`'s KV rows (kvstore/connector/selfcheck.py): blocks exported by a core here
and pulled by a receiving core in another process, over each transport; a block changed after
its export must fail every transport's row, and the verdict reads what the receiver saw."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pdmesh.kvstore.connector import selfcheck
from pdmesh.kvstore.connector.selfcheck import EXPORTED, SendingCore, judge

BACKENDS = ("shm", "tcp", "torch_dist")


@pytest.mark.processes
def test_a_block_changed_after_its_export_fails_every_transport(tmp_path: Path) -> None:
    """The export's checksums name the bytes as they were; the receiver must refuse what it
    lands when a lent block changed under it (the fault the leases exist for)."""

    async def run() -> list[selfcheck.CheckResult]:
        async with SendingCore.started(torch.device("cpu"), tmp_path, BACKENDS) as core:
            transfers = [core.publish(b) for b in core.checked]
            core.connector.cache[1, 0, EXPORTED[2], 3].add_(1.0)  # one row of one piece
            replies = await selfcheck.receive(transfers, core.receiver, core.shm_dir)
            return core.rows(replies)

    rows = asyncio.run(run())
    assert [r.name for r in rows] == [f"kv transfer {b}" for b in BACKENDS]
    for row in rows:
        assert row.outcome == "fail", row
        assert "KVChecksumError" in row.detail and "block 2" in row.detail, row
    assert not list(tmp_path.iterdir())  # both caches' files unlinked


@pytest.mark.fast
def test_the_verdict_reads_what_the_receiver_saw() -> None:
    cpu = torch.device("cpu")
    want = ["a", "b"]
    ok = {"digests": want, "others_written": False, "bytes": 10, "seconds": 0.5}
    assert judge("tcp", "", ok, want, cpu, cpu).outcome == "pass"
    assert judge("tcp", "", {**ok, "digests": ["a", "c"]}, want, cpu, cpu).detail == \
        "landed blocks differ from the exported ones"
    assert judge("tcp", "", {**ok, "others_written": True}, want, cpu, cpu).outcome == "fail"
    assert judge("tcp", "", None, want, cpu, cpu).outcome == "fail"
    assert judge("tcp", "", {"error": "KVTransferDenied: no"}, want, cpu,
                 cpu).detail == "KVTransferDenied: no"
    skipped = judge("ucxx", "ucxx is not installed", None, want, cpu, cpu)
    assert (skipped.outcome, skipped.detail) == ("skip", "ucxx is not installed")
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    across = judge("shm", "", ok, want, gpu0, gpu1)
    assert across.device == "cuda:0 -> cuda:1"
    # A pull across GPUs that reach each other must not open a context on the sender's.
    opened_there = {**ok, "new_contexts": [0], "mappable": True}
    assert judge("shm", "", opened_there, want, gpu0, gpu1, peers=True).outcome == "fail"
    assert judge("shm", "", ok, want, gpu0, gpu1, peers=True).outcome == "pass"
    no_p2p = judge("shm", "", opened_there, want, gpu0, gpu1, peers=False)
    assert no_p2p.outcome == "pass" and "no peer access" in no_p2p.detail
    # A handle only torch's opener can open (expandable segments): said, not failed.
    by_torch = judge("shm", "", {**opened_there, "mappable": False}, want, gpu0, gpu1,
                     peers=True)
    assert by_torch.outcome == "pass" and "torch's opener" in by_torch.detail
