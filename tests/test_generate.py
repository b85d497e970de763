"""Generation with a converted decoder (mpgraph.convert_decoder, mpgraph.generate): tiny Llama and
GPT-2 (random weights, built from configs) against the float32 model's own greedy ``generate``;
the static KV cache (written in place, never reallocated, shared by both graphs); weights stored
once; EOS, sampling, padding; the CUDA-graph decode path with a stand-in backend on the CPU, and
for real on a GPU (skipped without one).

How tokens are compared. A greedy token can only differ from float32's where the two best fp32
logits are closer than the converted logits' error can move them. Each test first checks that
error, teacher-forced (the converted decoder fed float32's own tokens, ``forced_tokens``): at
every step and row the relative L2 error of the logits is at most ``BOUND`` = two units of the
dtype's rounding (fp16 2^-10, bf16 2^-7). Then no logit is off by more than BOUND * |l|_2, so
a step whose fp32 top-2 margin exceeds ``2 * BOUND * |l|_2`` is *decided*: the tokens must be
equal there. Free-running, the sequences must be equal up to each row's first undecided step
(after it they may part, and then differ everywhere, since they continue from different
tokens); teacher-forced, at every decided step. Undecided steps must be rare (at most a quarter).
"""
from __future__ import annotations

import copy
import inspect
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import mpgraph
from mpgraph.numerics import relative_l2
from conftest import GPU, MLP, Recorder, kernels_only
from mpgraph.ir.graph import fetch_attr, is_inplace
from mpgraph.tools.generate import cache_names, share_tensors

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW, SLOTS = 100, 8, 16, 40  # SLOTS: room for HF's default 20 new tokens
# relative L2 error of the logits allowed per step: two units of the dtype's rounding
BOUND = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# layers=1 where a test is not about depth (a conversion of one layer costs about half of two);
# the module's shared decoders (built but gpt2 bf16, _fp32_decoder) keep two
def llama(layers=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(layers=2):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=VOCAB,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


MODELS = {"llama": llama, "gpt2": gpt2}
_BUILT: dict = {}
# dynamic=False where a test runs its decoder only at its example prompt's length (8 tokens; a
# batch of 1 is padded to the cache's 2), or not at all, and dynamic shapes are not what it is
# about: a static capture costs a third to a half of a dynamic one. The prefill graph's dynamic
# length stays tested where it is the subject: built("llama", "fp16") (run at other prompt
# lengths by test_prompt_lengths_other_than_the_example) and the tests calibrating on prompts of
# other lengths keep convert_decoder's default.
STATIC = dict(dynamic=False)


def built(kind: str, dtype: str):
    """(model, decoder): one conversion per model and dtype for the whole module (batch 2);
    static (STATIC) but for llama fp16, the one the tests run at other prompt lengths. GPT-2 in
    bf16, read by test_greedy_tokens_equal_fp32_generate alone (not about depth), has one
    layer; the others two (the cache's tests count its 4 tensors, the overrides test's layer 1
    stays low)."""
    if (kind, dtype) not in _BUILT:
        model = MODELS[kind](layers=1 if (kind, dtype) == ("gpt2", "bf16") else 2)
        example = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
        decoder = mpgraph.convert_decoder(model, example, max_cache_len=SLOTS, dtype=dtype,
                                          target=GPU, dynamic=(kind, dtype) == ("llama", "fp16"))
        _BUILT[kind, dtype] = model, decoder
    return _BUILT[kind, dtype]


def prompt(rows: int = 2, length: int = PROMPT, seed: int = 5):
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def assert_tokens_equal_hf(model, decoder, ids, n=8):
    """A float32 decoder's greedy tokens are HF's own generate's, token for token."""
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  do_sample=False, eos_token_id=None)
    assert torch.equal(decoder.generate(ids, max_new_tokens=n, eos_token_id=[]), expected)


def reference(model, ids, n=NEW, mask=None, eos=None, pad=0):
    """float32 greedy: HF's own generate (dynamic cache), its sequences and per-step logits."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                             max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits).float()          # (B, L+n), (n, B, V)


def decided(ref_logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, B) True where the fp32 top-2 margin exceeds what an error within BOUND can flip."""
    top2 = ref_logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1] > 2 * BOUND[dtype] * ref_logits.norm(dim=-1)


def compare(model, decoder, dtype, ids, mask=None):
    """The checks of the module docstring; returns what was measured."""
    seq, ref = reference(model, ids, mask=mask)
    cont = seq[:, ids.shape[1]:]
    forced = mpgraph.generate(decoder, ids, NEW, attention_mask=mask, forced_tokens=cont,
                              return_logits=True)
    err = (forced.logits - ref).norm(dim=-1) / ref.norm(dim=-1)        # (n, B)
    assert float(err.max()) <= BOUND[dtype], f"logits error {float(err.max()):.2e}"
    ok = decided(ref, dtype)
    tf_tokens = forced.logits.argmax(-1)                                # (n, B)
    assert torch.equal(tf_tokens[ok], cont.T[ok]), "teacher-forced token differs at a decided step"
    free = mpgraph.generate(decoder, ids, NEW, attention_mask=mask)
    assert torch.equal(free[:, :ids.shape[1]], ids)
    agree = []
    for row in range(ids.shape[0]):
        undecided = (~ok[:, row]).nonzero()
        upto = int(undecided[0]) if len(undecided) else NEW
        assert torch.equal(free[row, ids.shape[1]:][:upto], cont[row, :upto]), \
            f"row {row}: free-running tokens part from fp32 before step {upto}"
        agree.append(float((free[row, ids.shape[1]:] == cont[row]).float().mean()))
    assert float((~ok).float().mean()) <= 0.25, "too many undecided steps for a meaningful check"
    return {"error": float(err.max()), "undecided": int((~ok).sum()),
            "free_agreement": agree, "min_margin": float((ref.topk(2, -1).values[..., 0] -
                                                         ref.topk(2, -1).values[..., 1]).min())}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_tokens_equal_fp32_generate(kind, dtype):
    model, decoder = built(kind, dtype)
    got = compare(model, decoder, DTYPES[dtype], prompt())  # asserts the bounds of the docstring
    assert got["error"] <= BOUND[DTYPES[dtype]] and len(got["free_agreement"]) == 2


@pytest.mark.parametrize("kind", list(MODELS))
def test_batch_with_left_padding_equals_fp32_generate(kind):
    model, decoder = built(kind, "fp16")
    ids, mask = prompt(), torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    got = compare(model, decoder, torch.float16, ids, mask)
    assert got["error"] <= BOUND[torch.float16] and got["undecided"] <= NEW // 2


@pytest.mark.parametrize("length", [1, 3, 13])
def test_prompt_lengths_other_than_the_example(length):
    """The prefill graph's length is dynamic (2 up); a one-token prompt goes through decode."""
    model, decoder = built("llama", "fp16")
    got = compare(model, decoder, torch.float16, prompt(length=length, seed=length))
    assert got["error"] <= BOUND[torch.float16] and got["undecided"] <= NEW // 2


def _writers(gm, name):
    node = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == name)
    return [u for u in node.users if is_inplace(u, gm) and u.args[0] is node]


@pytest.mark.parametrize("kind", list(MODELS))
def test_kv_cache_is_static_and_shared(kind):
    """One set of cache tensors for both graphs, written in place by the graphs' own ops, at the
    same addresses before, during and after a generation (checked after the prefill and after
    every decode step)."""
    model, decoder = built(kind, "fp16")
    names = cache_names(decoder.prefill)
    layers = model.config.num_hidden_layers
    assert names == cache_names(decoder.decode) and len(names) == 2 * layers
    for name in names:
        assert fetch_attr(decoder.prefill, name) is fetch_attr(decoder.decode, name)
        for gm in (decoder.prefill, decoder.decode):
            assert [str(w.target) for w in _writers(gm, name)] == ["aten.index_copy_.default"]
    before = [t.data_ptr() for t in decoder.cache]
    seen = []

    def record(module, args, out):
        seen.append([t.data_ptr() for t in decoder.cache])

    hooks = [decoder.prefill.register_forward_hook(record),
             decoder.decode.register_forward_hook(record)]
    try:
        mpgraph.generate(decoder, prompt(), NEW)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == NEW and all(ptrs == before for ptrs in seen)   # prefill + NEW-1 steps
    # what the cache holds after a generation: the prompt's and generated tokens' keys, zeros
    # after them (generate zeroes the cache first)
    key = decoder.cache[0]
    filled = PROMPT + NEW - 1
    assert key[:, :, :filled].abs().amax(dim=(0, 1, 3)).gt(0).all()
    assert key[:, :, filled:].eq(0).all()


