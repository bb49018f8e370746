"""torch_dist pulls over a process group per sender–receiver pair, kept between pulls
(kvstore/connector/dist_groups.py, dist_blocks.py): made on the pair's first pull, reused by
the next, replaced when either side lost it, closed on failure; gloo on loopback here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from pdmesh.kvstore.connector import dist_blocks, grant_mac
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.connector import KVConnector
from pdmesh.kvstore.connector.dist_groups import PairGroup, PairGroups
from pdmesh.kvstore.connector.source import KVSource
from pdmesh.kvstore.connector.tcp_blocks import pull_blocks
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import KVTransferDenied, KVTransferError

pytestmark = pytest.mark.fast

SHAPE = (3, 2, 24, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
EXPORTED = [9, 2, 3, 17]
LANDED = [4, 5, 11, 0]


@dataclass
class Pair:
    sender: KVConnector
    receiver: KVConnector
    cache: torch.Tensor
    key: str

    @property
    def sender_groups(self) -> PairGroups:
        return self.sender._server._groups  # type: ignore[union-attr]

    @property
    def receiver_groups(self) -> PairGroups:
        return self.receiver._dist_groups

    def source(self, rid: str, grant: str = "g" * 32, deadline_s: float = 20.0) -> KVSource:
        """A fresh export of EXPORTED under `rid`, granted as the tcp plane grants it."""
        info = self.sender.export(rid, EXPORTED, len(EXPORTED) * SHAPE[3])
        layers, _, _, block_size, heads, head_dim = SHAPE
        params = {"address": self.sender.block_server_address, "request": rid,
                  "transfer": "t" * 32, "grant": grant,
                  "mac": grant_mac.sign(self.key, rid, "t" * 32, grant)}
        return KVSource("torch_dist", params, info.block_checksums, info.checksum_algo,
                        len(EXPORTED) * block_size, (layers, block_size, heads, head_dim),
                        "float32", deadline_s=deadline_s)

    def pull(self, source: KVSource) -> None:
        self.receiver.cache.zero_()
        self.receiver.start_load(source, 0, LANDED).result(timeout=60)
        for dst, src in zip(LANDED, EXPORTED, strict=True):
            assert torch.equal(self.receiver.cache[:, :, dst], self.cache[:, :, src])

    def kept(self) -> tuple[PairGroup, PairGroup]:
        """The one group each side keeps (taken out and put back, to look at it)."""
        assert len(self.sender_groups) == 1 and len(self.receiver_groups) == 1
        theirs = self.receiver_groups.take(self.sender.block_server_address)
        assert theirs is not None
        self.receiver_groups.give_back(self.sender.block_server_address, theirs)
        ours = self.sender_groups.take(theirs.group_id)
        assert ours is not None, "the sender keeps the group under the id the receiver holds"
        self.sender_groups.give_back(theirs.group_id, ours)
        return ours, theirs


@pytest.fixture
def pair(tmp_path) -> Iterator[Pair]:
    key = grant_mac.new_key()
    cache = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    sender = KVConnector(KVConnectorConfig(shm_dir=str(tmp_path), grant_secret=key,
                                           io_timeout_s=20), cache, None)
    receiver = KVConnector(KVConnectorConfig(shm_dir=str(tmp_path), tcp=False),
                           torch.zeros(SHAPE), None)
    sender.start()
    try:
        yield Pair(sender, receiver, cache, key)
    finally:
        sender.close()
        receiver.close()
    assert len(receiver._dist_groups) == 0 and len(sender._server._groups) == 0  # type: ignore


def test_the_second_pull_between_two_cores_reuses_their_group(pair: Pair) -> None:
    pair.pull(pair.source("r1"))
    first = pair.kept()
    pair.pull(pair.source("r2"))
    assert pair.kept() == first  # the same group objects on both sides, no new rendezvous


def test_a_group_the_sender_dropped_is_replaced_on_the_next_pull(pair: Pair) -> None:
    pair.pull(pair.source("r1"))
    ours, theirs = pair.kept()
    pair.sender_groups.take(theirs.group_id)  # the sender let it go (evicted, say)
    ours.close()
    pair.pull(pair.source("r2"))  # the receiver named it; the sender answered with a new one
    _, theirs2 = pair.kept()
    assert theirs2.group_id != theirs.group_id and theirs2 is not theirs


def test_a_refused_pull_keeps_the_group_and_a_failed_one_closes_it(pair: Pair,
                                                                    monkeypatch) -> None:
    pair.pull(pair.source("r1"))
    _, theirs = pair.kept()
    replay = pair.source("r1-again")
    pair.pull(replay)
    with pytest.raises(KVTransferDenied):  # refused before any byte: the group is intact
        pair.receiver.start_load(replay, 0, LANDED).result(timeout=60)
    assert pair.kept()[1] is theirs

    def broken(*args: object) -> None:
        raise RuntimeError("the sender failed mid-pull")

    with monkeypatch.context() as patch:  # the sender's next send fails
        patch.setattr(dist_blocks, "send_blocks", broken)
        with pytest.raises(KVTransferError):  # the receiver waits until its deadline
            pair.receiver.start_load(pair.source("r2", deadline_s=2.0), 0, LANDED).result(
                timeout=60)
    assert len(pair.receiver_groups) == 0 and len(pair.sender_groups) == 0  # both closed
    pair.pull(pair.source("r3"))  # a new pair group
    assert pair.kept()[1].group_id != theirs.group_id


def test_a_receiver_that_keeps_no_group_gets_one_for_its_pull_only(pair: Pair) -> None:
    """As before pair groups (a receiver without a registry): the three-field reply, a
    group made for the pull and torn down after it on both sides."""
    source = pair.source("r1")
    p = source.params
    nbytes = pull_blocks(p["address"], request_id="r1", transfer_id=p["transfer"],
                         grant=p["grant"], mac=p["mac"], first_block=0,
                         dst=pair.receiver.cache, dst_ids=LANDED, config=pair.receiver.config,
                         deadline=Deadline.after(20), via="torch_dist")
    assert nbytes == len(LANDED) * pair.cache[:, :, 0].numel() * 4
    assert len(pair.sender_groups) == 0 and len(pair.receiver_groups) == 0


def recording(closed: list[str]) -> Callable[[str], PairGroup]:
    """Groups for the registry's bookkeeping alone: each records its shutdown in `closed`."""

    class Group:
        def __init__(self, name: str) -> None:
            self.name = name

        def shutdown(self) -> None:
            closed.append(self.name)

    return lambda name: PairGroup(name, "gloo", Group(name), None)  # type: ignore[arg-type]


