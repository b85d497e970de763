"""Generation benchmark: time to first token and per-token latency of a Llama decoder.

Variants, all greedy, random weights from a config (nothing downloads):

- ``fp32``: HF ``model.generate`` on the float32 model (its default dynamic cache);
- ``autocast``: the same under ``torch.autocast(dtype)``;
- ``.half()``: HF ``generate`` on a ``.half()`` copy (``.bfloat16()`` with ``--dtype bf16``);
- ``mpgraph eager``: ``mpgraph.convert_decoder`` (prefill + one-token decode graphs, one static
  KV cache, the plan for this machine's GPU), ``mpgraph.generate(..., cuda_graph=False)``;
- ``mpgraph graph``: the same with the decode step replayed from a CUDA graph (CUDA only).

Time to first token (TTFT) is the time of ``generate(max_new_tokens=1)``: the prompt's prefill
and the first token; per-token latency is ``(T(new) - T(1)) / (new - 1)``; medians over
``--reps`` rounds, each timing both back to back, after a warm-up run (which also captures the
CUDA graph).

Accuracy, against the float32 model's greedy continuation ``c`` of the same prompt:

- *tokens = .half() (free)*: share of the ``new`` generated positions where the variant's own
  greedy continuation equals ``.half()``'s (once two continuations part they continue from
  different tokens, so with random weights, whose top-2 logits are often closer than fp16's
  error, this falls fast for every low-precision variant);
- *tokens = fp32 (forced)*: share of positions where the variant's argmax equals ``c``, each
  variant fed ``c`` (teacher forcing: HF variants run one forward over prompt + ``c``; mpgraph
  runs ``generate(forced_tokens=c)``), so each position is compared on its own;
- *tokens = .half() (forced)*: the same, against ``.half()``'s argmax;
- *logits err*: relative L2 error of the forced logits against float32's, over all positions.

Default sizes are the GPU ones (a Llama with hidden 2048, TinyLlama-1.1B's shape but
``--layers`` 8, batch 1 and 8, 128 prompt tokens, 128 new tokens, fp16); ``--tiny`` runs a
64-wide 2-layer Llama on the CPU (16 + 16 tokens, batch 1 and 2, plans for an A100), which
checks that everything runs and prints its numbers, not a speed.

    python examples/bench/bench_generate.py                 # on a GPU: the table of issue 20
    python examples/bench/bench_generate.py --tiny          # on a CPU, in about a minute
    python examples/bench/bench_generate.py --batches 1 --layers 4 --out gen.txt
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time

import torch

import mpgraph
from mpgraph.numerics import relative_l2

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ULP2 = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}    # two units of rounding (tests/test_generate.py)


def build(args):
    import transformers as hf
    torch.manual_seed(0)
    if args.tiny:
        cfg = hf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    else:
        cfg = hf.LlamaConfig(hidden_size=2048, intermediate_size=5632,
                             num_hidden_layers=args.layers, num_attention_heads=32,
                             num_key_value_heads=4, vocab_size=32000)
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None  # no early stop: `new` tokens
    model = hf.LlamaForCausalLM(cfg).eval().to(args.device)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def once(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def latency(run, new, device, reps):
    """(TTFT, per-token latency, the last sequences): medians over ``reps`` rounds, each timing
    ``run(1)`` and ``run(new)`` back to back (drift on a shared machine hits both alike)."""
    first, per, seq = [], [], None
    for _ in range(reps):
        t1, _ = once(lambda: run(1), device)
        tn, seq = once(run, device)
        first.append(t1)
        per.append((tn - t1) / (new - 1))
    return statistics.median(first), statistics.median(per), seq


def hf_generate(model, ids, new, ctx=contextlib.nullcontext):
    def run(n=new):
        with torch.no_grad(), ctx():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0)
    return run


def hf_forced_logits(model, ids, cont, ctx=contextlib.nullcontext):
    """Logits at each generated position with the fp32 continuation fed (one forward)."""
    full = torch.cat([ids, cont[:, :-1]], dim=1)
    with torch.no_grad(), ctx():
        logits = model(full, attention_mask=torch.ones_like(full), use_cache=False).logits
    return logits[:, ids.shape[1] - 1:].float().transpose(0, 1)        # (new, B, V)


rel = relative_l2  # the one metric mpgraph reports (mpgraph.numerics)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 64-wide 2-layer Llama on the CPU")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--prompt", type=int)
    p.add_argument("--new", type=int)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    p.add_argument("--target", help="GPU the plan is for (default: this machine's; --tiny: a100)")
    p.add_argument("--reps", type=int)
    p.add_argument("--device")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    args.device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available()
                                               else "cuda"))
    if not args.tiny and args.device.type != "cuda":
        sys.exit("the default sizes are for a GPU (hidden 2048, 128 + 128 tokens); on a CPU run "
                 "--tiny")
    args.batches = args.batches or ([1, 2] if args.tiny else [1, 8])
    args.prompt = args.prompt or (16 if args.tiny else 128)
    args.new = args.new or (16 if args.tiny else 128)
    args.reps = args.reps or (3 if args.tiny else 5)
    target = args.target or ("a100" if args.tiny else None)
    low = DTYPES[args.dtype]
    device = args.device

    model = build(args)
    half = copy.deepcopy(model).to(low)
    autocast = lambda: torch.autocast(device.type, dtype=low)  # noqa: E731
    lines = [f"# bench_generate: Llama hidden {model.config.hidden_size}, "
             f"{model.config.num_hidden_layers} layers, vocab {model.config.vocab_size}; "
             f"{args.prompt} prompt + {args.new} new tokens, greedy, {args.dtype}, on "
             f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; "
             f"torch {torch.__version__}", ""]
    header = ("| batch | variant | TTFT ms | per-token ms | per-token speed vs .half() | "
              "tokens = .half() (free) | tokens = fp32 (forced) | tokens = .half() (forced) | "
              "logits err vs fp32 (forced) |")
    table = [header, "|" + "---|" * 9]
    bars = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), generator=g)
        ids = ids.to(device)
        t0 = time.perf_counter()
        decoder = mpgraph.convert_decoder(model, ids, max_cache_len=args.prompt + args.new,
                                          dtype=low, target=target)
        convert_s = time.perf_counter() - t0
        lines.append(f"batch {batch}: converted in {convert_s:.1f} s")
        lines += ["    " + s for s in decoder.summary().splitlines()]
        ref_seq = hf_generate(model, ids, args.new)()
        cont = ref_seq[:, args.prompt:]
        ref_logits = hf_forced_logits(model, ids, cont)
        top2 = ref_logits.topk(2, -1).values
        margin = (top2[..., 0] - top2[..., 1]) / ref_logits.norm(dim=-1)
        flip = 2 * ULP2[args.dtype]   # an error of 2 ulps (relative L2) flips margins below
        lines.append(f"    fp32 top-2 logit margin / |logits|: median {margin.median():.2e}, "
                     f"{float((margin < flip).float().mean()):.0%} of positions below "
                     f"{flip:.1e} (where an error of two units of {args.dtype}'s rounding can "
                     "flip the argmax)")
        variants = {
            "fp32": (hf_generate(model, ids, args.new), lambda: ref_logits),
            "autocast": (hf_generate(model, ids, args.new, autocast),
                         lambda: hf_forced_logits(model, ids, cont, autocast)),
            ".half()" if low == torch.float16 else ".bfloat16()":
                (hf_generate(half, ids, args.new), lambda: hf_forced_logits(half, ids, cont)),
        }

        def ours(graph):
            def run(n=args.new):
                return mpgraph.generate(decoder, ids, n, cuda_graph=graph)

            def forced():
                return mpgraph.generate(decoder, ids, args.new, forced_tokens=cont,
                                        return_logits=True, cuda_graph=graph).logits
            return run, forced

        variants["mpgraph eager"] = ours(False)
        if device.type == "cuda":
            variants["mpgraph graph"] = ours(True)
        results = {}
        for name, (run, forced) in variants.items():
            run()                                           # warm-up (and the graph's capture)
            ttft, per, seq = latency(run, args.new, device, args.reps)
            logits = forced()
            results[name] = dict(ttft=ttft, per=per, seq=seq[:, args.prompt:],
                                 tokens=logits.argmax(-1).T, err=rel(logits, ref_logits))
        base = results[list(variants)[2]]
        for name, r in results.items():
            r["free"] = float((r["seq"] == base["seq"]).float().mean())
            r["forced"] = float((r["tokens"] == base["tokens"]).float().mean())
            table.append(
                f"| {batch} | {name} | {r['ttft'] * 1e3:.2f} | {r['per'] * 1e3:.3f} | "
                f"{base['per'] / r['per']:.2f}x | {r['free']:.1%} | "
                f"{float((r['tokens'] == cont).float().mean()):.1%} | {r['forced']:.1%} | "
                f"{r['err']:.2e} |")
        if batch == 1 and "mpgraph graph" in results:
            r, a = results["mpgraph graph"], results["autocast"]
            bars.append(f"per-token latency, mpgraph graph vs .half() at batch 1: "
                        f"{base['per'] / r['per']:.2f}x (bar: >= 3x)")
            bars.append(f"tokens equal to .half()'s: free {r['free']:.1%}, forced "
                        f"{r['forced']:.1%} (bar: >= 95% of positions)")
            bars.append(f"logits error: mpgraph {r['err']:.2e}, autocast {a['err']:.2e} "
                        f"(bar: mpgraph <= autocast)")
        decoder = None  # its weights and cache go before the next batch's conversion
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = "\n".join(lines + [""] + table + ([""] + bars if bars else [])) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