@pytest.mark.parametrize("kind", list(MODELS))
def test_weights_stored_once(kind):
    model, decoder = built(kind, "fp16")
    sharing = decoder.sharing
    assert sharing.unshared == [], sharing.unshared
    for name, p in decoder.decode.named_parameters():
        assert fetch_attr(decoder.prefill, name) is p, name
    prefill_only = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in [*decoder.prefill.parameters(), *decoder.prefill.buffers()]}
                       .values())
    assert sharing.bytes_stored == prefill_only            # the decode graph adds no tensor
    assert sharing.bytes_separate >= 2 * sharing.bytes_stored - 64
    low = [w for w in decoder.prefill.plan.weights if w.dtype == torch.float16]
    assert low and all(fetch_attr(decoder.decode, w.name).dtype == torch.float16 for w in low)


@pytest.mark.parametrize("kind", list(MODELS))
def test_plans_record_the_cache_dtype(kind):
    """Each cache tensor's dtype comes from the plan (both plans agree), with the plan's reason;
    both graphs are planned by the same passes for the same target and low dtype."""
    model, decoder = built(kind, "fp16")
    for gm in (decoder.prefill, decoder.decode):
        assert gm.plan.dtype == torch.float16 and gm.plan.target == decoder.decode.plan.target
        assert gm.plan.low_nodes
        for rec in decoder.cache_plan:
            node = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == rec.name)
            planned = gm.plan.node(node.name)
            assert planned.dtype == rec.dtype == str(fetch_attr(gm, rec.name).dtype).split(".")[1]
            assert planned.reason == rec.reason
    # a KV cache is written only by stores (index_copy_): the plan keeps it in the low dtype,
    # each written key/value cast once, and attention reads it as it is
    assert decoder.cache_dtype == torch.float16
    assert all("a cache written only by stores (aten.index_copy_.default)" in rec.reason
               for rec in decoder.cache_plan)
    assert "cache: 4 tensors" in decoder.summary()


def test_eos_stops_each_row_and_the_generation():
    """HF's semantics: a row that produced EOS gets the pad token from then on; the generation
    stops when every row has finished. (Expected tokens from the decoder's own run without EOS,
    so the check does not depend on fp32's tokens.)"""
    model, decoder = built("llama", "fp16")
    ids = prompt()
    free = mpgraph.generate(decoder, ids, NEW)[:, PROMPT:]
    eos = int(free[0, 4])                    # a token row 0 generates at step 4
    got = mpgraph.generate(decoder, ids, NEW, eos_token_id=eos, pad_token_id=7)
    want = []
    for row in free.tolist():
        stop = row.index(eos) + 1 if eos in row else NEW
        want.append(row[:stop] + [7] * (NEW - stop))
    width = max((row.index(eos) + 1 if eos in row else NEW) for row in free.tolist())
    assert got[:, PROMPT:].tolist() == [row[:width] for row in want]
    assert torch.equal(got[:, :PROMPT], ids)
    # one prompt (on the batch-2 decoder): stops right after its EOS; EOS may be a list
    one = mpgraph.generate(decoder, ids[:1], NEW, eos_token_id=[eos, VOCAB + 1])
    first = free[0].tolist().index(eos)
    assert one.shape == (1, PROMPT + first + 1) and int(one[0, -1]) == eos
    assert torch.equal(one[0, PROMPT:], free[0, :first + 1])


def test_sampling_is_reproducible_with_a_seeded_generator():
    model, decoder = built("llama", "fp16")
    ids = prompt()

    def sample(seed, **kw):
        return mpgraph.generate(decoder, ids, NEW, do_sample=True, temperature=0.8,
                                generator=torch.Generator().manual_seed(seed), **kw)

    a, b, c = sample(3, top_k=20), sample(3, top_k=20), sample(4, top_k=20)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < VOCAB
    nucleus = sample(3, top_p=0.5)
    assert torch.equal(nucleus, sample(3, top_p=0.5))
    # one candidate left: sampling is greedy decoding
    assert torch.equal(sample(5, top_k=1), mpgraph.generate(decoder, ids, NEW))


def test_decode_replayed_from_a_graph_gives_the_eager_tokens():
    """The CUDA-graph decode path on the CPU: one capture for the whole generation (and the
    next), a replay per step after it, the same tokens as eager; the warm-up runs before the
    capture rewrite the same cache slot with the same values, so they change nothing."""
    model, decoder = built("gpt2", "fp16")
    ids = prompt()
    eager = mpgraph.generate(decoder, ids, NEW, cuda_graph=False, return_logits=True)
    backend = Recorder()
    graphed = mpgraph.generate(decoder, ids, NEW, cuda_graph=backend, return_logits=True)
    assert torch.equal(graphed.sequences, eager.sequences)
    assert torch.equal(graphed.logits, eager.logits)
    assert backend.captures == 1 and backend.replays == NEW - 1     # a replay per decode step
    again = mpgraph.generate(decoder, prompt(seed=9), NEW, cuda_graph=backend)
    assert backend.captures == 1 and backend.replays == 2 * (NEW - 1)
    assert torch.equal(again, mpgraph.generate(decoder, prompt(seed=9), NEW, cuda_graph=False))
    stats = decoder.graphed_decode(backend).stats
    assert stats.captures == 1 and stats.fallbacks == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: replays a real "
                    "CUDA graph (pytest tests/test_generate.py on a GPU machine)")
def test_cuda_graph_decode_on_a_gpu():
    model = llama().cuda()
    ids = prompt().cuda()
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=SLOTS, dtype="fp16")
    eager = mpgraph.generate(decoder, ids, NEW, cuda_graph=False, return_logits=True)
    graphed = mpgraph.generate(decoder, ids, NEW, return_logits=True)   # default on CUDA
    assert torch.equal(graphed.sequences, eager.sequences)
    assert torch.allclose(graphed.logits, eager.logits, rtol=1e-3, atol=1e-3)
    stats = decoder.graphed_decode().stats
    assert stats.captures == 1 and stats.fallbacks == {}, stats
    seq, ref = reference(model, ids)
    err = (eager.logits[0] - ref[0]).norm(dim=-1) / ref[0].norm(dim=-1)
    assert float(err.max()) <= BOUND[torch.float16]


def test_share_tensors_keeps_both_copies_where_the_plans_differ():
    """A weight one plan stores low and the other float32 is kept twice, and said why."""
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(4, 16)
    a = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules")
    b = mpgraph.convert(model, x, dtype="fp16", target=GPU, strategy="rules",
                        overrides={"fc1": "fp32"})
    sharing = share_tensors(a, b)
    assert sharing.shared == ["fc2.weight", "fc2.bias"]
    assert [n for n, _ in sharing.unshared] == ["fc1.weight", "fc1.bias"]
    assert "the decode plan stores it as float32, the prefill plan as float16" in \
        sharing.unshared[0][1]
    assert b.fc2.weight is a.fc2.weight and b.fc1.weight is not a.fc1.weight
    torch.testing.assert_close(b(x), model(x), rtol=1e-2, atol=1e-2)


def test_misuse_is_refused_with_the_reason():
    model, decoder = built("llama", "fp16")
    with pytest.raises(ValueError, match="exceed the cache"):
        mpgraph.generate(decoder, prompt(), SLOTS)
    with pytest.raises(ValueError, match="cache holds 2"):
        mpgraph.generate(decoder, prompt(rows=3), 4)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="on the left"):
        mpgraph.generate(decoder, prompt(), 4, attention_mask=mask)
    mask[0] = 0  # (probe 41b: said "padding on the right")
    with pytest.raises(ValueError, match="masks every token of row 0: that row has no prompt"):
        mpgraph.generate(decoder, prompt(), 4, attention_mask=mask)
    with pytest.raises(ValueError, match="calibration takes prompts"):
        mpgraph.convert_decoder(model, prompt(), max_cache_len=SLOTS,
                                calibration=[torch.randn(2, PROMPT)])
    with pytest.raises(ValueError, match="does not take"):
        mpgraph.convert_decoder(model, prompt(), max_cache_len=SLOTS, mode="train")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        mpgraph.convert_decoder(model, prompt(length=1), max_cache_len=SLOTS)
    with pytest.raises(TypeError, match="HuggingFace causal LM"):
        mpgraph.convert_decoder(nn.Linear(4, 4), prompt(), max_cache_len=SLOTS)


