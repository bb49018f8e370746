"""The `pdmesh` command: one entry point, one sub-command per component.

pdmesh serve [MODEL]    a whole local mesh (redis, router, prefill, decode, OpenAI API on
                        --port), flags named as in `vllm serve`
pdmesh router|prefill|decode ...   one service alone, for deployments
pdmesh model path smollm2          where a model alias lives on disk (converted once)
pdmesh generate "prompt"           offline generation with the local engine
pdmesh selftest [--model M]        this node's kernels against the reference, and greedy
                                   parity with transformers on random weights (a table)
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-commands implemented by component modules: `module` runs `module.main(argv) -> int`,
# `module:function` runs that function.
_COMPONENTS = {
    "serve": "pdmesh.serve.command",
    "router": "pdmesh.router.process",
    "prefill": "pdmesh.engines:prefill_main",
    "decode": "pdmesh.engines:decode_main",
    "gateway": "pdmesh.gateway.server",
    "bench": "pdmesh.bench_cli",
    "ask": "pdmesh.client",
    "selftest": "pdmesh.selftest",
}


def _model_cmd(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh model",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    path = sub.add_parser(
        "path", help="print the HF-format directory of a model alias, path or Hub id")
    path.add_argument("model", nargs="?", default="smollm2", help="alias, directory or Hub id")
    args = parser.parse_args(argv)
    from pdmesh.engine.model_store import resolve_model

    try:
        print(resolve_model(args.model))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _generate_cmd(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh generate",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("prompt", nargs="+")
    parser.add_argument("--model", default="smollm2", help="alias, directory or Hub id")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=None,
                        help="unset = the model's generation config")
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults: auto | vllm | a directory")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    args = parser.parse_args(argv)
    from pdmesh import LLM
    from pdmesh.engine.generation_config import default_sampling_params

    llm = LLM(args.model, generation_config=args.generation_config)
    overrides = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        overrides["temperature"] = args.temperature
    params = default_sampling_params(llm.generation_defaults, **overrides)
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
        print(f"\ncommands: {', '.join(commands)}; pdmesh --version; pdmesh COMMAND --help")
        return 0
    if argv[0] in ("--version", "-V", "version"):
        from pdmesh import __version__

        print(f"pdmesh {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "model":
        return _model_cmd(rest)
    if cmd == "generate":
        return _generate_cmd(rest)
    if cmd in _COMPONENTS:
        module, _, function = _COMPONENTS[cmd].partition(":")
        return int(getattr(importlib.import_module(module), function or "main")(rest) or 0)
    print(f"pdmesh: unknown command {cmd!r}; commands: {', '.join(commands)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
