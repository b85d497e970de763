"""Profiling: per-node attribution on this CPU, kernel-name classification, ncu/nvprof parsing."""
import os

import pytest
import torch
from torch.autograd.profiler_util import FunctionEvent

import mpgraph
from conftest import convert_rules
from mpgraph.tools import ncu
from mpgraph.cli import main as cli
from mpgraph.tools.profiling import (NOT_OBSERVED, RANGE_PREFIX, attribute, is_tensor_core_kernel,
                                     node_tensor_core)

from test_report import _blocks, _small_bert

# The ncu/nvprof CSV fixtures are written from NVIDIA's documentation of the formats (ncu's --csv
# long and --page raw layouts, nvprof's metric levels), not captured from a GPU run: no GPU was
# available. A real ncu CSV from a GPU should join them (issue 17).
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _read(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


# Kernel names and what their names say: True (Tensor Cores), False (CUDA cores, or no matmul at
# all), None (the name does not tell). The nvjet_sm90_hsh names and the ffma one are from an H200
# (issue 17: the ffma one was counted as Tensor Core); the others are names cuBLAS, cuDNN, CUTLASS,
# FlashAttention, PyTorch and Inductor print in public profiles, but one marked "constructed".
H200_HSH = "nvjet_sm90_hsh_96x64_64x10_1x2_h_bz_bias_TNN"
H200_FFMA = ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma_aligna4_alignc4"
             "_execute_kernel__5x_cublas")
NVJET_SSS = "nvjet_sm90_sss_64x8_64x16_1x2_h_bz_TNT"  # constructed: a bare fp32 tag, TF32 or FFMA
KERNELS = [
    # cuBLAS (nvjet): its type tag (libcublasLt's cublasLt<TAG>Matmul) names the types: h fp16,
    # t bf16, b int8, q/r fp8, o fp4, s fp32 (sss_tf32: TF32)
    (H200_HSH, True),
    ("nvjet_sm90_hsh_192x128_64x5_1x2_h_bz_coopB_bias_TNT", True),
    ("nvjet_sm90_hsh_64x8_64x16_1x2_h_bz_bias_TNT", True),
    ("nvjet_sm90_hsh_8x64_64x16_4x1_v_bz_bias_TNN", True),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", True),
    ("nvjet_sm90_tst_192x8_64x8_2x1_v_bz_TNT", True),                   # bf16
    ("nvjet_sm90_tss_64x8_64x16_4x1_v_bz_splitK_TNT", True),            # bf16 in, fp32 out
    ("nvjet_qqtst_128x256_128x6_2x1_2cta_v_bz_TNT", True),              # fp8 in, bf16 out
    ("nvjet_sm120_tst_mma_64x64x128_3_32x32x128_tmaAB_alignCD4_bz_TNNN", True),
    ("nvjet_sss_tf32_128x256_TNT", True),                               # fp32 data, TF32 math
    (NVJET_SSS, None),
    # cuBLAS/cuDNN xmma: the element types <A><B>_<math><acc>_<C> decide, not the sm80/xmma prefix
    (H200_FFMA, False),                                                 # issue 17: FFMA, not TC
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize256x64x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4"
     "_execute_kernel__5x_cublas", False),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize256x64x8", False),  # truncated: the types decide
    ("sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x32_stage4_warpsize2x2x1_tensor16x8x16_kernel",
     True),
    ("sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32_stage4_warpsize2x2x1_tensor16x8x16_kernel",
     True),
    ("sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8", True),
    ("sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_warpsize2x2x1"
     "_g1_tensor16x8x8_alignc4_execute_kernel__5x_cudnn", True),
    ("sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x32_stage4", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k"
     "_off_kernel__5x_cublas", True),
    ("sm90_xmma_gemm_f32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_on_kernel"
     "__5x_cublas", None),                                               # f32, math type not named
    # cuBLAS before Hopper: MMA shapes (h884, s1688, s16816) vs sgemm
    ("volta_h884gemm_64x64_ldg8_nn", True),
    ("volta_fp16_s884gemm_fp16_128x128_ldg8_f2f_nn", True),
    ("turing_h1688gemm_128x128_ldg8_nt", True),
    ("turing_fp16_s1688gemm_fp16_256x128_ldg8_f2f_tn", True),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn", True),
    ("volta_sgemm_128x64_nn", False),
    ("ampere_sgemm_64x32_sliced1x4_tn", False),
    ("maxwell_fp16_sgemm_fp16_128x32_nn", False),                       # fp16 data, FFMA math
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>", False),
    ("gemmSN_TN_kernel", False),
    ("void cublasLt::splitKreduce_kernel<(int)32, (int)16, int, float, __nv_bfloat16, float, __nv_bfloat16>",
     False),
    # cuDNN convolutions
    ("void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>",
     False),
    ("cutlass_tensorop_s1688fprop_optimized_tf32_64x64_16x10_nhwc_align4", True),
    # CUTLASS: tensorop vs simt
    ("cutlass_80_tensorop_f16_s16816gemm_relu_f16_128x128_32x3_nn_align8", True),
    ("void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_32x3_tn_align8>(Params)", True),
    ("cutlass3x_sm90_tensorop_s64x128x16gemm_f16_f16_f32_f16_f16_128x128x64_2x1x1_0_ttt_align8"
     "_warpspecialized_pingpong_epi_tma", True),
    ("cutlass_80_simt_sgemm_128x128_8x5_nn_align1", False),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>(Params)", False),
    # attention: FlashAttention is fp16/bf16 MMA only; memory-efficient attention by its dtype
    ("flash_fwd_kernel", True),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::half_t>>", True),
    ("flash_fwd_splitkv_kernel", True),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", True),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", None),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x256_4x1x1_cga1x1x1_kernel0_0",
     True),
    # not matmuls, and Inductor's Triton matmul (its name does not say which instructions)
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", False),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<at::native::AddFunctor<float>>>",
     False),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
     False),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 8, false, false>", False),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", False),
    ("triton_tem_fused_addmm_0", None),
]


