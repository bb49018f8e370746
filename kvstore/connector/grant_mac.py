"""The serving process's word that a pull was granted, checkable by its engine core.

The control plane (StartTransfer: lease, capability, one-time token) runs in the serving
process; the bytes are served by its core. The two share a random key from the core's boot
message, and the serving process signs what it granted: HMAC(key, request id, transfer id,
grant token), each field length-prefixed. The core's block server accepts a pull only with a
valid signature, and each block of an export once per grant token, so nothing reaches the
core's socket that the control plane did not admit.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_key() -> str:
    return secrets.token_hex(32)


def _message(*fields: str) -> bytes:
    out = bytearray()
    for field in fields:
        data = field.encode("utf-8", "surrogatepass")
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


def sign(key_hex: str, request_id: str, transfer_id: str, grant: str) -> str:
    key = bytes.fromhex(key_hex)
    return hmac.new(key, _message(request_id, transfer_id, grant), hashlib.sha256).hexdigest()


def verify(key_hex: str, request_id: str, transfer_id: str, grant: str, mac: str) -> bool:
    """False for anything but the right signature (a malformed key or mac included)."""
    try:
        expected = sign(key_hex, request_id, transfer_id, grant).encode()
    except ValueError:
        return False
    if not key_hex:
        return False
    return hmac.compare_digest(expected, mac.encode("utf-8", "surrogatepass"))
