"""The `pdmesh` command: one entry point, one sub-command per component.

pdmesh serve            a whole local mesh (redis, router, prefill, decode, gateway)
pdmesh router|prefill|decode ...   one service alone, for deployments
pdmesh model path smollm2          where a model alias lives on disk (converted once)
pdmesh generate "prompt"           offline generation with the local engine
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-commands implemented by component modules, each exposing `main(argv) -> int`.
_COMPONENTS = {
    "serve": "pdmesh.router.local_mesh",
    "router": "pdmesh.router.server",
    "prefill": "pdmesh.prefill_svc.server",
    "decode": "pdmesh.decode_svc.server",
    "gateway": "pdmesh.gateway.server",
    "bench": "pdmesh.bench_cli",
    "ask": "pdmesh.client",
}


def _model_cmd(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh model")
    sub = parser.add_subparsers(dest="action", required=True)
    path = sub.add_parser("path", help="print the HF-format directory of a model alias or path")
    path.add_argument("model", nargs="?", default="smollm2")
    args = parser.parse_args(argv)
    from pdmesh.engine.model_store import resolve_model

    try:
        print(resolve_model(args.model))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _generate_cmd(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh generate")
    parser.add_argument("prompt", nargs="+")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    args = parser.parse_args(argv)
    from pdmesh import LLM, SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    for out in outs:
        print(out.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ["model", "generate", *_COMPONENTS]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(f"\ncommands: {', '.join(commands)}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "model":
        return _model_cmd(rest)
    if cmd == "generate":
        return _generate_cmd(rest)
    if cmd in _COMPONENTS:
        return int(importlib.import_module(_COMPONENTS[cmd]).main(rest) or 0)
    print(f"pdmesh: unknown command {cmd!r}; commands: {', '.join(commands)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
