"""The engine core's KV connector without a model: the shared cache file, per-block checksums,
block runs, and a pull over `shm` between two caches (kvstore/connector/)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest
import torch

from pdmesh.kvstore.connector import grant_mac
from pdmesh.kvstore.connector.blocks import block_checksums, copy_blocks, runs
from pdmesh.kvstore.connector.cache_file import PeerCaches, open_peer, shared_zeros
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.connector import KVConnector
from pdmesh.kvstore.connector.source import KVSource, encode_blocks
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo, default_algo
from pdmesh.kvstore.transfer.errors import (
    KVChecksumError,
    KVSenderUnavailable,
    KVTransferDenied,
    KVWireError,
)

pytestmark = pytest.mark.fast

SHAPE = (3, 2, 24, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim


@pytest.fixture(params=[None, ChecksumAlgo.XXH3_64], ids=["default", "xxh3"])
def caches(tmp_path, request) -> Iterator[tuple[KVConnector, KVConnector]]:
    """A sender and a receiver on shared cache files; the sender exports with this core's
    default algorithm (xxh64 where the native kernels load) or with xxh3 (an older core's)."""
    config = KVConnectorConfig(shm_dir=str(tmp_path), tcp=False)
    made = []
    for seed in (1, 2):
        shared = shared_zeros(SHAPE, torch.float32, str(tmp_path))
        shared.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)))
        made.append(KVConnector(config, shared.tensor, shared, algo=request.param))
    yield made[0], made[1]
    for connector in made:
        connector.close()
    assert not os.listdir(tmp_path), "cache files left behind"


def source_of(sender: KVConnector, request_id: str, block_ids: list[int],
              num_tokens: int) -> KVSource:
    info = sender.export(request_id, block_ids, num_tokens)
    layers, _, blocks, block_size, heads, head_dim = SHAPE
    params = {"cache": sender.cache_file_name, "num_blocks": str(blocks),
              "blocks": encode_blocks(block_ids)}
    return KVSource("shm", params, info.block_checksums, info.checksum_algo, num_tokens,
                    (layers, block_size, heads, head_dim), "float32")


def test_runs_group_consecutive_pairs() -> None:
    assert runs([4, 5, 6, 9, 10], [0, 1, 7, 8, 9]) == [(4, 0, 2), (6, 7, 1), (9, 8, 2)]
    assert runs([], []) == []
    with pytest.raises(ValueError):
        runs([1], [])


def test_copy_blocks_moves_exactly_the_named_blocks() -> None:
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    copy_blocks(dst, [7, 8, 2], src, [1, 2, 20])
    for d, s in ((7, 1), (8, 2), (2, 20)):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert int((dst.abs().sum(dim=(0, 1, 3, 4, 5)) != 0).sum()) == 3


@pytest.mark.parametrize("algo", list(ChecksumAlgo))
def test_block_checksums_name_contents_not_positions(algo: ChecksumAlgo) -> None:
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    copy_blocks(dst, [5, 0], src, [3, 9])
    assert block_checksums(algo, src, [3, 9]) == block_checksums(algo, dst, [5, 0])
    before = block_checksums(algo, src, [3])
    src[2, 1, 3, 0, 0, 0] += 1.0  # one element of the last layer's V
    assert block_checksums(algo, src, [3]) != before
    bf16 = src.to(torch.bfloat16)
    assert len(block_checksums(algo, bf16, [0, 1])) == 2


def test_shared_cache_file_is_private_and_unlinked(tmp_path) -> None:
    shared = shared_zeros(SHAPE, torch.float32, str(tmp_path))
    mode = os.stat(shared.path).st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert float(shared.tensor.abs().sum()) == 0.0
    shared.tensor[1, 1, 3] = 2.0
    peer = open_peer(str(tmp_path), shared.name, SHAPE, torch.float32)
    assert float(peer[1, 1, 3].sum()) == 2.0 * 4 * 2 * 8  # the same memory, read-only
    shared.close()
    assert not os.path.exists(shared.path)