@pytest.mark.parametrize("name,expected", KERNELS)
def test_kernel_names_say_tensor_core_cuda_core_or_unknown(name, expected):
    assert is_tensor_core_kernel(name) is expected


def test_node_verdict_from_its_kernels():
    add = "void at::native::elementwise_kernel<128, 2, AddFunctor<c10::Half>>"
    assert node_tensor_core([H200_HSH, add]) is True
    assert node_tensor_core([H200_HSH, H200_FFMA]) is False  # part of its matmul work on CUDA cores
    assert node_tensor_core([add]) is False                  # no matmul kernel ran at all
    assert node_tensor_core([NVJET_SSS, add]) is None        # unknown is not Tensor Core


def test_parse_ncu_long_form_with_nvtx_units_thousands_and_na():
    rows = ncu.parse_ncu_csv(_read("ncu_2022_long.csv"))
    assert [r.node for r in rows] == ["linear", "gelu", "linear_1"]
    assert rows[0].tensor_active == 61.25 and rows[1].tensor_active == 0.0
    assert rows[2].tensor_active is None  # n/a
    uses = {u.node: u for u in ncu.per_node(rows)}
    assert uses["linear_1"].time_ns == pytest.approx(1_204_160)  # "1,204.16" usecond
    assert uses["linear"].time_ns == pytest.approx(12_420)


def test_parse_ncu_raw_page_with_units_row():
    rows = ncu.parse_ncu_csv(_read("ncu_2024_raw.csv"))
    assert [r.node for r in rows] == ["linear", "linear_1", "softmax", None]  # a copy outside ranges
    assert rows[0].metrics["sm__inst_executed_pipe_tensor_op_gmma.sum"] == 1_048_576
    assert rows[0].units["gpu__time_duration.sum"] == "nsecond"
    assert rows[3].tensor_active is None
    uses = {u.node: u for u in ncu.per_node(rows)}
    assert set(uses) == {"linear", "linear_1", "softmax"}
    assert uses["linear"].tensor_active == 72.4 and uses["softmax"].tensor_active == 0.0
    assert uses["linear"].time_ns == 8192


def test_parse_nvprof_levels_and_map_by_kernel_name():
    rows = ncu.parse_nvprof_csv(_read("nvprof_v100.csv"))
    assert [r.tensor_active for r in rows] == [3.0, 0.0, 0.0]  # "Low (3)", "Idle (0)"
    uses = ncu.per_node(rows, {"volta_fp16_s884gemm_fp16_128x128_ldg8_f2f_nn": "linear",
                               "volta_sgemm_128x64_nn": "head"})
    assert {u.node: u.tensor_active for u in uses} == {"linear": 3.0, "head": 0.0}