def test_float_token_ids_are_refused_not_truncated():
    """generate made input_ids long: [[5.9, 17.7, ...]] generated from the prompt [5, 17, ...]
    (HF's embedding refuses floats), and torch.rand ids said 'masks every token of row 0'."""
    model, decoder = built("llama", "fp16")
    ids = prompt()
    with pytest.raises(ValueError, match="input_ids must be an integer tensor of token ids, "
                                         "got float32"):
        decoder.generate(ids.float() + 0.9, max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        decoder.generate(torch.rand(2, PROMPT), max_new_tokens=2)
    with pytest.raises(ValueError, match="forced_tokens must be an integer tensor"):
        mpgraph.generate(decoder, ids, 2, forced_tokens=torch.full((2, 2), 7.5))
    assert decoder.generate(ids.int(), max_new_tokens=2).shape == (2, PROMPT + 2)


def test_an_empty_batch_is_refused_with_the_reason():
    """A (0, L) batch passed the mask checks and failed in torch's max() of an empty tensor."""
    model, decoder = built("llama", "fp16")
    with pytest.raises(ValueError, match=r"input_ids \(0, 8\) holds no prompt"):
        decoder.generate(prompt()[:0], max_new_tokens=2)


def test_generate_inside_torch_autocast_gives_the_plan_s_tokens_and_says_so_once():
    """Each of the decoder's graphs said it ran with autocast off, naming StaticCacheStep (a
    class of mpgraph's, review rG f4): generate says it once, itself, at the caller's line."""
    decoder = copy.copy(built("llama", "bf16")[1])
    vars(decoder).pop("_said_autocast", None)
    ids = prompt()
    planned = decoder.generate(ids, max_new_tokens=4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for inside in (torch.float16, torch.bfloat16):
            with torch.autocast("cpu", dtype=inside):
                assert torch.equal(decoder.generate(ids, max_new_tokens=4), planned)
                assert torch.equal(mpgraph.generate(decoder, ids, 4), planned)
                assert torch.is_autocast_enabled("cpu")  # (the caller's autocast is kept)
    assert [str(w.message) for w in said] == [
        "generate was called inside torch.autocast('cpu', dtype=torch.float16): a converted "
        "decoder decides its own precision (its plans put each node low or in float32), so it "
        "generates with autocast off. Call it outside torch.autocast"]
    assert said[0].filename == __file__


def test_max_cache_len_must_be_an_int():
    """32.0 failed inside transformers' masking_utils ('expand(): argument size ... got
    float'), torch.tensor(32) in torch.export (GuardOnDataDependentSymNode)."""
    model = llama(layers=1)
    for bad in (32.0, torch.tensor(32), True):
        with pytest.raises(TypeError, match="max_cache_len must be an int"):
            mpgraph.convert_decoder(model, prompt(), max_cache_len=bad)
    np = pytest.importorskip("numpy")
    decoder = mpgraph.convert_decoder(model, prompt(), max_cache_len=np.int64(12), dtype="bf16",
                                      target=GPU, **STATIC)
    assert type(decoder.max_cache_len) is int and decoder.max_cache_len == 12


def test_generate_follows_the_model_s_generation_config_eos_as_hf_does():
    """No eos_token_id given: the model's generation config's EOS stops each row (issue 25.9:
    12 tokens past EOS were emitted where HF's generate stops)."""
    import copy
    model, decoder = built("llama", "fp16")
    ids = prompt(rows=1)
    free = mpgraph.generate(decoder, ids, NEW, eos_token_id=[])[:, PROMPT:]
    eos = int(free[0, 3])                    # a token the decoder emits at step 3
    first = free[0].tolist().index(eos)
    saved = decoder.generation_config
    decoder.generation_config = copy.deepcopy(saved)
    decoder.generation_config.eos_token_id = eos
    try:
        got = mpgraph.generate(decoder, ids, NEW)
    finally:
        decoder.generation_config = saved
    assert got.shape == (1, PROMPT + first + 1) and int(got[0, -1]) == eos
    tuned = copy.deepcopy(model)
    tuned.generation_config.eos_token_id = eos
    with torch.no_grad():
        hf = tuned.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                            do_sample=False)
    new = hf[0, PROMPT:].tolist()  # HF's own rule, the same: stop right after the first EOS
    assert eos not in new[:-1] and (new[-1] == eos or len(new) == NEW)


def _fp32_decoder():
    """A float32-planned decoder: its logits equal the model's to float32 rounding, so HF's
    processors must choose HF's tokens from them."""
    if ("llama", "fp32") not in _BUILT:
        model = llama()
        example = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
        _BUILT["llama", "fp32"] = model, mpgraph.convert_decoder(
            model, example, max_cache_len=SLOTS, dtype="fp16", target=GPU, overrides={"*": "fp32"},
            **STATIC)
    return _BUILT["llama", "fp32"]


HF_OPTIONS = [
    dict(max_new_tokens=NEW, repetition_penalty=1.5, no_repeat_ngram_size=2),
    dict(max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None),   # EOS set below
    dict(max_length=PROMPT + 5),
    dict(max_new_tokens=NEW, do_sample=True, top_k=1),                  # sampling, one choice
]


@pytest.mark.parametrize("options", HF_OPTIONS, ids=lambda o: ",".join(o))
def test_hf_generation_arguments_give_hf_s_tokens(options):
    """The converted decoder takes HF's generate arguments and, run through transformers' own
    logits processors and stopping criteria, returns HF's sequences for the same model (sampling:
    with one candidate left, the same token)."""
    model, decoder = _fp32_decoder()
    ids, mask = prompt(), torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :3] = 0                                         # row 1 is left-padded
    options = dict(options)
    if "min_new_tokens" in options:                          # an EOS the model would emit early
        free = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])
        options["eos_token_id"] = int(free[0, PROMPT + 1])
    runs = []
    for run in (model.generate, decoder.generate):
        with torch.no_grad():
            runs.append(run(ids, attention_mask=mask, **options))
    hf, ours = runs
    assert ours.tolist() == hf.tolist()
    if "max_length" in options:
        assert ours.shape[1] == PROMPT + 5
    if "min_new_tokens" in options:
        assert options["eos_token_id"] not in ours[0, PROMPT:].tolist()


def test_a_generation_config_passed_second_as_hf_takes_it():
    """HF's generate(inputs, generation_config): ours took the second argument for the
    attention mask (probe 41b: AttributeError 'GenerationConfig' object has no attribute 'to',
    or HF's default of 20 new tokens in place of the config's); a mask passed there is a
    TypeError naming the keyword."""
    from transformers import GenerationConfig
    model, decoder = _fp32_decoder()
    ids = prompt()
    config = GenerationConfig(max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, config)
        got = decoder.generate(ids, config)
    assert got.shape == (2, PROMPT + 3) and got.tolist() == want.tolist()
    with pytest.raises(TypeError, match="pass the mask as attention_mask="):
        decoder.generate(ids, torch.ones_like(ids))


def test_return_dict_in_generate_gives_hf_s_output_object_with_scores_and_logits():
    """return_dict_in_generate=True, output_scores=True was accepted and ignored (a bare
    tensor came back; code reading out.sequences failed elsewhere)."""
    model, decoder = _fp32_decoder()
    ids = prompt()
    options = dict(max_new_tokens=4, repetition_penalty=1.5, return_dict_in_generate=True,
                   output_scores=True, output_logits=True)
    with torch.no_grad():
        hf, ours = model.generate(ids, **options), decoder.generate(ids, **options)
    assert type(ours) is type(hf) and ours.sequences.tolist() == hf.sequences.tolist()
    assert len(ours.scores) == len(hf.scores) == len(ours.logits) == 4
    for mine, theirs in zip(ours.scores + ours.logits, hf.scores + hf.logits):
        assert mine.shape == theirs.shape and relative_l2(mine, theirs) < 1e-5
    with pytest.raises(ValueError, match=r"generate\(output_attentions=True\): the converted "
                                         r"graphs return the last position's logits only"):
        decoder.generate(ids, max_new_tokens=2, output_attentions=True)


def test_an_override_to_float32_of_the_cache_or_its_writes_keeps_the_cache_float32():
    """The cache's dtype was decided before any override was read: overrides={'*': 'fp32'}
    (this file's float32 decoder) left an fp16 cache, and 'key_cache_0' matched no node."""
    model, decoder = _fp32_decoder()
    assert {c.dtype for c in decoder.cache_plan} == {"float32"}
    one_layer = llama(layers=1)  # (the overrides name layer 0's cache and its writes)
    for overrides in ({"op:aten.index_copy*": "fp32"}, {"key_cache_0": "fp32"}):
        converted = mpgraph.convert_decoder(one_layer, prompt(), max_cache_len=SLOTS, dtype="fp16",
                                            target=GPU, overrides=overrides, **STATIC)
        kinds = {c.name: c.dtype for c in converted.cache_plan}
        assert kinds["key_cache_0"] == "float32"
        if "key_cache_0" in overrides:  # (that one buffer; the others as planned)
            assert kinds["value_cache_0"] == "float16"


