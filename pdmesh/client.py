"""A small synchronous client for the router's public gRPC API, and `pdmesh ask`.

For scripts and the quickstart; applications in other languages use the protos directly.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import grpc

from pdmesh.grpc_common import TLSConfig, channel_credentials
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc


def generate_stream(
    address: str,
    prompt: str,
    *,
    chat: bool = True,
    max_tokens: int = 64,
    temperature: float | None = None,
    tls: TLSConfig | None = None,
    timeout_s: float = 120.0,
) -> Iterator[str]:
    """Yield text deltas of sample 0 as the router streams them. `temperature` None leaves
    it to the server's defaults (the model's generation config)."""
    creds = channel_credentials(tls) if tls is not None else None
    channel = (
        grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)
    )
    with channel:
        stub = router_pb2_grpc.RouterStub(channel)
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
        if temperature is not None:
            sampling.temperature = temperature
        if chat:
            message = router_pb2.ChatMessage(role="user", content=prompt)
            request = router_pb2.GenerateRequest(
                chat=router_pb2.Chat(messages=[message]), sampling=sampling, stream=True
            )
        else:
            request = router_pb2.GenerateRequest(text=prompt, sampling=sampling, stream=True)
        for response in stub.Generate(request, timeout=timeout_s):
            if response.HasField("delta") and response.delta.index == 0:
                yield response.delta.text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh ask", description="one request to a router")
    parser.add_argument("prompt")
    parser.add_argument("--router", default="127.0.0.1:50051", help="router host:port")
    parser.add_argument("--raw", action="store_true", help="send as plain text, no chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None,
                        help="unset = the server's default (the model's generation config)")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-ca")
    args = parser.parse_args(argv)
    tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca)
    try:
        for text in generate_stream(
            args.router, args.prompt, chat=not args.raw, max_tokens=args.max_tokens,
            temperature=args.temperature, tls=tls,
        ):
            sys.stdout.write(text)
            sys.stdout.flush()
    except grpc.RpcError as exc:
        print(f"\npdmesh ask: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0