def test_parse_garbage_is_a_clear_error():
    with pytest.raises(ValueError, match="no CSV table"):
        ncu.parse_ncu_csv("==PROF== Connected\nnothing else\n")
    with pytest.raises(ValueError, match="no kernel name column"):
        ncu.parse_ncu_csv('"a","b"\n"1","2"\n')


def test_ncu_command_and_metric_choice():
    query = ("Device NVIDIA H200 (GH100)\n---------\n"
             "sm__pipe_tensor_cycles_active   Counter  cycle  # of cycles where tensor pipe was active\n"
             "sm__inst_executed_pipe_tensor_op_gmma  Counter  inst  # of warp instructions\n"
             "gpu__time_duration  Counter  nsecond  total duration\n")
    metrics = ncu.available_metrics(query)
    assert metrics == ["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                       "sm__inst_executed_pipe_tensor_op_gmma.sum"]
    cmd = mpgraph.ncu_command(["python", "run.py"], metrics, log_file="out.csv")
    text = ncu.shell(cmd)
    assert text.startswith("ncu --nvtx --nvtx-include 'regex:mpgraph:.*/' --metrics ")
    assert "gpu__time_duration.sum" in text and "--csv --page raw --print-units base" in text
    assert text.endswith("--log-file out.csv python run.py")


def test_cpu_profile_attributes_time_to_every_compute_node():
    model, ids = _small_bert()
    # (planned for this CPU: profiled where it runs; at the example's shapes: a static capture)
    gm = mpgraph.convert(model, ids, dtype="bf16", dynamic=False)
    result = mpgraph.profile(gm, ids, iters=3)
    assert result.device == "cpu" and result.iters == 3
    assert result.kernels_observed and not result.unobserved  # a CPU profile has no kernels to miss
    profiled = {n.name: n for n in result.nodes}
    for record in gm.plan.compute_nodes:
        assert profiled[record.name].time_s > 0, record.name
    linear = profiled["linear"]
    assert linear.kernels and any("addmm" in k or "linear" in k or "matmul" in k for k in linear.kernels)
    assert linear.tensor_core is None and result.tensor_core_share is None  # not observable on CPU
    # the prediction is the cost model's for the dtype the plan gave it on this CPU (float32 on
    # one whose bf16 matmuls are slow, bf16 on one with AVX512-BF16/AMX)
    record = gm.plan.node("linear")
    assert linear.predicted_s == (record.t_fp32 if record.dtype == "float32" else record.t_low)
    casts = [n for n in result.nodes if n.op_class == "cast"]
    assert len(casts) == len(gm.plan.casts)
    text = mpgraph.report(gm, profile=result)
    assert "measured us" in text


def test_profile_leaves_the_inputs_and_the_module_s_state_as_they_were():
    """Each run used the caller's tensors and advanced the module's buffers: a forward writing
    its input (x.mul_(2)) left x 2**7 times itself after the default 7 runs, a counter at 7
    (probe pC 1)."""
    class Writes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(16, 16)
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            x.mul_(2)
            self.n += 1
            return self.l(x)

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    before = x.clone()
    gm = convert_rules(Writes().eval(), x, dtype="bf16", target="a100")
    assert torch.equal(x, before) and gm.n.item() == 0
    result = mpgraph.profile(gm, x, iters=2, warmup=1)
    assert result.iters == 2 and all(n.time_s > 0 for n in result.nodes
                                     if n.op_class not in ("cast", "view"))
    assert torch.equal(x, before) and gm.n.item() == 0


def test_profile_leaves_the_callers_random_streams_as_they_were():
    # a model drawing random numbers (dropout in training, rand_like) advanced the caller's
    # torch stream on every run (probe pK 7); convert, calibrate and report never did
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.d = torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)

        def forward(self, x):
            return self.d(self.l(x)) + torch.rand_like(x) * 0.01

    import random
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    gm = convert_rules(Noisy().train(), x, dtype="bf16", target="a100", mode="train")
    before, python = torch.get_rng_state(), random.getstate()
    mpgraph.profile(gm, x, iters=2, warmup=1)
    assert torch.equal(torch.get_rng_state(), before) and random.getstate() == python