def test_a_tolerance_converts_with_one_cache_dtype_for_both_graphs():
    """Each graph's tolerance search pinned the cache on its own: the prefill plan kept
    value_cache_0 float32, the decode plan bfloat16, and sharing it was a ValueError. A cache
    tensor either plan keeps float32 is float32 in both."""
    model = llama(layers=1)
    example = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    decoder = mpgraph.convert_decoder(model, example, max_cache_len=SLOTS, dtype="bf16",
                                      target=GPU, tolerance=1e-3, **STATIC)
    ours, theirs = ({n: fetch_attr(gm, n) for n in cache_names(gm)}
                    for gm in (decoder.prefill, decoder.decode))
    assert all(ours[n] is theirs[n] for n in ours)  # one cache, in one dtype
    assert "float32" in {c.dtype for c in decoder.cache_plan}
    compare(model, decoder, torch.bfloat16, prompt())


def test_overrides_take_the_causal_lm_s_own_module_paths(caplog):
    """The graphs are captured from a wrapper holding the LM as 'model': 'model.layers.0' (a
    path of lm.named_modules()) matched nothing and was dropped; only 'model.model.layers.0'
    worked. The LM's paths are prefixed; a key that matches nothing is a warning, as convert's."""
    model, planned = built("llama", "bf16")

    def low(decoder, *paths):
        return [r.name for gm in (decoder.prefill, decoder.decode) for r in gm.plan.low_nodes
                if r.module.startswith(paths)]
    assert low(planned, "model.model.layers.0.", "model.lm_head")  # (low without overrides)
    for key in ("model.layers.0", "model.model.layers.0"):  # (the wrapper's path still works)
        with caplog.at_level("WARNING"):
            decoder = mpgraph.convert_decoder(
                model, prompt(), max_cache_len=SLOTS, dtype="bf16", target=GPU,
                overrides={key: "fp32", "lm_head": "fp32", "layers.9": "fp32"}, **STATIC)
        assert not low(decoder, "model.model.layers.0.", "model.lm_head"), key
        assert low(decoder, "model.model.layers.1.")
        unmatched = [r.getMessage() for r in caplog.records if "matched no node" in r.message]
        assert unmatched and all("'layers.9'" in m for m in unmatched)
        caplog.clear()


def test_fewer_rows_than_the_cache_with_a_repetition_penalty_give_hf_s_tokens():
    """The processors were built for the prompt's rows and then given the cache's batch:
    HF's repetition penalty refused ('Incompatible prompt_ignore_length batch size')."""
    model, decoder = _fp32_decoder()
    ids = prompt(rows=1)
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=6, repetition_penalty=1.3)
    assert decoder.generate(ids, max_new_tokens=6, repetition_penalty=1.3).tolist() == hf.tolist()


def test_sampling_draws_only_what_hf_s_warpers_allow():
    """Each sampled token is one HF's temperature/top-k/top-p/min-p warpers leave a nonzero
    probability for, recomputed from the logits it was drawn from."""
    model, decoder = _fp32_decoder()
    ids = prompt()
    options = dict(do_sample=True, temperature=0.7, top_k=12, top_p=0.9, min_p=0.02)
    out = decoder.generate(ids, max_new_tokens=NEW, eos_token_id=[], return_logits=True,
                           generator=torch.Generator().manual_seed(0), **options)
    warpers = transformers.LogitsProcessorList([
        transformers.TemperatureLogitsWarper(0.7), transformers.TopKLogitsWarper(12),
        transformers.TopPLogitsWarper(0.9), transformers.MinPLogitsWarper(0.02)])
    allowed_sizes = []
    for step in range(NEW):
        seen = out.sequences[:, :PROMPT + step]
        allowed = warpers(seen, out.logits[step]).isfinite()
        chosen = out.sequences[:, PROMPT + step]
        assert bool(allowed.gather(1, chosen[:, None]).all()), f"step {step}"
        allowed_sizes.append(int(allowed.sum(-1).max()))
    assert 1 < max(allowed_sizes) <= 12


def test_generation_config_streamer_and_stopping_criteria_as_hf():
    model, decoder = _fp32_decoder()
    ids = prompt(rows=1)
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)

    class Streamer:
        def __init__(self):
            self.put_calls, self.ended = [], 0

        def put(self, value):
            self.put_calls.append(value.tolist())

        def end(self):
            self.ended += 1

    streamer = Streamer()
    got = decoder.generate(ids, generation_config=config, streamer=streamer)
    assert got.shape == (1, PROMPT + 6)
    assert streamer.put_calls[0] == ids.tolist() and streamer.ended == 1
    assert [t for call in streamer.put_calls[1:] for t in call] == got[0, PROMPT:].tolist()
    with torch.no_grad():
        assert got.tolist() == model.generate(ids, generation_config=config).tolist()

    class StopAfter(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT + 3)

    stopped = decoder.generate(ids, generation_config=config,
                               stopping_criteria=transformers.StoppingCriteriaList([StopAfter()]))
    assert torch.equal(stopped, got[:, :PROMPT + 3])
    # nothing given: HF's default length (20 new tokens), as HF's generate
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=None)
    assert decoder.generate(ids, eos_token_id=None).tolist() == hf.tolist()
    assert hf.shape[1] == PROMPT + 20


def test_what_the_static_cache_cannot_do_is_refused_with_the_reason():
    model, decoder = _fp32_decoder()
    with pytest.raises(ValueError, match=r"generate\(num_beams=2\): beam search .* static cache"):
        decoder.generate(prompt(), max_new_tokens=4, num_beams=2)
    with pytest.raises(TypeError, match=r"does not know: \['beam_widht'\]"):
        decoder.generate(prompt(), max_new_tokens=4, beam_widht=2)
    with pytest.raises(ValueError, match="leaves no new token"):
        decoder.generate(prompt(), max_length=PROMPT)


def test_a_model_on_the_meta_device_is_refused_with_the_way_out():
    """The static cache is built by running the model: on meta, that was torch's index_copy_
    device error, with a fix that blamed the example inputs."""
    with torch.device("meta"):
        model = gpt2()
    with pytest.raises(ValueError, match=r"convert_decoder needs the materialised model: "
                                         r"GPT2LMHeadModel has tensors on the meta device "
                                         r"\(transformer\.wte\.weight, \.\.\.\).*Load its weights"):
        mpgraph.convert_decoder(model, prompt(), max_cache_len=SLOTS, dtype="bf16", target=GPU)


def test_sliding_window_attention_within_its_window_converts_and_beyond_it_is_refused():
    """Mistral's config (sliding_window=4096) gave a sliding cache layer that convert_decoder
    refused at any length; within the window every slot stays in it, so the layers are full
    ones, and the tokens are those of the same model without the window."""
    import copy
    from transformers import MistralConfig, MistralForCausalLM

    def mistral(layers):
        torch.manual_seed(0)
        return MistralForCausalLM(MistralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=VOCAB, sliding_window=SLOTS)).eval()
    model = mistral(1)  # (converted twice: one layer; the refusal below counts the layers of 2)
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    options = dict(max_cache_len=SLOTS, dtype="bf16", target="cpu", strategy="rules", **STATIC)
    new = SLOTS - PROMPT
    tokens = mpgraph.convert_decoder(model, prompt(), **options).generate(
        prompt(), max_new_tokens=new, eos_token_id=[])
    assert torch.equal(tokens, mpgraph.convert_decoder(full, prompt(), **options).generate(
        prompt(), max_new_tokens=new, eos_token_id=[]))
    with torch.no_grad():  # each token the float32 model's argmax after the tokens before it
        logits = model(tokens).logits[:, PROMPT - 1:-1].float()
    top = logits.topk(2, dim=-1).values
    agree = logits.argmax(-1) == tokens[:, PROMPT:]
    assert (agree | (top[..., 0] - top[..., 1] < 1e-2)).all()
    with pytest.raises(ValueError, match=rf"sliding-window attention \(window {SLOTS}\) in 2 "
                       rf"layers, and max_cache_len={SLOTS + 1} outgrows the window: .* Convert "
                       rf"with max_cache_len <= {SLOTS}"):
        mpgraph.convert_decoder(mistral(2), prompt(), **{**options, "max_cache_len": SLOTS + 1})


