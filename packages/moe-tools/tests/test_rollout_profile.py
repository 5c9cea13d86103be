"""``moe-bench rollout --profile``: the name rules, the arithmetic, the kineto attribution on a
synthetic trace (eager launches and CUDA-graph replays), the CPU command end to end, the report."""

from __future__ import annotations

import json
import math

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from moe_model.engine import DECODE_SCOPE, FRAME_SCOPE
from moe_tools import cli, report, rollout, rollout_profile
from moe_tools.env import environment
from moe_tools.results import make_document, write_json
from moe_tools.rollout_profile import CATEGORIES, Activity, breakdown, categorize, rule_category
from moe_tools.tables import format_value

NAMES = [
    # moe_kernels (Triton's names; Inductor appends "_<n>" to user kernels)
    ("topk_rows_kernel", "routing"),
    ("topk_columns_kernel_0", "routing"),
    ("scan_kernel", "routing"),
    ("place_kernel_2", "routing"),
    ("expert_runs_kernel", "routing"),
    ("fused_kernel", "routing"),
    ("_router_kernel", "routing"),
    ("_gather_rows_kernel_1", "routing"),
    ("_combine_kernel", "routing"),
    ("_scatter_add_kernel", "routing"),
    ("_gather_grouped_mm_kernel", "gemm"),
    ("_gather_grouped_mm_kernel_3", "gemm"),
    ("_mxfp8_dim1_regs_kernel", "pointwise"),
    ("_blocked_3d_kernel", "pointwise"),
    # cuBLAS / CUTLASS
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "gemm"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4>", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float>", "gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<>>", "gemm"),
    # attention: flash (a CUTLASS name inside), memory-efficient, cuDNN SDPA (an sm90 name)
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<cutlass::half_t>>", "attention"),
    ("void pytorch_flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0", "attention"),
    # Inductor
    ("triton_poi_fused_add_mul_silu_0", "pointwise"),
    ("triton_red_fused__to_copy_mean_pow_1", "pointwise"),
    ("triton_per_fused_native_layer_norm_2", "pointwise"),
    ("triton_tem_fused_mm_3", "gemm"),
    ("triton_per_fused_cumsum_4", "routing"),
    # ATen CUDA kernels, copies
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<>>", "pointwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "pointwise"),
    ("void at::native::(anonymous namespace)::indexFuncLargeIndex<float, long>", "pointwise"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>", "pointwise"),
    ("void at::native::bitonicSortKVInPlace<float, long>", "routing"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<Policy900, true>", "routing"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "routing"),
    ("Memcpy DtoD (Device -> Device)", "pointwise"),
    ("Memset (Device)", "pointwise"),
    ("mystery_kernel", "other"),
    # ATen / custom ops (the CPU path)
    ("aten::mm", "gemm"),
    ("aten::addmm", "gemm"),
    ("aten::_grouped_mm", "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::sort", "routing"),
    ("moe_kernels::route", "routing"),
    ("moe_kernels::router_scores", "routing"),
    ("moe_kernels::gather_grouped_mm", "gemm"),
    ("moe_model::kv_write", "pointwise"),
    ("aten::add", "pointwise"),
    ("aten::mul", "pointwise"),
    ("aten::index_copy_", "pointwise"),
    ("aten::view", "other"),
]


@pytest.mark.parametrize(("name", "category"), NAMES)
def test_rules_classify_known_names(name, category):
    assert rule_category(name) == category


def test_rules_are_a_table_over_the_categories():
    cats = [r.category for r in rollout_profile.CATEGORY_RULES]
    assert cats == ["attention", "gemm", "routing", "pointwise"]  # the order is the precedence
    assert set(cats) | {"decode", "other"} == set(CATEGORIES)


def test_categorize_by_scope_first():
    conv = "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc"
    assert categorize("nvjet_tst_128x256", "decode") == "decode"  # a decoder GEMM is decode
    assert categorize("nvjet_tst_128x256", "outside") == "other"
    assert categorize("nvjet_tst_128x256", "frame") == "gemm"
    assert categorize(conv, "unknown") == "decode"  # no launch found: a convolution is decode
    assert categorize(conv, "frame") == "gemm"  # the decode name rule only for the unknown
    assert categorize("triton_poi_fused_add_0", "unknown") == "pointwise"
    assert categorize("Memcpy HtoD (Pageable -> Device)", "unknown") == "pointwise"
    assert categorize("void convert_fp8_kernel<>", "unknown") == "other"  # "convert" is no conv


def test_breakdown_arithmetic():
    acts = [
        Activity("nvjet_a", 300.0, "frame", True),
        Activity("nvjet_b", 100.0, "frame", True),
        Activity("flash_fwd_kernel", 200.0, "frame", True),
        Activity("topk_rows_kernel", 50.0, "unknown", True),
        Activity("triton_poi_fused_0", 150.0, "frame", True),
        Activity("nvjet_c", 100.0, "decode", True),
        Activity("Memcpy DtoH (Device -> Pageable)", 100.0, "outside", False),
    ]
    b = breakdown(acts, 2, host_us=900.0, launches=6, basis="device")
    ms = {c.category: c.ms_per_frame for c in b.categories}
    assert [c.category for c in b.categories] == list(CATEGORIES)
    assert ms == pytest.approx(
        {
            "gemm": 0.2,
            "attention": 0.1,
            "routing": 0.025,
            "pointwise": 0.075,
            "decode": 0.05,
            "other": 0.05,
        }
    )
    assert b.device_ms_per_frame == pytest.approx(0.5)
    assert math.fsum(c.share for c in b.categories) == pytest.approx(1.0)
    assert {c.category: c.share for c in b.categories}["gemm"] == pytest.approx(0.4)
    assert b.kernels_per_frame == 3.0  # the memcpy is no kernel
    assert {c.category: c.kernels_per_frame for c in b.categories}["gemm"] == 1.0
    assert b.launches_per_frame == 3.0 and b.host_ms_per_frame == pytest.approx(0.45)
    assert b.attribution == {"correlated": 6, "name_rules": 1}
    doc = b.to_dict()
    assert json.loads(json.dumps(doc)) == doc and doc["status"] == "ok"
    empty = breakdown([], 1, host_us=0.0, launches=None, basis="cpu_self")
    assert empty.device_ms_per_frame == 0.0 and all(c.share == 0.0 for c in empty.categories)
    assert empty.launches_per_frame is None
    with pytest.raises(ValueError, match="frames"):
        breakdown(acts, 0, host_us=0.0, launches=None, basis="device")


def _ev(id_, name, kind, start, end, *, linked=0, thread=1, device=DeviceType.CPU):
    e = FunctionEvent(
        id=id_,
        name=name,
        thread=thread,
        start_us=start,
        end_us=end,
        device_type=device,
        use_device="cuda",
        is_user_annotation=kind == "user_annotation",
    )
    # torch >= 2.13 records these; older torch's events have neither (read off the name)
    e.activity_type, e.linked_correlation_id = kind, linked
    return e


def _kernel(cupti_id, name, start, end, *, linked=0, kind="kernel"):
    return _ev(cupti_id, name, kind, start, end, linked=linked, device=DeviceType.CUDA)


def _trace() -> EventList:
    """One frame as kineto reports it: an eager op launch, a CUDA-graph replay (its kernels share
    the cudaGraphLaunch's CUPTI id, a runtime call kineto linked to no op: another thread id, out
    of the tree), a kernel linked to its op only, the decode replay, the image copy outside both
    ranges, kernels with no launching event or an unplaceable one, a device-side range."""
    events = [
        _ev(1, FRAME_SCOPE, "user_annotation", 0, 100),
        _ev(2, "aten::mm", "cpu_op", 10, 20),
        _ev(500, "cudaLaunchKernel", "cuda_runtime", 12, 14, linked=2),
        _kernel(500, "nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NNT", 200, 260, linked=2),
        _ev(501, "cudaGraphLaunch", "cuda_runtime", 30, 35, thread=4242),
        _kernel(501, "triton_poi_fused_add_0", 300, 310),
        _kernel(501, "_gather_grouped_mm_kernel_0", 310, 350),
        _kernel(501, "topk_rows_kernel_1", 350, 355),
        _ev(4, "aten::add", "cpu_op", 40, 50),
        _kernel(600, "void at::native::vectorized_elementwise_kernel<4>", 360, 365, linked=4),
        _ev(3, DECODE_SCOPE, "user_annotation", 100, 150),
        _ev(502, "cudaGraphLaunch", "cuda_runtime", 110, 112, thread=4242),
        _kernel(502, "sm90_xmma_fprop_implicit_gemm_bf16", 400, 440),
        _ev(5, "aten::to", "cpu_op", 160, 170),
        _ev(503, "cudaMemcpyAsync", "cuda_runtime", 161, 169, linked=5),
        _kernel(503, "Memcpy DtoH (Device -> Pageable)", 450, 470, linked=5, kind="gpu_memcpy"),
        _kernel(999, "implicit_convolve_sgemm", 480, 490),
        _kernel(998, "nvjet_orphan", 490, 495),
        _ev(504, "cudaGraphLaunch", "cuda_runtime", 180, 182, thread=4242),  # in no range
        _kernel(504, "triton_red_fused_sum_0", 500, 502),
        _kernel(7, FRAME_SCOPE, 200, 365, kind="gpu_user_annotation"),
    ]
    events = EventList(sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)))
    events._build_tree()  # as profile.events() does
    return events


