"""`KVHandle`: the small, plain description of one published transfer.

The prefill side creates it, the router carries it (as the `pdmesh.v1.KVHandle` proto or a
dict), and the decode side uses it to pull and verify the bytes. Parsing validates every
field, so a garbled handle fails loudly before any connection is made.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from pdmesh.kvstore.transfer.backend_names import BACKEND_NAMES
from pdmesh.kvstore.transfer.checksum import PAYLOAD_ALGOS, ChecksumAlgo, parse_algo
from pdmesh.kvstore.transfer.errors import KVHandleError
from pdmesh.kvstore.transfer.layout import (
    DTYPE_CODES_BY_NAME,
    DTYPE_NAMES_BY_CODE,
    KVLayout,
)
from pdmesh.v1 import kv_transfer_pb2 as pb

MAX_ID_BYTES = 256
_TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
_ADDRESS = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})")


@dataclass(frozen=True)
class KVHandle:
    transfer_id: str
    request_id: str
    sender_address: str
    backends: tuple[str, ...]
    host_key: str
    sender_id: str
    layout: KVLayout
    checksum_algo: ChecksumAlgo
    checksum: int
    block_checksums: tuple[int, ...] = ()
    """An export lent by the sender's core (worker transports): one checksum per block."""
    streamed: bool = False
    """The export still grows (its prefill runs): `block_checksums` are those ready so far,
    the rest come through `WatchTransfer`."""

    @property
    def is_export(self) -> bool:
        return bool(self.block_checksums) or self.streamed

    def __post_init__(self) -> None:
        self.validate()

    @property
    def backend(self) -> str:
        """The sender's preferred data plane."""
        return self.backends[0]

    def validate(self) -> None:
        if not isinstance(self.transfer_id, str) or not _TRANSFER_ID.fullmatch(self.transfer_id):
            raise KVHandleError(f"transfer_id must be 32 hex characters, got {self.transfer_id!r}")
        check_request_id(self.request_id)
        if not _ADDRESS.fullmatch(self.sender_address or ""):
            raise KVHandleError(f"sender_address must be host:port, got {self.sender_address!r}")
        if int(self.sender_address.rsplit(":", 1)[1]) > 65535:
            raise KVHandleError(f"bad port in sender_address {self.sender_address!r}")
        if not self.backends or any(b not in BACKEND_NAMES for b in self.backends):
            raise KVHandleError(f"backends must be a non-empty subset of {BACKEND_NAMES}")
        for name in ("host_key", "sender_id"):
            if len(getattr(self, name).encode()) > MAX_ID_BYTES:
                raise KVHandleError(f"{name} longer than {MAX_ID_BYTES} bytes")
        if not isinstance(self.layout, KVLayout):
            raise KVHandleError("layout must be a KVLayout")
        algo = parse_algo(str(self.checksum_algo))
        if not self.is_export and algo not in PAYLOAD_ALGOS:
            raise KVHandleError(f"checksum {algo} checks blocks, and this handle has none")
        if not isinstance(self.checksum, int) or not 0 <= self.checksum < 1 << 64:
            raise KVHandleError(f"checksum must be an unsigned 64-bit int, got {self.checksum!r}")
        if self.block_checksums or self.streamed:
            if len(self.block_checksums) > self.layout.num_blocks or (
                    len(self.block_checksums) != self.layout.num_blocks and not self.streamed):
                raise KVHandleError(f"{len(self.block_checksums)} block checksums for "
                                    f"{self.layout.num_blocks} blocks")
            if any(not isinstance(c, int) or not 0 <= c < 1 << 64
                   for c in self.block_checksums):
                raise KVHandleError("block checksums must be unsigned 64-bit ints")

    # -- proto -------------------------------------------------------------------------------

    def to_proto(self) -> pb.KVHandle:
        lay = self.layout
        return pb.KVHandle(
            transfer_id=self.transfer_id,
            request_id=self.request_id,
            sender_address=self.sender_address,
            backends=list(self.backends),
            host_key=self.host_key,
            sender_id=self.sender_id,
            layout=pb.KVLayout(
                num_layers=lay.num_layers,
                num_blocks=lay.num_blocks,
                block_size=lay.block_size,
                num_kv_heads=lay.num_kv_heads,
                head_dim=lay.head_dim,
                dtype=lay.dtype_code,
                num_tokens=lay.num_tokens,
            ),
            checksum_algo=str(self.checksum_algo),
            checksum=self.checksum,
            block_checksums=list(self.block_checksums),
            streamed=self.streamed,
        )

    @classmethod
    def from_proto(cls, msg: pb.KVHandle) -> KVHandle:
        lay = msg.layout
        if lay.dtype not in DTYPE_NAMES_BY_CODE:
            raise KVHandleError(f"unsupported dtype code {lay.dtype}")
        layout = KVLayout(
            num_layers=lay.num_layers,
            num_blocks=lay.num_blocks,
            block_size=lay.block_size,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            dtype=DTYPE_NAMES_BY_CODE[lay.dtype],
            num_tokens=lay.num_tokens,
        )
        return cls(
            transfer_id=msg.transfer_id,
            request_id=msg.request_id,
            sender_address=msg.sender_address,
            backends=tuple(msg.backends),
            host_key=msg.host_key,
            sender_id=msg.sender_id,
            layout=layout,
            checksum_algo=parse_algo(msg.checksum_algo),
            checksum=msg.checksum,
            block_checksums=tuple(msg.block_checksums),
            streamed=msg.streamed,
        )

    # -- dict (JSON-safe) --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "transfer_id": self.transfer_id,
            "request_id": self.request_id,
            "sender_address": self.sender_address,
            "backends": list(self.backends),
            "host_key": self.host_key,
            "sender_id": self.sender_id,
            "layout": {
                "num_layers": lay.num_layers,
                "num_blocks": lay.num_blocks,
                "block_size": lay.block_size,
                "num_kv_heads": lay.num_kv_heads,
                "head_dim": lay.head_dim,
                "dtype": lay.dtype_name,
                "num_tokens": lay.num_tokens,
            },
            "checksum_algo": str(self.checksum_algo),
            # A string: JSON numbers above 2**53 lose precision in many parsers.
            "checksum": f"{self.checksum:016x}",
            "block_checksums": [f"{c:016x}" for c in self.block_checksums],
            "streamed": self.streamed,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVHandle:
        try:
            lay = data["layout"]
            dtype_name = lay["dtype"]
            if dtype_name not in DTYPE_CODES_BY_NAME:
                raise KVHandleError(f"unsupported dtype {dtype_name!r}")
            layout = KVLayout(
                num_layers=_int(lay["num_layers"]),
                num_blocks=_int(lay["num_blocks"]),
                block_size=_int(lay["block_size"]),
                num_kv_heads=_int(lay["num_kv_heads"]),
                head_dim=_int(lay["head_dim"]),
                dtype=dtype_name,
                num_tokens=_int(lay["num_tokens"]),
            )
            backends = data["backends"]
            if not isinstance(backends, list | tuple):
                raise KVHandleError("backends must be a list")
            return cls(
                transfer_id=_str(data["transfer_id"]),
                request_id=_str(data["request_id"]),
                sender_address=_str(data["sender_address"]),
                backends=tuple(_str(b) for b in backends),
                host_key=_str(data["host_key"]),
                sender_id=_str(data["sender_id"]),
                layout=layout,
                checksum_algo=parse_algo(_str(data["checksum_algo"])),
                checksum=int(_str(data["checksum"]), 16),
                block_checksums=tuple(int(_str(c), 16)
                                      for c in data.get("block_checksums", ())),
                streamed=data.get("streamed", False) is True,
            )
        except KeyError as exc:
            raise KVHandleError(f"handle misses field {exc}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, KVHandleError):
                raise
            raise KVHandleError(f"malformed handle: {exc}") from None


def log_id(transfer_id: str) -> str:
    """What logs, error messages and traces may say about a transfer: a short one-way tag.

    The transfer id itself is a bearer secret (with the request id it starts a pull), so it
    never leaves the handle; both sides derive the same tag, which is enough to correlate.
    """
    return "kv-" + hashlib.blake2b(transfer_id.encode(), digest_size=6).hexdigest()


def check_request_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise KVHandleError("request_id must be a non-empty string")
    if len(request_id.encode()) > MAX_ID_BYTES:
        raise KVHandleError(f"request_id longer than {MAX_ID_BYTES} bytes")


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVHandleError(f"expected an integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise KVHandleError(f"expected a string, got {value!r}")
    return value
