"""Planning models larger than this machine: Llama decoders built on the meta device.

For HuggingFace ``LlamaConfig`` decoders of 2, 8 and 32 layers (hidden 4096) and the
Llama-2-70B shape (80 layers, hidden 8192, intermediate 28672, 64 heads, 8 KV heads), built under
``torch.device("meta")`` (no weight is allocated), each in its own process: the time of
``mpgraph.capture`` alone (torch.export on the meta tensors), of the whole ``mpgraph.convert``
(its own trace on fake tensors that claim the CPU, see mpgraph/frontend/fake.py, then every pass,
planned for an H100 in bf16), of the min-cut solve inside it, and the process's peak resident
memory. Bar (issue 9): the 70B-shaped plan in under 30 s and 4 GiB.

    python examples/bench/bench_scale.py
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

CONFIGS = {  # name: (layers, hidden, intermediate, heads, kv heads)
    "llama 2 layers": (2, 4096, 11008, 32, 32),
    "llama 8 layers": (8, 4096, 11008, 32, 32),
    "llama 32 layers (7B shape)": (32, 4096, 11008, 32, 32),
    "llama 80 layers (70B shape)": (80, 8192, 28672, 64, 8),
}


def child(name: str) -> dict:
    import torch
    import transformers as hf

    import mpgraph
    import mpgraph.cost.mincut as mincut
    import mpgraph.passes.assign_precision_optimal as optimal

    layers, hidden, inter, heads, kv = CONFIGS[name]
    cfg = hf.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=32000,
                         use_cache=False)
    with torch.device("meta"):
        model = hf.LlamaModel(cfg).eval()
    ids = torch.randint(0, 32000, (1, 128), device="meta")
    solve_s = [0.0]
    solve = mincut.solve

    def timed(problem):
        t = time.perf_counter()
        try:
            return solve(problem)
        finally:
            solve_s[0] += time.perf_counter() - t

    optimal.solve = timed
    t = time.perf_counter()
    mpgraph.capture(model, (ids,))
    capture_s = time.perf_counter() - t
    t = time.perf_counter()
    gm = mpgraph.convert(model, ids, dtype="bf16", target="h100")
    convert_s = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    return {"capture_s": capture_s, "convert_s": convert_s, "solve_s": solve_s[0],
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "nodes": len(gm.plan.nodes), "params_b": params / 1e9,
            "meta": all(p.device.type == "meta" for p in gm.parameters()),
            "summary": gm.plan.summary()}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return
    rows = []
    for name in CONFIGS:
        done = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True,
                              text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"# {name}: {r['summary']}", flush=True)
        rows.append(f"| {name} | {r['params_b']:.1f}B | {r['nodes']} | {r['capture_s']:.1f} | "
                    f"{r['convert_s']:.1f} | {r['solve_s']:.2f} | {r['peak_gib']:.2f} | "
                    f"{'yes' if r['meta'] else 'NO'} |")
    print("\n| model (meta device) | parameters | graph nodes | capture s | convert s (all) | "
          "min-cut s | peak GiB | weights still meta |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