def test_gpt_neo_local_attention_within_its_window_converts_and_beyond_it_is_refused():
    """GPT-Neo's local layers (window_size, attention_layers) slice their window from the
    cache's length: past the window a static cache masked real prompt keys, logits 10-15% off
    under an all-float32 plan that said "error 0.0". Within it the tokens are HF's."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    torch.manual_seed(0)
    model = GPTNeoForCausalLM(GPTNeoConfig(
        hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
        window_size=16, vocab_size=VOCAB, max_position_embeddings=64)).eval()
    ids = prompt()
    with pytest.raises(ValueError, match=r"local \(windowed\) attention \(window 16\) in 1 "
                                         r"layers, and max_cache_len=17 outgrows the window: .*"
                                         r"Convert with max_cache_len <= 16"):
        mpgraph.convert_decoder(model, ids, max_cache_len=17, dtype="bf16", target="cpu")
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=16, dtype="bf16", target="cpu",
                                      overrides={"*": "fp32"}, **STATIC)
    assert_tokens_equal_hf(model, decoder, ids)


def test_a_graph_whose_automatic_fp16_falls_back_takes_the_other_graph_to_bf16_with_it():
    """A calibration prompt of a token that embeds at ~1e-8 (fp16 subnormals): the prefill
    graph's fp16 plan fails its value check (on that prompt) and falls back to bf16, the decode
    graph's passes on the example; the two share the cache, which was then refused ('the decode
    plan stores it as bfloat16, the prefill plan as float16'). Both graphs are now bf16. (The
    decode graph failed alone on the example while it was calibrated on an all-zero cache.)"""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=64,
                                         rms_norm_eps=1.0)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[5] *= 1e-8
        model.model.embed_tokens.weight[:5] *= 10
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=12, target=GPU,
                                      costs=kernels_only(),
                                      calibration=[torch.tensor([[5] * 5]), ids], **STATIC)
    assert decoder.prefill.plan.dtype_choice["fallback"].startswith("float16's plan failed")
    assert "fallback" not in (decoder.decode.plan.dtype_choice or {})
    assert decoder.prefill.plan.dtype == decoder.decode.plan.dtype == torch.bfloat16
    assert {c.dtype for c in decoder.cache_plan} == {"bfloat16"}


def _trained_llama(vocab=64, steps=40):
    """A tiny Llama trained briefly on a rule (each token's successor is a fixed permutation of
    it; a tenth of the tokens random): logits with real margins, as a trained model's. (40 steps:
    the loss is 0.73 there and flat after, 0.84 at 120; the tokens agree with HF's bf16 on all 128
    positions.)"""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    succ = torch.randperm(vocab)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        seq = [torch.randint(3, vocab, (16,))]
        for _ in range(31):
            nxt = succ[seq[-1]]
            noise = torch.rand(16) < 0.1
            seq.append(torch.where(noise, torch.randint(3, vocab, (16,)), nxt))
        batch = torch.stack(seq, dim=1)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), float(loss)


def test_greedy_tokens_equal_hf_bf16_generate_on_a_trained_model():
    """Issue 27's bar: on a model with real logit margins, the bf16-planned decoder's greedy
    tokens equal HF's bf16 generate (the model cast to bfloat16) on >= 90% of 64 positions."""
    model, loss = _trained_llama()
    assert loss < 2.0, f"training did not take (loss {loss:.2f})"
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=8 + 64, dtype="bf16", target=GPU,
                                      **STATIC)
    import copy
    with torch.no_grad():
        hf = copy.deepcopy(model).to(torch.bfloat16).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
            eos_token_id=None)
    ours = decoder.generate(ids, max_new_tokens=64, eos_token_id=None)
    same = (ours[:, 8:] == hf[:, 8:]).float().mean()
    assert ours.shape == hf.shape == (2, 72) and float(same) >= 0.9, float(same)


@pytest.mark.parametrize("dtype,target", [(None, None), ("fp16", GPU)])
def test_convert_decoder_is_quiet_and_calibrates_decode_at_both_ends_of_the_cache(dtype, target):
    """The decode step was calibrated on one token at the first position alone: its position
    input held one value, and every conversion warned that calibration saw too small a range.
    An fp16 prefill calibrated on the example prompt alone warns (one batch), and the way out
    it names, calibration=, is what convert_decoder takes: prompts."""
    import warnings
    model = llama(layers=1)
    prompts = [prompt(seed=s, length=n) for s, n in ((6, 5), (7, 12), (8, PROMPT))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder = mpgraph.convert_decoder(model, prompt(), max_cache_len=SLOTS, dtype=dtype,
                                          target=target, calibration=prompts)
    assert [str(w.message) for w in caught] == []
    assert decoder.prefill.plan.calibration_batches == 3
    assert decoder.decode.plan.calibration_batches == 2
    assert decoder.decode.plan.calibration_warning is None
    ids = prompt()
    assert torch.equal(decoder.generate(ids, max_new_tokens=4)[:, :PROMPT], ids)


def test_a_calibration_batch_larger_than_the_cache_s_is_calibrated_row_by_row():
    """Prompts were repeated or cut to the cache's batch: a (5, 12) batch for a batch-2 decoder
    calibrated its first 2 rows, silently. It is taken in slices of 2: 2, 2 and 1 rows.
    (An example prompt of the calibration's length: every slice runs the static capture.)"""
    decoder = mpgraph.convert_decoder(llama(layers=1), prompt(length=12), max_cache_len=SLOTS,
                                      dtype="fp16", target=GPU,
                                      calibration=[prompt(rows=5, length=12)], **STATIC)
    assert decoder.batch_size == 2 and decoder.prefill.plan.calibration_batches == 3


def test_a_decoder_whose_plans_keep_float32_says_float32():
    """repr named the candidate low dtype (bfloat16) of plans that kept every node float32.
    (The module's float32 decoder: dtype="fp16", overrides={"*": "fp32"}, the same case.)"""
    decoder = _fp32_decoder()[1]
    assert not decoder.prefill.plan.low_nodes
    assert repr(decoder).endswith("dtype=float32, cache=float32)")


def test_decode_calibration_stays_within_the_model_s_positions():
    """A learned position embedding shorter than the cache (GPT-2's n_positions): the decode
    graph's second calibration batch sits at its last position, not at the cache's last slot
    (an index error there, a device assert on a GPU)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=1, n_head=4, vocab_size=VOCAB, n_positions=30)).eval()
    ids = prompt(rows=1)
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=SLOTS, **STATIC)
    assert decoder.decode.plan.calibration_batches == 2
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert decoder.generate(ids, max_new_tokens=6).shape == want.shape
    # past the table: a clear error, not an IndexError from inside the graph (probe 41b)
    with pytest.raises(ValueError, match=r"exceed the model's position table "
                                         r"\(transformer\.wpe: 30 positions"):
        decoder.generate(ids, max_new_tokens=30 - PROMPT + 1)


def test_the_position_table_counts_real_tokens_and_bad_ids_are_named():
    """Left padding takes no position: a padded batch whose real tokens and new ones fit the
    table was refused by its padded length (HF runs it). An example prompt that fills the
    table was a CaptureError blaming the inputs (the decode graph's example sat past it); a
    token id outside the vocabulary, an IndexError from inside the graph."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=1, n_head=4, vocab_size=VOCAB, n_positions=30,
        pad_token_id=0)).eval()
    ids = prompt(rows=2, length=10)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: 5 real tokens; row 1: 10
    # (every node float32 whatever this CPU runs natively: HF's tokens exactly)
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=SLOTS, dtype="bf16", target=GPU,
                                      overrides={"*": "fp32"}, **STATIC)
    new = 30 - 10  # the longest row's real tokens and these fill the table exactly
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              pad_token_id=0)
    assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=new), want)
    with pytest.raises(ValueError, match=r"10 prompt tokens \+ 21 new tokens exceed"):
        decoder.generate(ids, attention_mask=mask, max_new_tokens=new + 1)
    with pytest.raises(ValueError, match=r"input_ids holds token id 100, outside the model's "
                                         r"vocabulary of 100 \(ids 0..99\)"):
        decoder.generate(ids.masked_fill(ids == ids.max(), 100), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"forced_tokens holds token id -1"):
        decoder.generate(ids, max_new_tokens=2, forced_tokens=torch.full((2, 2), -1))
    with pytest.raises(ValueError, match=r"the 30-token example prompt fills the model's "
                                         r"position table \(transformer\.wpe: 30 positions\)"):
        mpgraph.convert_decoder(model, prompt(rows=1, length=30), max_cache_len=SLOTS)
    with pytest.raises(TypeError, match=r"GPT2Model has no language-model head .* the "
                                        r"\*ForCausalLM class"):
        mpgraph.convert_decoder(model.transformer, ids, max_cache_len=SLOTS)