def test_the_registry_is_bounded_and_closes_what_it_lets_go() -> None:
    closed: list[str] = []
    group = recording(closed)
    groups = PairGroups(limit=2)
    for name in ("a", "b", "c"):
        groups.give_back(name, group(name))
    assert closed == ["a"] and len(groups) == 2  # the least recently used went
    groups.give_back("b", group("b2"))
    assert closed == ["a", "b"]  # a second group for one key replaces the first
    groups.close()
    assert sorted(closed) == ["a", "b", "b2", "c"] and len(groups) == 0
    groups.give_back("d", group("d"))
    assert closed[-1] == "d"  # given back after close: closed at once


def test_a_group_left_unused_is_closed_when_the_registry_is_next_used() -> None:
    closed: list[str] = []
    group = recording(closed)
    now = [0.0]
    groups = PairGroups(idle_s=60.0, clock=lambda: now[0])
    groups.give_back("a", group("a"))
    now[0] = 30.0
    groups.give_back("b", group("b"))
    now[0] = 70.0  # a: 70 s unused, b: 40 s
    assert groups.take("a") is None and closed == ["a"]  # its peer is gone, say: closed
    taken = groups.take("b")
    assert taken is not None and taken.group_id == "b" and closed == ["a"]
    groups.give_back("b", taken)  # used again: its 60 s start over
    now[0] = 125.0
    assert groups.take("b") is not None and closed == ["a"]
