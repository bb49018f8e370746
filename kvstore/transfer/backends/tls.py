"""TLS for socket data planes, from the same PEM files as the gRPC hops (`TLSConfig`).

Same rules as `pdmesh.grpc_common`: cert+key make the sender a TLS server; adding a CA makes
it mutual (the sender requires a client certificate signed by it, the receiver verifies the
sender against it). A receiver with TLS configured never falls back to plaintext, and a sender
with TLS configured refuses plaintext connections (the handshake fails, the socket closes).
"""

from __future__ import annotations

import ssl

from pdmesh.grpc_common import TLSConfig


def server_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """None = plaintext."""
    if tls is None or not (tls.cert and tls.key):
        return None
    tls.validate(server=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        ctx.load_verify_locations(tls.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """None = plaintext. Verifies the sender (against `ca`, else the system roots) and its
    host name, as gRPC does; presents cert+key when given."""
    if tls is None or not tls.enabled:
        return None
    tls.validate(server=False)
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert and tls.key:
        ctx.load_cert_chain(tls.cert, tls.key)
    return ctx