def test_the_predicted_column_sums_to_the_plans_estimate_casts_included():
    """Cast rows had no prediction, though the plan's estimate charges each (7 us on an A100's
    eager roofline): the predicted column summed to 574 of its 644 us."""
    model, ids = _small_bert()
    gm = mpgraph.convert(model, ids, dtype="fp16", target="a100", dynamic=False)  # (ids only)
    result = mpgraph.profile(gm, ids, iters=1)
    casts = [n for n in result.nodes if n.op_class == "cast"]
    assert casts and all(n.predicted_s is not None and n.predicted_s > 0 for n in casts)
    predicted = sum(n.predicted_s for n in result.nodes if n.predicted_s is not None)
    assert predicted == pytest.approx(gm.plan.estimate["plan_s"], rel=1e-9)


ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>>"


def _cuda_events(gm, matmul_kernels, other=ELEMENTWISE, iters=2):
    """torch.profiler events of ``iters`` CUDA runs of ``gm`` as ``profile`` records them: per node
    a range ``mpgraph:<node>`` holding an ATen op that launched kernels, ``matmul_kernels(node)``
    ((name, us) pairs) for matmuls, ``other`` (1 us) for the rest. Under Nsight Compute, which
    holds CUPTI, the profiler sees no kernel at all."""
    matmuls = {r.name for r in gm.plan.nodes if r.op_class == "tensor_core"}
    events, t = [], 0.0
    for _ in range(iters):
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            span = FunctionEvent(len(events), RANGE_PREFIX + node.name, 0, t, t + 20)
            op = FunctionEvent(len(events) + 1, "aten::op", 0, t + 1, t + 19)
            launched = matmul_kernels(node.name) if node.name in matmuls else [(other, 1.0)] if other else []
            for kernel, us in launched:
                op.append_kernel(kernel, 0, us)
            span.append_cpu_child(op)
            events += [span, op]
            t += 20
    return events


def _fp16_blocks():
    model, x = _blocks()  # three Linear+ReLU and a head, all fp16 and aligned on an A100
    return convert_rules(model, x, dtype="fp16")


def _measured_column(report_text, node):
    """The report's measured column ("-", or "10 noTC") of a node's row."""
    line = next(l for l in report_text.splitlines() if l.startswith(node + " "))
    measured = line.split()[6]  # after node, op, class, dtype, t fp32, t low
    return " ".join(line.split()[6:8]) if measured != "-" else measured


def test_profile_without_observed_kernels_says_so_and_finds_nothing():
    gm = _fp16_blocks()
    result = attribute(_cuda_events(gm, lambda node: [], other=None), gm.plan, gm, 2, "cuda:0", True)
    assert result.kernels_observed is False
    assert result.nodes == [] and result.findings == [] and result.tensor_core_share is None
    assert {n.name for n in result.unobserved} >= {"blocks_0_0", "head", "softmax", "x_to_f16"}
    assert all(n.time_s is None and n.tensor_core is None for n in result.unobserved)
    assert result.node("head").time_s is None
    text = result.table()
    assert NOT_OBSERVED in text and "finding:" not in text and "measured us" not in text
    report = mpgraph.report(gm, profile=result)  # measured "-", not 0
    assert _measured_column(report, "blocks_0_0") == "-" and _measured_column(report, "softmax") == "-"


def test_profile_with_kernels_finds_a_cuda_core_gemm():
    gm = _fp16_blocks()
    linear = lambda node: [(H200_FFMA, 10.0)] if node == "blocks_0_0" else [(H200_HSH, 5.0)]
    result = attribute(_cuda_events(gm, linear), gm.plan, gm, 2, "cuda:0", True)
    assert result.kernels_observed and not result.unobserved
    assert [n.name for n in result.findings] == ["blocks_0_0"]
    assert "low precision and aligned" in result.node("blocks_0_0").finding
    assert H200_FFMA + " is a CUDA-core (FFMA) GEMM" in result.node("blocks_0_0").finding
    assert result.node("blocks_0_0").time_s == pytest.approx(10e-6)
    assert result.node("blocks_0_0").tensor_core is False and result.node("head").tensor_core is True
    assert result.tensor_core_share == pytest.approx(15 / 25)
    text = result.table()
    assert "60.0% of matmul/conv time on Tensor Core kernels" in text and "finding: blocks_0_0" in text
    assert _measured_column(mpgraph.report(gm, profile=result), "blocks_0_0") == "10 noTC"


