"""The start-up self-check (engine/worker/selfcheck.py): its checks, what a failure changes.

On CPU every check's logic runs against the CPU's own kernels (the native layer ops and the
cpu attention backend, which is what `pdmesh selftest` checks on a CPU node) and against
deliberately wrong implementations passed in, which it must catch; the async pending path runs
forced on, as tests/engine/test_async_scheduling.py does. The fallback's effect on the config,
the strict switch, the report line, `CoreInfo`, the metric and GetInfo's mapping run here too.
Where CUDA exists, the whole check runs on a random-weight model of SmolLM2's shape and must
pass, and a sampler that syncs the host must be caught.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core_types import SELFCHECK_FEATURES
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.worker import selfcheck, selfcheck_kernels, selfcheck_probe
from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.models.llama import LlamaForCausalLM, RotaryEmbedding
from pdmesh.engine.worker.sampler import Sampler, SamplingMetadata
from pdmesh.engine.worker.selfcheck import (
    SelfCheckError,
    apply_fallbacks,
    fallback_layer_ops,
    judge,
)
from pdmesh.engine.worker.selfcheck_kernels import (
    check_attention,
    check_layer_ops,
    check_sampler,
    support_problem,
)
from pdmesh.engine.worker.selfcheck_probe import (
    check_async_pending,
    check_graph_replay,
    probe_model,
)
from pdmesh.engine.worker.selfcheck_result import CheckResult, SelfCheckReport, mismatch
from pdmesh.engine_svc.service import selfcheck_gauges
from pdmesh.kernels.backend import AttentionMetadata, TorchAttentionBackend
from pdmesh.kernels.backend_selection import get_attention_backend
from pdmesh.kernels.layer_ops import CpuLayerOps, TorchLayerOps
from pdmesh.metrics import EngineCollector, EngineState
from tests.metrics_text import counter
from tests.random_llama import SHAPES

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
# hidden 64, intermediate 96, 2 layers, 4 query heads over 2 KV heads of 16
MC = ModelConfig("llama", 128, 64, 96, 2, 4, 2, 16, 1e-5, 1024, False, False, False)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_model(mc: ModelConfig = MC) -> LlamaForCausalLM:
    torch.manual_seed(0)
    inv = 1.0 / (10000 ** (torch.arange(0, mc.head_dim, 2, dtype=torch.float) / mc.head_dim))
    return LlamaForCausalLM(mc, RotaryEmbedding(inv, 1.0, mc.max_position_embeddings)).eval()


# -- the comparison ----------------------------------------------------------------------------


def test_mismatch_names_shape_nan_and_error_above_the_dtypes_tolerance() -> None:
    ref = torch.ones(4, 8)
    assert mismatch("x", ref + 1e-4, ref, torch.float32) is None
    assert "max error" in str(mismatch("x", ref + 1e-2, ref, torch.float32))
    assert mismatch("x", ref + 1e-2, ref, torch.bfloat16) is None  # within bf16 rounding
    assert "shape" in str(mismatch("x", ref[:2], ref, torch.float32))
    nan = ref.clone()
    nan[1, 2] = float("nan")
    assert "NaN or Inf" in str(mismatch("x", nan, ref, torch.float32))
    # relative to the reference's magnitude: large values may differ by more in absolute terms
    assert mismatch("x", 1000 * ref + 1.0, 1000 * ref, torch.float32) is None


# -- layer ops -------------------------------------------------------------------------------------


class _NoSiluOps(TorchLayerOps):
    """silu_and_mul forgets the SiLU."""

    name = "no-silu"

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return gate * up


class _RopeOnlyQOps(TorchLayerOps):
    """rope_ rotates q and leaves k as it was."""

    name = "rope-q-only"

    def rope_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
        super().rope_(q, k.clone(), cos, sin)


def test_the_cpu_layer_ops_pass_against_the_reference() -> None:
    result = check_layer_ops(CPU, torch.float32, MC, ops=CpuLayerOps())
    assert result.outcome == "pass", result.detail
    assert result.name == "layer_ops[float32]" and result.device == "cpu"
    assert check_layer_ops(CPU, torch.float32, MC).outcome == "pass"  # the device's choice


@pytest.mark.parametrize(("ops", "op"), [(_NoSiluOps(), "silu_and_mul"),
                                         (_RopeOnlyQOps(), "rope")])
def test_a_wrong_layer_op_fails_and_turns_the_layer_ops_and_graphs_off(ops: TorchLayerOps,
                                                                       op: str) -> None:
    result = check_layer_ops(CPU, torch.float32, MC, ops=ops)
    assert result.failed and result.detail.startswith(op), result.detail
    assert result.fallbacks == ("layer_ops", "cuda_graphs")


def test_the_reference_is_not_checked_against_itself() -> None:
    result = check_layer_ops(CPU, torch.float32, MC, ops=TorchLayerOps())
    assert result.outcome == "skip" and not result.failed


# -- attention -------------------------------------------------------------------------------------


class _ShortContext(TorchAttentionBackend):
    """Decode rows attend to one token fewer than their context (an off-by-one in a mask)."""

    name = "short-context"

    def forward(self, query, key, value, kv_layer, meta, scale, window=0):  # type: ignore[no-untyped-def]
        short = dataclasses.replace(meta, decode_seq_lens=(meta.decode_seq_lens - 1).clamp(1),
                                    step_cache={})
        return super().forward(query, key, value, kv_layer, short, scale, window)


class _NextSlot(TorchAttentionBackend):
    """Writes each token's K/V one slot too far (its attention reads the right ones)."""

    name = "next-slot"

    def forward(self, query, key, value, kv_layer, meta, scale, window=0):  # type: ignore[no-untyped-def]
        out = super().forward(query, key, value, kv_layer.clone(), meta, scale, window)
        slots = kv_layer.shape[1] * kv_layer.shape[2]
        shifted = dataclasses.replace(meta, slot_mapping=(meta.slot_mapping + 1) % slots)
        super().forward(query, key, value, kv_layer, shifted, scale, window)
        return out


