"""The start-up self-check: every accelerator path checked against its reference on a probe.

The GPU paths (Triton layer ops and attention, CUDA graphs, async scheduling, on-device
sampling) are written on machines without a GPU and run on one only now and then. A wrong
kernel there gives wrong tokens, not an error, so the engine core checks them before it
reports ready, in seconds, and turns off what fails instead of serving from it:

- `layer_ops[dtype]`: the device's fused layer ops against `TorchLayerOps` on model-shaped
  tensors. Off on failure: the fused layer ops, CUDA graphs.
- `attention[dtype]`: the attention backend against `TorchAttentionBackend` on one mixed step
  (decode rows, one context several decode splits long, a fresh chunk, a chunk after a cached
  prefix): outputs and the KV cache. Off: the attention backend, CUDA graphs.
- `cuda_graphs`: graph replays against the same decode steps run eagerly, on a padded probe
  batch with a context longer than one split: logits finite and equal, KV caches equal
  (padding rows wrote nothing). Off: CUDA graphs.
- `async_pending`: steps launched before the previous one's ids reached the host against
  synchronous steps: the same greedy tokens. Off: async scheduling.
- `sampler`: greedy, temperature, top-p, top-k and seeded rows under
  `torch.cuda.set_sync_debug_mode("error")`: no host sync, every id inside its row's support.
  Off: async scheduling (its overlap needs a sampler that never waits for the device).

Each check returns a plain `CheckResult`; `apply_fallbacks` turns a report's failures into the
`EngineConfig` the model runner is built from (`enforce_eager`, `attention_backend="torch"`,
`async_scheduling=False`) and `fallback_layer_ops` into the runner's layer ops.
`PDMESH_STRICT_SELFCHECK=1` makes any failure fatal (GPU CI). The probe is a model of the
engine's own shape with two layers, a small vocabulary and random weights, and KV caches of
its own: the serving cache is never touched. Every check takes its device as an argument and
its implementation under test as a parameter, so its logic runs on CPU too (the CPU's native
kernels, or a deliberately wrong one); `pdmesh selftest` (pdmesh/selftest.py) prints them.

This module runs them and decides what a failure changes; the checks live beside it:
`selfcheck_kernels.py` (layer ops, attention, sampler), `selfcheck_probe.py` (the probe, graph
replay, async pending path) and `selfcheck_result.py` (outcomes, report, comparison).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core_types import SELFCHECK_FEATURES
from pdmesh.engine.worker.model_runner import ModelRunner
from pdmesh.engine.worker.models.llama import LlamaForCausalLM
from pdmesh.engine.worker.selfcheck_kernels import check_attention, check_layer_ops, check_sampler
from pdmesh.engine.worker.selfcheck_probe import (
    check_async_pending,
    check_graph_replay,
    probe_model,
)
from pdmesh.engine.worker.selfcheck_result import (
    CheckResult,
    SelfCheckReport,
    dtype_name,
)
from pdmesh.kernels.backend_selection import get_attention_backend
from pdmesh.kernels.layer_ops import LayerOps, TorchLayerOps

__all__ = ["CheckResult", "SelfCheckError", "SelfCheckReport", "apply_fallbacks",
           "engine_selfcheck", "fallback_layer_ops", "judge", "run_selfcheck",
           "with_runner_capture"]

logger = logging.getLogger(__name__)

STRICT_ENV = "PDMESH_STRICT_SELFCHECK"


class SelfCheckError(RuntimeError):
    """A check failed under PDMESH_STRICT_SELFCHECK=1."""


def run_selfcheck(config: EngineConfig, model: LlamaForCausalLM, device: torch.device
                  ) -> SelfCheckReport:
    """Every check for `model`'s shape on `device` as `config` would run it. Kernels are
    checked in float32 (tight: catches an off-by-one in a mask) and in the model's dtype."""
    mc, dtype = model.cfg, model.embed_tokens.weight.dtype
    dtypes = [torch.float32] if dtype == torch.float32 else [torch.float32, dtype]
    backend = get_attention_backend(config.attention_backend, device,
                                    block_size=config.block_size)
    results = [check_layer_ops(device, d, mc) for d in dtypes]
    results += [check_attention(device, d, mc, config.block_size, backend) for d in dtypes]
    probe = probe_model(model, device, dtype, seed=config.seed)
    try:
        results.append(check_graph_replay(probe, config.block_size, backend, device,
                                          config.enforce_eager))
        if config.use_async_scheduling(device):
            results.append(check_async_pending(probe, config.block_size, backend, device,
                                               config.enforce_eager))
        else:
            results.append(CheckResult(f"async_pending[{dtype_name(dtype)}]", str(device),
                                       "skip", "async scheduling is off"))
    finally:
        del probe
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results.append(check_sampler(device, mc.vocab_size))
    return SelfCheckReport(tuple(results))


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "0") not in ("", "0")


def engine_selfcheck(config: EngineConfig, model: LlamaForCausalLM, device: torch.device
                     ) -> SelfCheckReport:
    """The engine core's check before it reports ready: on CUDA only (a CPU runs the native
    kernels that every CPU test checks). Failures are logged as a WARNING and fall back;
    under PDMESH_STRICT_SELFCHECK=1 they raise `SelfCheckError` instead."""
    if device.type != "cuda":
        return SelfCheckReport(not_run=f"{device.type} device")
    report = run_selfcheck(config, model, device)
    return judge(report)


def judge(report: SelfCheckReport) -> SelfCheckReport:
    """Log the report; raise under PDMESH_STRICT_SELFCHECK=1 when a check failed."""
    if not report.failures:
        logger.info("self-check %s", report.summary())
        return report
    if strict():
        raise SelfCheckError(f"self-check {report.summary()} ({STRICT_ENV}=1)")
    logger.warning("self-check %s", report.summary())
    return report


def with_runner_capture(report: SelfCheckReport, runner: ModelRunner) -> SelfCheckReport:
    """The report once the serving runner is built: a CUDA-graph capture that failed there
    (the runner fell back to eager: `graphs_capture_failed`) is one more failed check, so the
    log, `CoreInfo`, GetInfo and the metric say it too, and strict mode refuses it."""
    if not runner.graphs_capture_failed:
        return report
    failed = CheckResult("cuda_graphs capture", str(runner.device), "fail",
                         runner.graphs_disabled_reason or "capture failed",
                         fallbacks=("cuda_graphs",))
    return judge(SelfCheckReport((*report.results, failed), report.not_run))


def apply_fallbacks(config: EngineConfig, fallbacks: tuple[str, ...]) -> EngineConfig:
    """The config the model runner is built from once `fallbacks` are off: eager decode steps
    (also when the layer ops fall back: graphs captured with the fused ops would keep them),
    the torch attention backend, synchronous sampling. The layer ops themselves are the
    runner's (`fallback_layer_ops`)."""
    unknown = set(fallbacks) - set(SELFCHECK_FEATURES)
    if unknown:
        raise ValueError(f"unknown self-check fallbacks {sorted(unknown)}")
    changes: dict[str, object] = {}
    if {"cuda_graphs", "layer_ops"} & set(fallbacks):
        changes["enforce_eager"] = True
    if "attention" in fallbacks:
        changes["attention_backend"] = "torch"
    if "async_scheduling" in fallbacks:
        changes["async_scheduling"] = False
    return dataclasses.replace(config, **changes) if changes else config  # type: ignore[arg-type]


def fallback_layer_ops(fallbacks: tuple[str, ...]) -> LayerOps | None:
    """The layer ops a runner must use instead of its device's best, or None."""
    return TorchLayerOps() if "layer_ops" in fallbacks else None