def test_profile_with_tensor_core_kernels_unknown_names_and_a_matmul_without_kernels():
    gm = _fp16_blocks()
    linear = {"blocks_0_0": [(H200_HSH, 5.0)], "blocks_1_0": [(H200_HSH, 5.0)],
              "blocks_2_0": [(NVJET_SSS, 5.0)], "head": []}.get
    result = attribute(_cuda_events(gm, linear), gm.plan, gm, 2, "cuda:0", True)
    assert result.kernels_observed and result.findings == []
    assert [n.name for n in result.unobserved] == ["head"] and result.node("head").time_s is None
    assert result.node("blocks_2_0").tensor_core is None  # sss: not counted as Tensor Core
    assert result.tensor_core_share == pytest.approx(10 / 15)
    text = result.table()
    assert "66.7% of matmul/conv time on Tensor Core kernels (33.3% on kernels whose names" in text
    assert "not observed: no kernels seen for head" in text and "finding:" not in text
    row = next(l for l in text.splitlines() if l.startswith("blocks_2_0 "))
    assert " ?   " + NVJET_SSS in row
    report = mpgraph.report(gm, profile=result)
    assert _measured_column(report, "head") == "-" and _measured_column(report, "blocks_0_0") == "5 TC"


def test_profile_bad_input():
    model, x = _blocks()
    with pytest.raises(TypeError, match="returned by mpgraph.convert"):
        mpgraph.profile(model, x)
    gm = mpgraph.convert(model, x, dtype="bf16", target="cpu")
    with pytest.raises(ValueError, match="iters must be >= 1"):
        mpgraph.profile(gm, x, iters=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no GPU"):
            mpgraph.profile(gm, x, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
def test_gpu_profile_finds_tensor_core_kernels_for_fp16_matmuls():
    model, x = _blocks()
    x = x.cuda()
    gm = mpgraph.convert(model.cuda(), x, dtype="fp16", strategy="rules")
    result = mpgraph.profile(gm, x, iters=3)
    linears = [n for n in result.nodes if n.op_class == "tensor_core"]
    assert linears and all(n.kernels for n in linears)
    assert result.tensor_core_share is not None


def test_cli_profile_without_ncu_prints_the_command(tmp_path, capsys):
    factory = tmp_path / "factory.py"
    factory.write_text("import torch, torch.nn as nn\n"
                       "def build():\n"
                       "    return nn.Sequential(nn.Linear(64, 64), nn.ReLU()), torch.randn(16, 64)\n")
    if not torch.cuda.is_available():
        assert cli(["profile", f"{factory}:build", "--ncu"]) == 1
        err = capsys.readouterr().err
        assert "ncu --nvtx --nvtx-include" in err and "--ncu-csv mpgraph-ncu.csv" in err
    assert cli(["profile", f"{factory}:build", "--dtype", "bf16", "--iters", "2"]) == 0
    assert "measured us" in capsys.readouterr().out
    assert cli(["profile", "--ncu-csv", os.path.join(FIXTURES, "ncu_2024_raw.csv")]) == 0
    assert "linear_1" in capsys.readouterr().out


def test_a_node_without_a_float_value_is_predicted_at_its_float32_time():
    """An integer node (ids + 1) runs as captured: its prediction is its float32 time. It was
    its low-dtype time, inf where this CPU emulates the low dtype (the column's sum was inf)."""
    torch.manual_seed(0)

    class Pick(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 32)

        def forward(self, x, ids):
            return self.fc(x)[ids + 1]

    inputs = (torch.randn(8, 32), torch.tensor([0, 2]))
    fast = mpgraph.convert(Pick().eval(), inputs)
    record = fast.plan.node("add")
    assert record.dtype is None and record.t_fp32 is not None
    seen = {n.name: n for n in mpgraph.profile(fast, inputs, iters=2, warmup=1).nodes}
    assert seen["add"].predicted_s == record.t_fp32