class _NoWindow(TorchAttentionBackend):
    """Attends over the whole context whatever the layer's window."""

    name = "no-window"

    def forward(self, query, key, value, kv_layer, meta, scale, window=0):  # type: ignore[no-untyped-def]
        return super().forward(query, key, value, kv_layer, meta, scale)


class _Raises(TorchAttentionBackend):
    name = "raises"

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("Failed to find C compiler")


def test_a_backend_that_ignores_sliding_windows_fails_for_a_model_with_them() -> None:
    windowed = dataclasses.replace(MC, windows=(4096,) * MC.num_layers)
    assert check_attention(CPU, torch.float32, MC, 16, _NoWindow()).outcome == "pass"
    result = check_attention(CPU, torch.float32, windowed, 16, _NoWindow())
    assert result.failed and "(window 37)" in result.detail, result.detail
    cpu = get_attention_backend("cpu", CPU)
    assert check_attention(CPU, torch.float32, windowed, 16, cpu).outcome == "pass"


def test_the_cpu_attention_backend_passes_on_a_mixed_step() -> None:
    backend = get_attention_backend("cpu", CPU)
    result = check_attention(CPU, torch.float32, MC, 16, backend)
    assert result.outcome == "pass", result.detail
    assert result.name == "attention[float32]"


@pytest.mark.parametrize(("backend", "what"), [
    (_ShortContext(), "decode rows"), (_NextSlot(), "kv cache"), (_Raises(), "raised"),
])
def test_a_wrong_attention_backend_fails_and_falls_back(backend: TorchAttentionBackend,
                                                        what: str) -> None:
    result = check_attention(CPU, torch.float32, MC, 16, backend)
    assert result.failed and result.detail.startswith(what), result.detail
    assert result.fallbacks == ("attention", "cuda_graphs")


def test_the_mixed_step_has_a_long_decode_context_and_both_kinds_of_chunk() -> None:
    step = selfcheck_kernels.mixed_step(MC, 16, CPU, torch.float32)
    meta: AttentionMetadata = step.meta()
    assert meta.num_decode_tokens == 4 and max(step.decode_lens) > 16 * 16  # > 2 splits of 8
    assert [ctx - chunk for ctx, chunk in step.prefill_lens] == [0, 33]  # fresh, after prefix
    assert len(step.slot_mapping) == 4 + sum(chunk for _, chunk in step.prefill_lens)
    assert len(set(step.slot_mapping.tolist())) == len(step.slot_mapping)