def test_peer_files_are_checked_before_mapping(tmp_path) -> None:
    shared = shared_zeros(SHAPE, torch.float32, str(tmp_path))
    try:
        with pytest.raises(KVWireError, match="not a KV cache file name"):
            open_peer(str(tmp_path), "../etc/passwd", SHAPE, torch.float32)
        with pytest.raises(KVWireError, match="bytes"):
            open_peer(str(tmp_path), shared.name, (3, 2, 25, 4, 2, 8), torch.float32)
        os.chmod(shared.path, 0o644)
        with pytest.raises(KVWireError, match="readable by others"):
            open_peer(str(tmp_path), shared.name, SHAPE, torch.float32)
        os.chmod(shared.path, 0o600)
        peers = PeerCaches(str(tmp_path))
        assert peers.get(shared.name, SHAPE, torch.float32).shape == SHAPE
    finally:
        shared.close()
    with pytest.raises(KVSenderUnavailable, match="gone"):
        peers.get(shared.name, SHAPE, torch.float32)


def test_shm_pull_moves_only_the_blocks_after_first(caches) -> None:
    sender, receiver = caches
    exported = [10, 11, 12, 3, 4]
    source = source_of(sender, "r1", exported, num_tokens=18)  # 5 blocks of 4, last partial
    assert source.checksum_algo == str(sender.algo)
    before = receiver.cache.clone()
    nbytes = receiver.load(source, 2, [0, 1, 2])  # blocks 0-1: the receiver's own hits
    assert nbytes == 3 * 3 * 2 * 4 * 2 * 8 * 4
    for dst, src in zip([0, 1, 2], exported[2:], strict=True):
        assert torch.equal(receiver.cache[:, :, dst], sender.cache[:, :, src])
    untouched = [b for b in range(SHAPE[2]) if b not in (0, 1, 2)]
    assert torch.equal(receiver.cache[:, :, untouched], before[:, :, untouched])


def test_a_block_changed_under_its_lease_fails_the_checksum(caches) -> None:
    sender, receiver = caches
    source = source_of(sender, "r2", [5, 6, 7], num_tokens=12)
    sender.cache[0, 0, 6, 0, 0, 0] += 3.0  # reused by the sender while lent: a lease bug
    with pytest.raises(KVChecksumError, match=r"1 of 3.*first: block 1"):
        receiver.load(source, 0, [20, 21, 22])
    source = source_of(sender, "r3", [8, 9], num_tokens=8)
    sender.cache[2, 1, 9, 3, 1, 7] += 1.0  # the block's last byte range: the last piece's tail
    with pytest.raises(KVChecksumError, match="1 of 2"):
        receiver.load(source, 0, [20, 21])


def test_the_default_cpu_pull_hashes_while_it_copies(tmp_path) -> None:
    """xxh64 between CPU caches: the digests the shm load answers are those of the bytes it
    wrote, and the sender's export computed the same ones (the check passes)."""
    from pdmesh.kernels import cpu_native
    from pdmesh.kvstore.connector.blocks import copy_blocks_checked

    if not cpu_native.supports_kv_blocks(torch.zeros(SHAPE)):
        pytest.skip("no native CPU kernels here: xxh3 is the default")
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    sums = copy_blocks_checked(ChecksumAlgo.XXH64, dst, [3, 0], src, [7, 8])
    assert sums == block_checksums(ChecksumAlgo.XXH64, src, [7, 8])
    assert torch.equal(dst[:, :, [3, 0]], src[:, :, [7, 8]])


def test_sources_that_cannot_be_ours_are_refused(caches) -> None:
    sender, receiver = caches
    source = source_of(sender, "r3", [1, 2], num_tokens=8)
    receiver.check_source(source)
    import msgspec

    with pytest.raises(ValueError, match="layout"):
        receiver.check_source(msgspec.structs.replace(source, kv_shape=(3, 4, 2, 16)))
    with pytest.raises(ValueError, match="checksums"):
        receiver.check_source(msgspec.structs.replace(source, num_tokens=12))
    with pytest.raises(ValueError, match="transport"):
        receiver.check_source(msgspec.structs.replace(source, backend="carrier-pigeon"))
    bad_ids = msgspec.structs.replace(source, params={**source.params, "blocks": "1,999"})
    with pytest.raises(KVWireError, match="outside"):
        receiver.load(bad_ids, 0, [3, 4])
    assert default_algo() in ChecksumAlgo