def test_cuda_attribution_eager_graph_and_fallbacks():
    trace = rollout_profile.cuda_activities(_trace())
    scopes = {a.name: a.scope for a in trace.activities}
    assert scopes == {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NNT": "frame",  # runtime call -> op -> frame
        "triton_poi_fused_add_0": "frame",  # graph replay: by the launch's time in the range
        "_gather_grouped_mm_kernel_0": "frame",
        "topk_rows_kernel_1": "frame",
        "void at::native::vectorized_elementwise_kernel<4>": "frame",  # linked op only
        "sm90_xmma_fprop_implicit_gemm_bf16": "decode",
        "Memcpy DtoH (Device -> Pageable)": "outside",
        "implicit_convolve_sgemm": "unknown",
        "nvjet_orphan": "unknown",
        "triton_red_fused_sum_0": "unknown",  # its call is out of the tree and of every range
    }
    assert trace.launches == 4  # cudaLaunchKernel + three cudaGraphLaunch, not the memcpy
    b = breakdown(
        trace.activities,
        1,
        host_us=rollout_profile.host_us(_trace()),
        launches=trace.launches,
        basis="device",
    )
    ms = {c.category: c.ms_per_frame for c in b.categories}
    assert ms == pytest.approx(
        {
            "gemm": 0.105,
            "attention": 0.0,
            "routing": 0.005,
            "pointwise": 0.017,
            "decode": 0.05,
            "other": 0.02,
        }
    )
    assert b.kernels_per_frame == 9 and b.host_ms_per_frame == pytest.approx(0.15)
    assert b.attribution == {"correlated": 7, "name_rules": 3}


