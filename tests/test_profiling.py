"""Profiling: per-node attribution on this CPU, kernel-name classification, ncu/nvprof parsing."""
import os

import pytest
import torch

import mpgraph
from mpgraph.tools import ncu
from mpgraph.cli import main as cli
from mpgraph.tools.profiling import is_tensor_core_kernel

from test_report import _blocks, _small_bert

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _read(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


TENSOR_CORE = [
    "volta_h884gemm_64x64_ldg8_nn",                                   # Volta
    "volta_fp16_s884gemm_fp16_128x128_ldg8_f2f_nn",
    "turing_fp16_s1688gemm_fp16_256x128_ldg8_f2f_tn",                  # Turing
    "turing_h1688gemm_128x128_ldg8_nt",
    "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn",     # Ampere
    "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32_stage4_warpsize2x2x1_tensor16x8x16_kernel",
    "sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x32_stage4",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
    "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN",                       # cuBLAS on Hopper
    "cutlass_80_tensorop_f16_s16816gemm_relu_f16_128x128_32x3_nn_align8",
    "void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_32x3_tn_align8>(Params)",
    "void flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::half_t>>",
]
NOT_TENSOR_CORE = [
    "volta_sgemm_128x64_nn",
    "ampere_sgemm_64x32_sliced1x4_tn",
    "cutlass_80_simt_sgemm_128x128_8x5_nn_align1",
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
    "void (anonymous namespace)::softmax_warp_forward<float, float, float, 8, false, false>",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>",
]


@pytest.mark.parametrize("name", TENSOR_CORE)
def test_tensor_core_kernel_names(name):
    assert is_tensor_core_kernel(name)


@pytest.mark.parametrize("name", NOT_TENSOR_CORE)
def test_cuda_core_kernel_names(name):
    assert not is_tensor_core_kernel(name)


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
    gm = mpgraph.convert(model, ids, dtype="bf16")  # planned for this CPU: profiled where it runs
    result = mpgraph.profile(gm, ids, iters=3)
    assert result.device == "cpu" and result.iters == 3
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