def test_grant_signatures_bind_every_field() -> None:
    key = grant_mac.new_key()
    mac = grant_mac.sign(key, "req", "t" * 32, "grant")
    assert grant_mac.verify(key, "req", "t" * 32, "grant", mac)
    assert not grant_mac.verify(key, "req2", "t" * 32, "grant", mac)
    assert not grant_mac.verify(key, "req", "t" * 32, "grant2", mac)
    assert not grant_mac.verify(grant_mac.new_key(), "req", "t" * 32, "grant", mac)
    assert not grant_mac.verify("", "req", "t" * 32, "grant", mac)
    assert not grant_mac.verify("zz", "req", "t" * 32, "grant", mac)  # a malformed key
    assert not grant_mac.verify(key, "req", "t" * 32, "grant", "é" * 64)
    # Fields are length-prefixed: moving a separator does not forge a signature.
    assert not grant_mac.verify(key, "re", "qt" + "t" * 31, "grant", mac)


def test_a_block_server_without_its_grant_key_refuses_to_start(tmp_path) -> None:
    connector = KVConnector(KVConnectorConfig(shm_dir=str(tmp_path)), torch.zeros(SHAPE), None)
    with pytest.raises(ValueError, match="grant"):
        connector.start()


@pytest.mark.parametrize("via", ["tcp", "torch_dist"])
def test_pulls_from_a_block_server_over_tcp_and_torch_dist(tmp_path, via: str) -> None:
    pull_from_a_block_server(tmp_path, via, "cpu", "cpu")


def test_a_torch_dist_pull_moves_in_bounded_messages(tmp_path, monkeypatch) -> None:
    """Messages of at most CHUNK_BYTES (here: one block each), through one staging tensor
    the receiver reuses: every block lands where its own run says."""
    from pdmesh.kvstore.connector import dist_blocks

    monkeypatch.setattr(dist_blocks, "CHUNK_BYTES", 1)
    assert dist_blocks.blocks_per_message(1 << 20) == 1
    pull_from_a_block_server(tmp_path, "torch_dist", "cpu", "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("devices", [("cuda:0", "cpu"), ("cuda:0", "cuda:0"),
                                     ("cuda:0", "cuda:1")],
                         ids=["gloo-from-gpu", "gloo-on-one-gpu", "nccl"])
def test_a_torch_dist_pull_from_a_gpu_cache(tmp_path, devices: tuple[str, str]) -> None:
    """GPU to host over gloo; between two caches on one GPU over gloo too (NCCL refuses two
    ranks on one device); GPU to GPU over NCCL, whose wait returns before the bytes land
    (dist_blocks.settle): the blocks must be in the cache when the pull returns."""
    if devices[1] == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a device per rank: two GPUs")
    pull_from_a_block_server(tmp_path, "torch_dist", *devices)


def test_nccl_is_chosen_only_between_two_gpus() -> None:
    from pdmesh.kvstore.connector.dist_blocks import gpus_apart

    assert gpus_apart("cuda", "GPU-a", "cuda", "GPU-b")
    assert not gpus_apart("cuda", "GPU-a", "cuda", "GPU-a")  # a prefill and a decode on one
    assert gpus_apart("cuda", "GPU-a", "cuda", "")  # a receiver that does not say: as before
    assert not gpus_apart("cuda", "GPU-a", "cpu", "")
    assert not gpus_apart("cpu", "", "cuda", "GPU-b")