def test_load_weights_into_a_decoder_keeps_its_graphs_sharing_and_gives_the_new_model_s_logits(
        tmp_path):
    """A decoder converted once takes other weights of the same model (its state dict or its
    safetensors checkpoint, by the model's own names); the two graphs still hold one copy."""
    from safetensors.torch import save_file
    # built(): convert_decoder(gpt2(), example (2, PROMPT), max_cache_len=SLOTS, dtype="fp16",
    # target=GPU, dynamic=False), converted once for the module; each load goes into a copy of
    # its own
    model, shared = built("gpt2", "fp16")
    decoder = copy.deepcopy(shared)
    assert decoder.sharing.unshared == []
    converted = decoder.sharing.bytes_shared
    assert converted > 0 and converted == decoder.sharing.bytes_separate - \
        decoder.sharing.bytes_stored
    other = gpt2()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn_like(p))
    for weights in (other.state_dict(), tmp_path / "w.safetensors"):
        if not isinstance(weights, dict):  # (the tied LM head is saved once, as HF does)
            save_file({k: v.contiguous() for k, v in other.state_dict().items()
                       if k != "lm_head.weight"}, weights)
            decoder = copy.deepcopy(shared)  # (a decoder that took no weights yet)
        assert mpgraph.load_weights(decoder, weights) is decoder
        assert decoder.sharing.unshared == []
        assert decoder.sharing.bytes_shared == converted  # (it said 0 after a load)
        for name, p in decoder.decode.named_parameters():
            assert fetch_attr(decoder.prefill, name) is p, name
        stats = compare(other, decoder, torch.float16, prompt())
        assert stats["error"] <= BOUND[torch.float16]


def test_load_weights_into_a_decoder_stays_on_its_device_and_names_unused_keys(tmp_path, caplog):
    import logging
    from safetensors.torch import save_file
    model, shared = built("gpt2", "fp16")  # (the module's conversion; loaded into a copy)
    decoder = copy.deepcopy(shared)
    before = {n: p for n, p in decoder.prefill.named_parameters()}
    with pytest.raises(ValueError, match="the decoder's graphs are on cpu: load_weights cannot "
                                         "move them to meta"):
        mpgraph.load_weights(decoder, model.state_dict(), device="meta")
    assert {n: p for n, p in decoder.prefill.named_parameters()} == before  # untouched
    weights = {k: v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}  # (tied: saved once, as HF does)
    weights["bogus.extra"] = torch.zeros(3)
    save_file(weights, tmp_path / "w.safetensors")
    with caplog.at_level(logging.WARNING, logger="mpgraph.plans.weights"):
        mpgraph.load_weights(decoder, tmp_path / "w.safetensors")
    assert "1 tensors of the weights are not in the module (first: bogus.extra)" in caplog.text
    assert decoder.sharing.unshared == []



def test_a_left_padded_batch_without_attention_mask_infers_it_from_the_pad_id_as_hf():
    """No attention_mask: HF infers it from the pad id (in the prompt and not EOS); the pads
    were attended to as tokens, and the padded row's tokens differed from the first one."""
    model, decoder = _fp32_decoder()
    ids = prompt()
    ids[1, :3] = 0                                           # left padding, pad_token_id=0
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        masked = model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=NEW,
                                do_sample=False)
    assert torch.equal(hf, masked)
    assert decoder.generate(ids, max_new_tokens=NEW).tolist() == hf.tolist()
    ids[1, -1] = 0                                           # a pad last: padded on the right
    with pytest.raises(ValueError, match=r"^input_ids end in the pad id, so the inferred "
                                         r"attention_mask has padding on the right: pad prompts "
                                         r"on the left"):
        decoder.generate(ids, max_new_tokens=2)


def test_a_given_generation_config_is_merged_with_the_model_s_as_hf():
    """generation_config=GenerationConfig(max_new_tokens=...) was used alone: the model's own
    EOS and repetition penalty, fields the given config leaves unset, were dropped (HF fills
    them from the model's generation config)."""
    import copy
    model, decoder = _fp32_decoder()
    ids = prompt(rows=1)
    given = transformers.GenerationConfig(max_new_tokens=NEW)
    plain = decoder.generate(ids, generation_config=given, eos_token_id=[])
    eos = int(plain[0, PROMPT + 3])
    first = plain[0, PROMPT:].tolist().index(eos)
    for field, value in (("eos_token_id", eos), ("repetition_penalty", 1.5)):
        tuned = copy.deepcopy(model)
        setattr(tuned.generation_config, field, value)
        saved, decoder.generation_config = decoder.generation_config, tuned.generation_config
        try:
            got = decoder.generate(ids, generation_config=given)
        finally:
            decoder.generation_config = saved
        with torch.no_grad():
            assert got.tolist() == tuned.generate(ids, generation_config=given).tolist(), field
        if field == "eos_token_id":
            assert got.shape == (1, PROMPT + first + 1) and int(got[0, -1]) == eos
        else:
            assert got.shape == plain.shape and not torch.equal(got, plain)
    assert given.eos_token_id is None and given.repetition_penalty is None  # not modified


def _phi3_longrope():
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=0,
        bos_token_id=1, max_position_embeddings=128, original_max_position_embeddings=24,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})).eval()


def test_longrope_past_its_original_positions_is_refused_and_within_them_gives_hf_s_tokens():
    """Phi-3's longrope switches to its long factors past original_max_position_embeddings,
    where HF's generate recomputes the whole cache; the static cache kept the short-factor keys
    and gave other logits from there, silently."""
    model = _phi3_longrope()
    options = dict(dtype="fp16", target=GPU, overrides={"*": "fp32"}, **STATIC)
    with pytest.raises(ValueError) as refused:
        mpgraph.convert_decoder(model, prompt(), max_cache_len=25, **options)
    assert str(refused.value) == (
        "Phi3ForCausalLM uses rope_type 'longrope', which switches to its long factors once the "
        "sequence passes original_max_position_embeddings=24: the keys cached before were made "
        "with the short ones, and HF's generate (Phi-3) recomputes them all at that point, "
        "which the static cache cannot. Convert with max_cache_len <= 24 (prompt + new tokens "
        "within it), or generate with the HF model's own generate")
    decoder = mpgraph.convert_decoder(model, prompt(), max_cache_len=24, **options)
    with torch.no_grad():
        hf = model.generate(prompt(), max_new_tokens=24 - PROMPT, do_sample=False,
                            eos_token_id=None)
    assert decoder.generate(prompt(), max_new_tokens=24 - PROMPT,
                            eos_token_id=None).tolist() == hf.tolist()


def test_sampling_fewer_rows_than_the_cache_draws_hf_s_samples_for_the_same_seed():
    """A batch smaller than the cache's was sampled over the filled batch, which drew other
    random numbers: a prompt's samples depended on the batch the decoder was converted for."""
    model, decoder = _fp32_decoder()                         # converted for 2 rows
    ids = prompt(rows=1)
    draws = []
    for run in (model.generate, decoder.generate):
        torch.manual_seed(5)
        with torch.no_grad():
            draws.append(run(ids, max_new_tokens=NEW, do_sample=True, eos_token_id=None))
    assert draws[1].tolist() == draws[0].tolist()


def test_multi_query_falcon_converts_with_the_one_key_value_head_it_writes():
    """Falcon's default multi_query writes one key/value head; the cache was allocated with the
    config's head count (4) and the capture failed in index_copy_. The cache now takes the
    shapes the model writes, as HF's StaticCache does."""
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        eos_token_id=2, pad_token_id=0, bos_token_id=1)).eval()
    assert model.config.multi_query and not model.config.new_decoder_architecture
    decoder = mpgraph.convert_decoder(model, prompt(), max_cache_len=SLOTS, dtype="fp16",
                                      target=GPU, overrides={"*": "fp32"}, **STATIC)
    assert {c.shape for c in decoder.cache_plan} == {(2, 1, SLOTS, 16)}
    with torch.no_grad():
        hf = model.generate(prompt(), max_new_tokens=NEW, do_sample=False)
    assert decoder.generate(prompt(), max_new_tokens=NEW).tolist() == hf.tolist()