def test_cli_rollout_profile_on_cpu(tmp_path, capsys):
    js = tmp_path / "p.json"
    argv = [
        "rollout",
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--frames",
        "2",
        "--warmup-frames",
        "0",
        "--profile",
        "--profile-frames",
        "1",
        "--no-progress",
        "--json",
        str(js),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "fps" in out and "share_pct" in out and "# host " in out
    doc = json.loads(js.read_text())
    assert doc["rows"][0]["status"] == "ok" and doc["rows"][0]["cuda_graph"] is False
    prof = doc["extra"]["profile"]
    assert prof["status"] == "ok" and prof["basis"] == "cpu_self" and prof["frames"] == 1
    cats = {c["category"]: c for c in prof["categories"]}
    assert list(cats) == list(CATEGORIES)
    assert math.fsum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    for name in ("gemm", "attention", "routing", "pointwise", "decode"):  # tiny: torch routing
        assert cats[name]["ms_per_frame"] > 0, name
    assert prof["launches_per_frame"] is None and prof["kernels_per_frame"] > 0
    # what lies in the two ranges (all but "other") cannot exceed the ranges' wall time
    inside = prof["device_ms_per_frame"] - cats["other"]["ms_per_frame"]
    assert 0 < inside <= prof["host_ms_per_frame"] * 1.001
    for line in out.splitlines():
        if line.startswith("gemm "):
            assert line.split()[1] == format_value(cats["gemm"]["ms_per_frame"])


def test_profile_failure_keeps_the_row(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(rollout_profile, "profile_engine", boom)
    res = rollout.run(
        device="cpu", preset="tiny", frames=1, warmup_frames=0, progress=False, profile=True
    )
    assert res.rows[0]["status"] == "ok"
    assert res.extra["profile"] == {"status": "failed: RuntimeError: no profiler here"}
    assert res.text.endswith("# profile: failed: RuntimeError: no profiler here")


def _profile_doc() -> dict:
    acts = [
        Activity("nvjet_a", 600.0, "frame", True),
        Activity("triton_poi_fused_0", 300.0, "frame", True),
        Activity("nvjet_b", 100.0, "unknown", True),
    ]
    return breakdown(acts, 2, host_us=200.0, launches=4, basis="device").to_dict()


def test_report_renders_a_profile(tmp_path):
    doc = make_document(
        "rollout",
        [{"fps": 100.0}],
        environment("cpu"),
        cmdline="moe-bench rollout --profile",
        extra={"title": "rollout seed-moe", "profile": _profile_doc()},
    )
    write_json(tmp_path / "res" / "rollout.json", doc)
    md = report.markdown_report(tmp_path / "res")
    assert "| category | ms_per_frame | share_pct | kernels_per_frame |" in md
    assert "| gemm | 0.35 | 70 | 1 |" in md  # (600 + 100) us / 2 frames, 70 %
    assert "| pointwise | 0.15 | 30 | 0.5 |" in md
    assert "| total | 0.5 | - | 1.5 |" in md
    assert "* host 0.1 ms/frame" in md and "2 launch calls/frame" in md
    assert "* 1 of 3 device activities placed by name rules alone" in md
    assert "title: rollout seed-moe" in md  # the scalars line is still there
    text = rollout_profile.format_profile(_profile_doc())
    assert text.splitlines()[0].split() == rollout_profile.PROFILE_COLUMNS
    failed = rollout_profile.markdown_profile({"status": "failed: RuntimeError: x"})
    assert failed == "* profile: failed: RuntimeError: x"


def test_report_renders_one_profile_per_mode(tmp_path):
    profiles = [{"mode": m, **_profile_doc()} for m in ("compile", "graph")]
    extra = {"title": "t", "profiles": profiles, "profile": profiles[-1]}
    doc = make_document("rollout", [{"fps": 1.0}], environment("cpu"), extra=extra)
    write_json(tmp_path / "res" / "rollout.json", doc)
    md = report.markdown_report(tmp_path / "res")
    assert md.index("Profile, mode compile:") < md.index("Profile, mode graph:")
    assert md.count("| total | 0.5 | - | 1.5 |") == 2


def test_plot_profile(tmp_path):
    pytest.importorskip("matplotlib")
    out = rollout_profile.plot_profile(_profile_doc(), tmp_path / "p.png", title="t")
    assert out.read_bytes()[:4] == b"\x89PNG"
    empty = rollout_profile.plot_profile({"status": "failed: x"}, tmp_path / "e.png")
    assert empty.read_bytes()[:4] == b"\x89PNG"


def test_kind_read_off_events_without_activity_type():
    """torch < 2.13 records no activity type: kernels, memcpys, runtime calls, annotations and
    ops are told apart by device, flag and name."""
    from moe_tools.rollout_profile import _kind

    def ev(name, device=DeviceType.CPU, annotation=False):
        e = FunctionEvent(id=1, name=name, thread=1, start_us=0, end_us=1, device_type=device,
                          is_user_annotation=annotation)  # fmt: skip
        e.activity_type = None  # what older torch's events amount to
        return e

    assert _kind(ev("triton_poi_fused_0", DeviceType.CUDA)) == "kernel"
    assert _kind(ev("Memcpy DtoH (Device -> Pinned)", DeviceType.CUDA)) == "gpu_memcpy"
    assert _kind(ev("Memset (Device)", DeviceType.CUDA)) == "gpu_memset"
    assert _kind(ev("moe_model::frame", DeviceType.CUDA)) == "gpu_user_annotation"
    assert _kind(ev("cudaGraphLaunch")) == _kind(ev("cuLaunchKernelEx")) == "cuda_runtime"
    assert _kind(ev("moe_model::decode", annotation=True)) == "user_annotation"
    assert _kind(ev("aten::mm")) == "cpu_op"
