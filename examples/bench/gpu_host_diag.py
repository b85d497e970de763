"""Where eager GPU time goes at user sizes (a GPU session's diagnostic, ~1 minute on an H200):
BERT-base's converted module against the HF model at 1x16 (fp32 kept everywhere) and 8x128
(fp16): CUDA-event medians, host time per call, the aten ops each issues (torch.profiler),
cProfile's top Python functions of one call, and which SDPA kernel the fp16 plan's attention
runs (with the inputs' dtypes and strides, and torch's reasons for refusing the fused ones).

    python examples/bench/gpu_host_diag.py
"""
from __future__ import annotations

import collections
import cProfile
import copy
import io
import pstats
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import mpgraph
from bench_strategies import build  # examples/bench/bench_strategies.py


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: a smoke run of the script)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def cuda_ms(f, rounds=30):
    if DEV == "cpu":
        t = time.perf_counter()
        with torch.no_grad():
            f()
        return (time.perf_counter() - t) * 1e3, 0.0
    with torch.no_grad():
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        times, host = [], []
        for _ in range(rounds):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            t = time.perf_counter()
            f()
            host.append((time.perf_counter() - t) * 1e3)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
    return statistics.median(times), statistics.median(host)


def aten_ops(f):
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                             torch.profiler.ProfilerActivity.CUDA]) as p:
        f()
        sync()
    names = collections.Counter(e.name for e in p.events() if e.name.startswith("aten::")
                                and e.cpu_parent is None)
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return names, len(kernels), [e.name for e in kernels]


def top_python(f, n=18):
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(10):
            f()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(n)
    return "\n".join(out.getvalue().splitlines()[:n + 12])


def describe(t):
    return (f"{tuple(t.shape)} {t.dtype} stride {t.stride()}" if isinstance(t, torch.Tensor)
            else repr(t))


def main():
    warnings.filterwarnings("ignore")
    cases = ((1, None), (8, torch.float16)) if DEV == "cuda" else ((1, None), (1, torch.float16))
    for batch, dtype in cases:
        model, x = build("bert", batch)
        model, x = model.to(DEV), x.to(DEV)
        gm = mpgraph.convert(model, (x,), dtype=dtype, target=None if DEV == "cuda" else "h100")
        half = copy.deepcopy(model).half()
        print(f"== BERT-base {tuple(x.shape)} dtype={dtype}: {gm.plan.summary()[:200]}")
        for name, f in (("hf fp32", lambda: model(x)), ("hf .half()", lambda: half(x)),
                        ("mpgraph", lambda: gm(x))):
            ms, host = cuda_ms(f)
            names, nk, _ = aten_ops(f)
            print(f"{name}: {ms:.2f} ms (host {host:.2f} ms), {sum(names.values())} top-level aten "
                  f"calls, {nk} kernels; most: {names.most_common(12)}")
        print("-- cProfile, hf fp32, 10 calls:\n" + top_python(lambda: model(x)))
        print("-- cProfile, mpgraph, 10 calls:\n" + top_python(lambda: gm(x)))
        if dtype is not None:
            try:
                seen = {}
                n = next((n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)), None)
                if n is None:
                    print("no scaled_dot_product_attention node in the plan")
                    continue
                print("sdpa node:", n.format_node())
                _, _, kernels = aten_ops(lambda: gm(x))
                print("fp16 plan kernels with 'attention'/'fmha'/'gemm' in name (first 8):",
                      [k for k in kernels if any(w in k.lower() for w in ("attn", "fmha", "flash", "xmma", "gemm"))][:8])
                _, _, hk = aten_ops(lambda: half(x))
                print(".half() kernels likewise:",
                      [k for k in hk if any(w in k.lower() for w in ("attn", "fmha", "flash", "xmma", "gemm"))][:8])
                # inputs as the graph gives them
                class Grab(torch.fx.Interpreter):
                    def run_node(self, node):
                        if node is n:
                            a, k = self.fetch_args_kwargs_from_env(node)
                            seen.update(args=a, kwargs=k)
                        return super().run_node(node)
                with torch.no_grad():
                    Grab(gm).run(x)
                print("sdpa inputs:", [describe(a) for a in seen["args"]], seen["kwargs"])
                from torch.nn.attention import SDPBackend, sdpa_kernel
                for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                SDPBackend.CUDNN_ATTENTION):
                    with warnings.catch_warnings(record=True) as w, sdpa_kernel(backend), torch.no_grad():
                        warnings.simplefilter("always")
                        try:
                            F.scaled_dot_product_attention(*seen["args"], **seen["kwargs"])
                            print(backend, "runs")
                        except Exception as e:  # noqa: BLE001
                            print(backend, "refused:", str(e)[:200], [str(m.message)[:300] for m in w])
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc()


if __name__ == "__main__":
    main()