# -- the probe: async pending path, graphs --------------------------------------------------------


def test_the_probe_has_the_models_shape_two_layers_and_its_rope() -> None:
    model = tiny_model(dataclasses.replace(MC, num_layers=6, vocab_size=10_000,
                                           tie_word_embeddings=True))
    probe = probe_model(model, CPU, torch.float32)
    assert probe.cfg.num_layers == 2 and len(probe.layers) == 2
    assert probe.cfg.vocab_size == selfcheck_probe.PROBE_VOCAB
    assert probe.cfg.hidden_size == model.cfg.hidden_size
    assert probe.rope is model.rope
    assert probe.lm_head.weight is probe.embed_tokens.weight
    assert torch.equal(probe.norm.weight, torch.ones(MC.hidden_size))


def test_the_async_pending_path_matches_synchronous_steps_on_cpu() -> None:
    probe = probe_model(tiny_model(), CPU, torch.float32)
    result = check_async_pending(probe, 16, get_attention_backend("cpu", CPU), CPU)
    assert result.outcome == "pass", result.detail
    assert result.fallbacks == ("async_scheduling",)


def test_graph_replay_is_skipped_where_there_are_no_graphs() -> None:
    probe = probe_model(tiny_model(), CPU, torch.float32)
    result = check_graph_replay(probe, 16, get_attention_backend("cpu", CPU), CPU)
    assert result.outcome == "skip" and "not a CUDA device" in result.detail


# -- the sampler -----------------------------------------------------------------------------------