def test_dynamic_rope_is_refused_with_the_reason():
    """Dynamic NTK RoPE failed deep in the capture with advice a convert_decoder user cannot
    follow (torch.cond, converting the parts around it)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=24,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})).eval()
    with pytest.raises(ValueError) as refused:
        mpgraph.convert_decoder(model, prompt(), max_cache_len=SLOTS, dtype="bf16")
    assert str(refused.value) == (
        "LlamaForCausalLM uses rope_type 'dynamic' (dynamic NTK scaling), which recomputes the "
        "rotary frequencies from the sequence length at run time: convert_decoder's captured "
        "graphs cannot follow it. Generate with the HF model's own generate")


def _tokenizer():
    """A word-level tokenizer over the test vocabulary, token i spelled '<i>' (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {f"<{i}>": i for i in range(VOCAB - 1)}
    vocab["abcdef"] = VOCAB - 1  # (what StopStringCriteria probes the tokenizer's spelling with)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)


def test_hf_s_other_generate_arguments_are_taken_or_refused_with_the_reason():
    """tokenizer (which HF's stop_strings error asks for), prefix_allowed_tokens_fn and
    synced_gpus=False were 'arguments it does not know', and so were assistant_model and
    negative_prompt_ids, whose refusal the README promised with the reason."""
    model, decoder = _fp32_decoder()
    one = prompt(rows=1)
    free = decoder.generate(one, max_new_tokens=NEW, eos_token_id=[])[0, PROMPT:].tolist()
    stop = free[3]
    runs = []
    for run in (model.generate, decoder.generate):
        with torch.no_grad():
            runs.append(run(one, max_new_tokens=NEW, eos_token_id=None,
                            stop_strings=[f"<{stop}>"], tokenizer=_tokenizer()))
    assert runs[1].tolist() == runs[0].tolist()
    assert runs[1].shape == (1, PROMPT + free.index(stop) + 1)
    allowed = [[5, 6, 7], [8, 9]]
    for ids in (prompt(), one):                              # (one row: the cache has two)
        runs = []
        for run in (model.generate, decoder.generate):
            with torch.no_grad():
                runs.append(run(ids, max_new_tokens=6, prefix_allowed_tokens_fn=lambda row, seen:
                                allowed[row], synced_gpus=False))
        assert runs[1].tolist() == runs[0].tolist()
        for row, tokens in enumerate(runs[1][:, PROMPT:].tolist()):
            assert set(tokens) <= set(allowed[row])
    for kwargs, text in (
            (dict(assistant_model=model), "generate(assistant_model=...): assisted generation "
             "checks a draft's tokens several at a time; the decode graph takes one token per "
             "row; run it with the HF model's own generate"),
            (dict(negative_prompt_ids=one, guidance_scale=1.5), "generate(negative_prompt_ids="
             "...): classifier-free guidance runs the model on a second, negative prompt, which "
             "needs a second cache; run it with the HF model's own generate"),
            (dict(synced_gpus=True), "generate(synced_gpus=True) keeps several processes' loops "
             "in step (DeepSpeed ZeRO-3, FSDP); the converted decoder generates in one process"),
            (dict(dola_layers="low"), "generate: dola_generation is not supported (greedy "
             "search and sampling are); run it with the HF model's own generate")):
        with pytest.raises(ValueError) as refused:
            decoder.generate(one, max_new_tokens=4, **kwargs)
        assert str(refused.value) == text


def test_output_logits_is_hf_s_field_and_return_logits_mpgraph_s():
    """output_logits=True (without return_dict_in_generate) returned mpgraph's own
    GenerateOutput where HF's generate returns the ids tensor; mpgraph's per-step logits are
    return_logits=True."""
    from mpgraph.tools.generate import GenerateOutput
    model, decoder = _fp32_decoder()
    ids = prompt()
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True)
    got = decoder.generate(ids, max_new_tokens=4, output_logits=True)
    assert type(got) is torch.Tensor and got.tolist() == hf.tolist()
    own = decoder.generate(ids, max_new_tokens=4, return_logits=True)
    assert type(own) is GenerateOutput and own.sequences.tolist() == hf.tolist()
    assert own.logits.shape == (4, 2, VOCAB) and own.logits.dtype == torch.float32


def test_the_output_holds_no_cache_and_another_call_s_cache_is_refused_with_the_reason():
    """HF's output carries its cache for a follow-up call; the decoder's is its own static one
    (out.cache is None), and a cache passed back was 'an argument it does not know'."""
    model, decoder = _fp32_decoder()
    ids = prompt()
    out = decoder.generate(ids, max_new_tokens=2, return_dict_in_generate=True)
    # (the field is past_key_values before transformers 5.24)
    assert getattr(out, "cache", getattr(out, "past_key_values", 0)) is None
    assert out.sequences.shape == (2, PROMPT + 2)
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=2, return_dict_in_generate=True)
    for name in ("cache", "past_key_values"):
        with pytest.raises(ValueError) as refused:
            decoder.generate(out.sequences, max_new_tokens=2,
                             **{name: hf.cache if hasattr(hf, "cache") else hf.past_key_values})
        assert str(refused.value) == (
            f"generate({name}=...): the decoder keeps its own static cache (decoder.cache), "
            "filled from the prompt on every call: pass the whole sequence as the prompt "
            "instead; run it with the HF model's own generate")


def test_a_fixed_position_table_in_a_buffer_bounds_generation_with_a_clear_error():
    """GPT-J's sin/cos table is a buffer, not a parameter: the table was not found, and a
    generation past it failed with an IndexError from inside the graph, losing every token."""
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(
        n_embd=64, n_layer=1, n_head=4, rotary_dim=8, vocab_size=VOCAB, n_positions=30)).eval()
    ids = prompt(rows=1)
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=SLOTS, **STATIC)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(decoder.generate(ids, max_new_tokens=6), want)
    with pytest.raises(ValueError, match=r"exceed the model's position table \(transformer\."
                                         r"(rotary_emb|h\.0\.attn)\.embed_positions: 30 "
                                         r"positions"):
        decoder.generate(ids, max_new_tokens=30 - PROMPT + 1)


def _compiled_gpt2():
    """(model, decoder): a one-layer GPT-2 converted under torch.compile (convert_decoder takes
    the LM it compiles: the plain float32 model's decoder), once for the module."""
    if ("gpt2", "compiled") not in _BUILT:
        model = gpt2(layers=1)
        _BUILT["gpt2", "compiled"] = model, mpgraph.convert_decoder(
            torch.compile(model), prompt(rows=1), max_cache_len=SLOTS, **STATIC)
    return _BUILT["gpt2", "compiled"]


def test_generate_inside_a_generate_on_one_decoder_is_refused_and_a_compiled_lm_converts():
    """One decoder has one static cache: a streamer (or another thread) calling generate during
    a generate overwrote it under the first call, whose tokens came out wrong, silently. And a
    torch.compile'd LM was refused as 'not a transformers causal LM'."""
    model, decoder = _compiled_gpt2()
    ids = prompt(rows=1)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(decoder.generate(ids, max_new_tokens=6), want)

    class Nested:
        def __init__(self):
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 3:  # (a shallow copy shares the graphs, and their cache)
                copy.copy(decoder).generate(ids, max_new_tokens=2)

        def end(self):
            pass

    with pytest.raises(RuntimeError, match=r"this decoder is already generating .* one "
                                           r"decoder per thread"):
        decoder.generate(ids, max_new_tokens=6, streamer=Nested())
    assert torch.equal(decoder.generate(ids, max_new_tokens=6), want)  # usable again


def test_a_decoder_of_a_model_given_in_bf16_says_bf16():
    """Its repr said dtype=float32 where every weight is bfloat16 (the warning said bf16)."""
    model = copy.deepcopy(gpt2(layers=1)).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="computes in bfloat16"):
        decoder = mpgraph.convert_decoder(model, prompt(rows=1), max_cache_len=SLOTS, **STATIC)
    assert "dtype=bfloat16" in repr(decoder)
    # the same float32 model's decoder (gpt2(layers=1), prompt(rows=1), max_cache_len=SLOTS),
    # converted once for the module (given under torch.compile, which convert_decoder unwraps)
    assert "dtype=float32" in repr(_compiled_gpt2()[1])


class PeftLike(torch.nn.Module):
    """What peft's PeftModelForCausalLM is to mpgraph: the causal LM (holding the adapter
    layers) under get_base_model(), a forward taking the LM's arguments through **kwargs, the
    LM's attributes (config) read through."""
    def __init__(self, lm):
        super().__init__()
        self.base_model = lm

    def get_base_model(self):
        return self.base_model

    @property
    def config(self):
        return self.base_model.config

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return self.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_a_peft_wrapped_lm_converts_without_its_cache_and_convert_decoder_names_the_base_model():
    """convert(peft_lm, ids): use_cache=False was added for the bare LM only (a CaptureError
    about a returned KV cache); convert_decoder(peft_lm): "forward takes no `cache` argument:
    not a transformers 5 causal LM", with no way out."""
    model = gpt2(layers=1)
    wrapped, ids = PeftLike(model).eval(), prompt()
    fast = mpgraph.convert(wrapped, (ids,), dynamic=False)  # (run at the example's shapes)
    with torch.no_grad():
        assert torch.allclose(fast(ids).logits, model(ids).logits, atol=1e-5)
    with pytest.raises(TypeError, match=r"PeftLike is a peft wrapper: .* "
                                        r"convert_decoder\(model\.get_base_model\(\), \.\.\.\)"):
        mpgraph.convert_decoder(wrapped, ids, max_cache_len=SLOTS)