def pull_from_a_block_server(tmp_path, via: str, sender_device: str,
                             receiver_device: str) -> None:
    key = grant_mac.new_key()
    config = KVConnectorConfig(shm_dir=str(tmp_path), grant_secret=key, io_timeout_s=20)
    cache = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    sender = KVConnector(config, cache.to(sender_device), None)
    receiver = KVConnector(KVConnectorConfig(shm_dir=str(tmp_path), tcp=False),
                           torch.zeros(SHAPE, device=receiver_device), None)
    sender.start()
    try:
        exported = [9, 2, 3, 17]
        info = sender.export("r1", exported, num_tokens=15)
        layers, _, _, block_size, heads, head_dim = SHAPE
        params = {"address": sender.block_server_address, "request": "r1",
                  "transfer": "t" * 32, "grant": "g" * 32,
                  "mac": grant_mac.sign(key, "r1", "t" * 32, "g" * 32)}
        source = KVSource(via, params, info.block_checksums, info.checksum_algo, 15,
                          (layers, block_size, heads, head_dim), "float32", deadline_s=20)
        # On a connector thread, as an engine pulls (a device cache: on its receiving stream);
        # the first block is the receiver's own hit.
        receiver.start_load(source, 1, [4, 5, 11]).result(timeout=60)
        for dst, src in zip([4, 5, 11], exported[1:], strict=True):
            assert torch.equal(receiver.cache[:, :, dst].cpu(), cache[:, :, src])
        with pytest.raises(KVTransferDenied):  # the grant was used
            receiver.start_load(source, 1, [4, 5, 11]).result(timeout=60)
    finally:
        sender.close()
        receiver.close()


def test_lin64_is_per_block_only_and_sees_moved_words() -> None:
    from pdmesh.kvstore.transfer.checksum import checksum

    with pytest.raises(Exception, match="blocks"):
        checksum(ChecksumAlgo.LIN64, b"payload")
    cache = torch.randn(SHAPE)
    before = block_checksums(ChecksumAlgo.LIN64, cache, [4])
    piece = cache[1, 0, 4].reshape(-1)
    piece[[0, 1]] = piece[[1, 0]].clone()  # two words swapped inside one piece
    assert block_checksums(ChecksumAlgo.LIN64, cache, [4]) != before
    many = block_checksums(ChecksumAlgo.LIN64, cache, list(range(SHAPE[2])))  # > one chunk
    assert many[4] == block_checksums(ChecksumAlgo.LIN64, cache, [4])[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lin64_on_the_device_equals_the_host_and_is_the_gpu_default() -> None:
    from pdmesh.kvstore.connector.blocks import default_block_algo

    cache = torch.randn(SHAPE).to(torch.bfloat16)
    device = cache.cuda()
    assert default_block_algo(device) is ChecksumAlgo.LIN64
    ids = [0, 7, 23]
    assert block_checksums(ChecksumAlgo.LIN64, device, ids) == block_checksums(
        ChecksumAlgo.LIN64, cache, ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algo", [ChecksumAlgo.XXH3_64, ChecksumAlgo.XXH64, ChecksumAlgo.CRC32])
def test_host_hashed_checksums_of_a_device_cache_equal_the_host_cache(algo) -> None:
    """A device cache checked with a host algorithm (a CPU peer's choice) is copied to the
    host a few blocks at a time; every chunk boundary gives the host cache's sums."""
    from pdmesh.kvstore.connector.blocks import DEVICE_CHUNK_BLOCKS

    cache = torch.randn(SHAPE)
    ids = list(range(SHAPE[2]))[::-1]
    assert len(ids) > DEVICE_CHUNK_BLOCKS
    assert block_checksums(algo, cache.cuda(), ids) == block_checksums(algo, cache, ids)


def test_room_for_a_cache_counts_what_sparse_caches_may_still_claim(tmp_path) -> None:
    from pdmesh.kvstore.connector.cache_file import owed_by_caches, room_for

    assert owed_by_caches(str(tmp_path)) == 0
    shared = shared_zeros((2, 2, 64, 16, 4, 64), torch.float32, str(tmp_path))  # 4 MiB, sparse
    try:
        assert owed_by_caches(str(tmp_path)) == 4 * 2**20  # nothing written yet: all owed
        shared.tensor[:, :, :32] = 1.0  # half the blocks written: half still owed
        assert 2 * 2**20 - 2**16 <= owed_by_caches(str(tmp_path)) <= 2 * 2**20 + 2**16
        assert room_for(str(tmp_path / "missing"), 0) == 0
    finally:
        shared.close()