class _ArgminSampler(Sampler):
    def sample_ids(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return logits.argmin(dim=-1)


class _UnseededSampler(Sampler):
    """Ignores each row's generator: a seeded row draws differently each time."""

    def sample_ids(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        meta = dataclasses.replace(meta, generators=[None] * len(meta.generators))
        return super().sample_ids(logits, meta)


def test_the_sampler_passes_every_common_mode_on_cpu() -> None:
    result = check_sampler(CPU, 1000)
    assert result.outcome == "pass", result.detail
    assert {mode for mode, _ in selfcheck_kernels.SAMPLER_MODES} == {
        "greedy", "temperature", "top-p", "top-k", "seeded"}


def test_a_wrong_sampler_fails_and_turns_async_scheduling_off() -> None:
    result = check_sampler(CPU, 1000, sampler=_ArgminSampler(seed=0))
    assert result.failed and result.detail.startswith("greedy"), result.detail
    assert result.fallbacks == ("async_scheduling",)
    unseeded = check_sampler(CPU, 1000, sampler=_UnseededSampler(seed=0))
    assert unseeded.failed and "seeded" in unseeded.detail, unseeded.detail


def test_support_problem_knows_top_k_and_the_nucleus() -> None:
    row = torch.tensor([0.0, 5.0, 4.0, -3.0])
    top_k = SamplingParams(temperature=1.0, top_k=2)
    assert support_problem("k", top_k, row, 2) is None
    assert "top 2" in str(support_problem("k", top_k, row, 0))
    top_p = SamplingParams(temperature=1.0, top_p=0.5)
    assert support_problem("p", top_p, row, 1) is None
    assert "nucleus" in str(support_problem("p", top_p, row, 2))
    assert "outside the vocabulary" in str(support_problem("p", top_p, row, 4))


# -- what a failure changes ------------------------------------------------------------------------


def _report(*failed: tuple[str, tuple[str, ...]]) -> SelfCheckReport:
    results = [CheckResult("sampler", "cuda:0", "pass", seconds=0.5)]
    results += [CheckResult(name, "cuda:0", "fail", "wrong", 0.25, off) for name, off in failed]
    return SelfCheckReport(tuple(results))


def test_the_report_orders_fallbacks_and_says_it_in_one_line() -> None:
    ok = _report()
    assert ok.fallbacks == () and ok.summary().startswith("ok: 1 passed, 0 failed")
    bad = _report(("cuda_graphs[bfloat16]", ("cuda_graphs",)),
                  ("attention[float32]", ("attention", "cuda_graphs")))
    assert bad.fallbacks == ("cuda_graphs", "attention")  # SELFCHECK_FEATURES order, once each
    line = bad.summary()
    assert line.startswith("FAILED: 1 passed, 2 failed") and "attention[float32]: wrong" in line
    assert line.endswith("fell back: cuda_graphs, attention")
    assert SelfCheckReport(not_run="cpu device").summary() == "not run: cpu device"


def test_apply_fallbacks_turns_each_feature_off_in_the_config() -> None:
    config = EngineConfig(async_scheduling=True)
    assert apply_fallbacks(config, ()) is config
    eager = apply_fallbacks(config, ("cuda_graphs",))
    assert eager.enforce_eager and eager.async_scheduling and eager.attention_backend == "auto"
    assert apply_fallbacks(config, ("layer_ops",)).enforce_eager  # graphs would keep the ops
    torch_attn = apply_fallbacks(config, ("attention",))
    assert torch_attn.attention_backend == "torch" and not torch_attn.enforce_eager
    assert apply_fallbacks(config, ("async_scheduling",)).async_scheduling is False
    every = apply_fallbacks(config, SELFCHECK_FEATURES)
    assert (every.enforce_eager, every.attention_backend, every.async_scheduling) == (
        True, "torch", False)
    assert every.model == config.model and every.block_size == config.block_size
    with pytest.raises(ValueError, match="unknown"):
        apply_fallbacks(config, ("flash",))


def test_fallback_layer_ops_is_the_reference_only_when_they_failed() -> None:
    assert fallback_layer_ops(("cuda_graphs",)) is None
    assert isinstance(fallback_layer_ops(("layer_ops", "cuda_graphs")), TorchLayerOps)


def test_a_failure_warns_or_under_strict_refuses_to_start(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    bad = _report(("sampler", ("async_scheduling",)))
    monkeypatch.delenv(selfcheck.STRICT_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=selfcheck.__name__):
        assert judge(bad) is bad
    assert any(r.levelno == logging.WARNING and "fell back: async_scheduling" in r.message
               for r in caplog.records)
    monkeypatch.setenv(selfcheck.STRICT_ENV, "1")
    with pytest.raises(SelfCheckError, match="PDMESH_STRICT_SELFCHECK=1"):
        judge(bad)
    assert judge(_report()).fallbacks == ()  # a pass is never fatal
    monkeypatch.setenv(selfcheck.STRICT_ENV, "0")
    assert judge(bad) is bad


def test_a_failed_capture_of_the_serving_runner_counts_as_a_failed_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    probe = probe_model(tiny_model(), CPU, torch.float32)
    prompts = selfcheck_probe.probe_prompts(probe, 16, 1)
    runner, _ = selfcheck_probe.probe_runner(probe, 16, get_attention_backend("cpu", CPU), CPU,
                                             prompts, 1, enforce_eager=False)
    ok = _report()
    assert selfcheck.with_runner_capture(ok, runner) is ok  # a CPU runner: no graphs wanted
    runner.graphs_capture_failed = True  # what ModelRunner.use_graphs records on CUDA
    runner.graphs_disabled_reason = "capture failed: RuntimeError: operation not permitted"
    monkeypatch.delenv(selfcheck.STRICT_ENV, raising=False)
    after = selfcheck.with_runner_capture(ok, runner)
    assert after.fallbacks == ("cuda_graphs",)
    assert "cuda_graphs capture: capture failed: RuntimeError" in after.summary()
    monkeypatch.setenv(selfcheck.STRICT_ENV, "1")
    with pytest.raises(SelfCheckError):
        selfcheck.with_runner_capture(ok, runner)


def test_the_engine_checks_only_accelerators() -> None:
    report = selfcheck.engine_selfcheck(EngineConfig(), tiny_model(), CPU)
    assert report.results == () and report.summary() == "not run: cpu device"


def write_config(path: Path, shape: dict[str, object]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", **shape}
    (path / "config.json").write_text(json.dumps(config))
    return path


TINY_SHAPE = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False}


def test_core_info_carries_the_selfcheck_line(tmp_path: Path) -> None:
    from pdmesh.engine.core.engine_core import EngineCore

    model_dir = write_config(tmp_path / "m", TINY_SHAPE)
    core = EngineCore(EngineConfig(model=str(model_dir), load_format="dummy", device="cpu",
                                   kv_cache_memory="4MiB"), eos_token_ids=())
    try:
        info = core.info()
        assert info.selfcheck == "not run: cpu device" and info.selfcheck_fallbacks == ()
    finally:
        core.close()


def test_the_metric_shows_every_feature_and_getinfo_maps_the_fallbacks() -> None:
    gauges = selfcheck_gauges(("attention", "cuda_graphs"))
    assert list(gauges) == list(SELFCHECK_FEATURES)
    assert gauges == {"cuda_graphs": True, "attention": True, "layer_ops": False,
                      "async_scheduling": False}
    registry = CollectorRegistry()
    registry.register(EngineCollector("decode", lambda: EngineState(
        num_running=0, num_waiting=0, kv_usage=0.0, num_free_blocks=1, num_total_blocks=1,
        num_pinned_blocks=0, prefix_query_tokens=0, prefix_hit_tokens=0, index_up=None,
        selfcheck_fallbacks=gauges), model_name="m"))
    text = generate_latest(registry).decode()
    name = "pdmesh:engine_selfcheck_fallback"
    assert counter(text, name, feature="attention", role="decode") == 1.0
    assert counter(text, name, feature="cuda_graphs") == 1.0
    assert counter(text, name, feature="layer_ops") == 0.0
    assert f'{name}{{feature="async_scheduling",model_name="m",role="decode"}} 0.0' in text


# -- CUDA: the whole check -------------------------------------------------------------------------


def _smollm2_shaped(tmp_path: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    from pdmesh.engine.worker.model_loader import load_model

    model_dir = write_config(tmp_path / "smollm2", SHAPES["smollm2-135m"])
    model, _, _ = load_model(model_dir, dtype, torch.device("cuda"), 2048, load_format="dummy")
    return model


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_check_passes_on_cuda(tmp_path: Path, dtype: torch.dtype) -> None:
    model = _smollm2_shaped(tmp_path, dtype)
    config = EngineConfig(dtype=str(dtype).removeprefix("torch."), device="cuda")
    report = selfcheck.run_selfcheck(config, model, torch.device("cuda"))
    outcomes = {r.name: r.outcome for r in report.results}
    assert not report.failures, report.summary()
    name = str(dtype).removeprefix("torch.")
    for check in (f"layer_ops[{name}]", f"attention[{name}]", f"cuda_graphs[{name}]",
                  f"async_pending[{name}]", "sampler"):
        assert outcomes[check] == "pass", (check, report.summary())
    assert sum(r.seconds for r in report.results) < 120, report.summary()


@needs_cuda
def test_a_sampler_that_syncs_the_host_is_caught_on_cuda() -> None:
    class Syncing(Sampler):
        def sample_ids(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
            ids = super().sample_ids(logits, meta)
            assert int(ids.max()) < logits.shape[1]  # a host read: a sync
            return ids

    cuda = torch.device("cuda")
    assert check_sampler(cuda, 49152).outcome == "pass"
    result = check_sampler(cuda, 49152, sampler=Syncing(seed=0, device=cuda))
    assert result.failed and result.detail.startswith("raised"), result.detail
    assert not torch.cuda.get_sync_debug_mode()  # restored


@needs_cuda
def test_the_engine_core_runs_it_and_reports_it_on_cuda(tmp_path: Path) -> None:
    from pdmesh.engine.core.engine_core import EngineCore

    model_dir = write_config(tmp_path / "smollm2", SHAPES["smollm2-135m"])
    core = EngineCore(EngineConfig(model=str(model_dir), load_format="dummy", device="cuda",
                                   kv_cache_memory="256MiB"), eos_token_ids=())
    try:
        info = core.info()
        assert info.selfcheck.startswith("ok: "), info.selfcheck
        assert info.selfcheck_fallbacks == ()
        assert core.runner.cuda_graphs is not None and core.async_scheduling
    finally:
        core.close()