def test_the_decode_graph_is_calibrated_with_the_prompt_in_its_cache():
    """A prompt token with a large value vector (an attention sink): the prefill plan sees the
    large attention output and keeps o_proj float32; the decode plan was calibrated and checked
    on an all-zero cache, lowered o_proj, and every decode step came out NaN while its summary
    said "checked: error 0.00036". Calibrated with the prompt in its cache, it keeps what the
    prefill keeps, and its reported error is the measured one."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    sink = 5
    with torch.no_grad():
        embed, attention = model.model.embed_tokens.weight, model.model.layers[0].self_attn
        embed[:, 0] = 0
        embed[sink] = 0
        embed[sink, 0] = 1.0
        attention.q_proj.weight.zero_()  # uniform attention over the cache
        attention.v_proj.weight[0] = 0
        attention.v_proj.weight[0, 0] = 3500.0
        attention.o_proj.weight[:, 0] = 50.0
    ids = torch.randint(6, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    ids[:, 3] = sink
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=24, target=GPU, dtype="fp16",
                                      strategy="rules", calibration=[ids, ids[:, :6]])
    o_proj = "model.model.layers.0.self_attn.o_proj"  # (under the StaticCacheStep)
    dtypes = [[r.dtype for r in gm.plan.nodes if r.module == o_proj]
              for gm in (decoder.prefill, decoder.decode)]
    assert dtypes == [["float32"], ["float32"]]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    got = decoder.generate(ids, max_new_tokens=6, forced_tokens=out.sequences[:, PROMPT:],
                           return_logits=True).logits
    errors = [relative_l2(g, r) for g, r in zip(got, out.logits)]
    assert all(e < BOUND[torch.float16] for e in errors), errors
    assert decoder.decode.plan.check["error"] == pytest.approx(errors[1], rel=0.3)


def test_the_decoder_s_settings_are_its_own_and_converting_keeps_the_caller_s_rng():
    """decoder.config and decoder.generation_config were the model's objects: editing one edited
    the model (its own generate then sampled). A model left in training mode drew dropout from
    the caller's RNG when the cache was built; convert leaves it as it was."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=64))  # (training mode)
    torch.manual_seed(123)
    with pytest.warns(UserWarning, match="training mode"):
        decoder = mpgraph.convert_decoder(model, prompt(), max_cache_len=SLOTS, dtype="bf16",
                                          target="cpu", **STATIC)
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(4))  # the caller's stream, where it was
    assert decoder.config is not model.config
    assert decoder.generation_config is not model.generation_config
    decoder.generation_config.do_sample = True
    decoder.config.vocab_size = 7
    assert not model.generation_config.do_sample and model.config.vocab_size == VOCAB


def test_llama4_chunked_attention_within_its_chunk_converts_and_t5_is_refused_by_name():
    """Llama4's chunked layers take their size from attention_chunk_size (sliding_window is
    None): the refusal said "window None ... max_cache_len <= None" at any length. T5 failed
    inside transformers ("exactly one of input_ids or inputs_embeds")."""
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, head_dim=8, num_local_experts=2, intermediate_size_mlp=64,
        attention_chunk_size=24, vocab_size=VOCAB, pad_token_id=0)).eval()
    ids = prompt()
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=24, dtype="bf16", target="cpu",
                                      overrides={"*": "fp32"}, **STATIC)
    assert_tokens_equal_hf(model, decoder, ids)
    with pytest.raises(ValueError, match=r"\(window 24\) .* max_cache_len=25 outgrows the window"
                                         r": .* Convert with max_cache_len <= 24 "):
        mpgraph.convert_decoder(model, ids, max_cache_len=25, dtype="bf16", target="cpu")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=VOCAB))
    with pytest.raises(TypeError, match="T5ForConditionalGeneration is an encoder-decoder model: "
                                        "convert_decoder takes a decoder-only causal LM"):
        mpgraph.convert_decoder(t5, ids, max_cache_len=24)


def test_a_causal_lm_whose_config_counts_encoder_layers_builds_its_decoder_s_cache():
    """MarianForCausalLM's num_hidden_layers is the encoder's count (4 here): the cache had 4
    layers, the decoder wrote 2, and convert_decoder refused it ("did not write its cache
    layers [2, 3]") though HF's generate runs it."""
    torch.manual_seed(0)
    model = transformers.MarianForCausalLM(transformers.MarianConfig(
        d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
        encoder_layers=4, max_position_embeddings=64, decoder_start_token_id=0,
        vocab_size=VOCAB, pad_token_id=0, eos_token_id=2)).eval()
    ids = prompt()
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=SLOTS, dtype="bf16",
                                      target="cpu", overrides={"*": "fp32"}, **STATIC)
    assert len(cache_names(decoder.prefill)) == 2 * 2  # (keys and values of 2 layers)
    assert_tokens_equal_hf(model, decoder, ids)


def test_convert_decoder_s_warnings_name_the_lm_and_its_paths_once():
    """They named StaticCacheStep and its model.model.layers.0 paths, the user's never, once per
    graph, and said a train-mode model's decoder "starts in training mode" (both graphs are
    returned in eval mode)."""
    torch.manual_seed(0)
    model = llama(layers=1)
    model.model.layers[0].register_forward_hook(lambda *args: None)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder = mpgraph.convert_decoder(model, prompt(), max_cache_len=SLOTS, dtype="bf16",
                                          target="cpu", **STATIC)
    told = [str(w.message) for w in caught]
    assert not any("StaticCacheStep" in t or "model.model." in t or "starts in training mode"
                   in t for t in told), told
    hooks = [t for t in told if t.startswith("forward hooks on model.layers.0 of "
                                             "LlamaForCausalLM ran while it was traced")]
    assert len(hooks) == 1, told
    assert any("LlamaForCausalLM is in training mode; generation wants model.eval()" in t
               for t in told)
    assert not decoder.prefill.training and not decoder.decode.training


def test_a_decoder_whose_step_cannot_be_traced_gets_the_way_out_that_applies_to_it():
    """MPT's ALiBi bias sliced by the prompt's length: torch.export's "8 not in VR[0, 2]" came
    with convert's fix, "convert the submodules before and after it", which no decoder can."""
    torch.manual_seed(0)
    model = transformers.MptForCausalLM(transformers.MptConfig(
        d_model=32, n_layers=1, n_heads=4, max_seq_len=64, vocab_size=VOCAB)).eval()
    with pytest.raises(mpgraph.CaptureError) as caught:
        mpgraph.convert_decoder(model, prompt(), max_cache_len=30)
    text = str(caught.value)
    assert "fix: convert_decoder traces the model's own forward on a static KV cache" in text
    assert "generate with the HF model's own generate" in text and "model.encoder" not in text


class PastKeyValuesLlama(transformers.LlamaForCausalLM):
    """A causal LM as transformers before 5.24 (and remote code) define them: its forward takes
    the KV cache as ``past_key_values``, not ``cache``."""
    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
        name = "cache" if "cache" in inspect.signature(super().forward).parameters \
            else "past_key_values"
        return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=use_cache,
                               logits_to_keep=logits_to_keep, **{name: past_key_values},
                               **kwargs)


def test_an_lm_taking_past_key_values_converts_and_others_are_refused_with_the_reason(
        monkeypatch):
    """transformers before 5.24 named the cache argument past_key_values: every decoder was
    refused ("takes no `cache` argument"). A forward taking neither, or a transformers too old
    for the static cache, is refused with the reason."""
    reference = llama(layers=1)
    model = PastKeyValuesLlama(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    ids = prompt(rows=1)
    decoder = mpgraph.convert_decoder(model, ids, max_cache_len=SLOTS, **STATIC)
    assert_tokens_equal_hf(reference, decoder, ids, n=6)

    class NoCache(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.config, self.lm_head = lm.config, lm.lm_head

        def forward(self, input_ids, attention_mask=None):
            return self.lm_head(torch.zeros(*input_ids.shape, 64))

    with pytest.raises(TypeError, match=r"NoCache\.forward takes no `cache` \(or "
                                        r"`past_key_values`\) argument: not a transformers 5 "
                                        r"causal LM with a KV cache"):
        mpgraph.convert_decoder(NoCache(reference), ids, max_cache_len=SLOTS)
    # (the module imported now: transformers' lazy module replaces itself in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.16.1")
    with pytest.raises(ImportError, match=r"convert_decoder needs transformers >= 5\.17 .* "
                                          r"transformers 5\.16\.1 is installed: pip install "
                                          r"-U 'transformers>=5\.17'"):
        mpgraph.convert_decoder(model, ids, max_cache_len=SLOTS)
