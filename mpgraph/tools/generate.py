"""Text generation with a converted decoder: ``mpgraph.convert_decoder`` and ``mpgraph.generate``.

A HuggingFace causal LM is converted twice, through the same passes: a *prefill* graph (the
prompt, any length from 2 up, cache slots 0..L-1) and a one-token *decode* graph (cache slot
t). Both wrap the model around one ``transformers.StaticCache`` whose key and value tensors are
buffers of the wrapper (``key_cache_<i>``, ``value_cache_<i>``), so torch.export sees them as
buffers written in place (``index_copy_`` into the buffer, no new tensor per step) and each plan
records their dtype as it records any value's (``ConvertedDecoder.cache_plan``: the dtype and the
plan's reason: written only by stores, the cache is stored in the low dtype where the plan
lowers its readers). After conversion the decode graph's parameters, buffers and cache are
pointed at the prefill graph's tensors wherever both plans stored the same name with the same
shape and dtype: weights are stored once, and the cache both graphs read and write is one set of tensors
(``ConvertedDecoder.sharing`` counts what is shared and what is not).

``generate`` runs the prefill graph once, then the decode graph per new token, with HF's
arguments, generation config, logits processors and stopping criteria (batch > 1 with left
padding through ``attention_mask``); on CUDA the
decode step is replayed from a CUDA graph (``mpgraph.cuda_graph``), since every decode call has
the same shapes and reads the cache at the same addresses.

Limits: the batch size and the cache length are fixed at conversion (a smaller batch is padded
with copies of its first row, which the processors, sampling and output never see; ``prompt
length + max_new_tokens`` must fit the cache); the prompt is prefilled in one call (a one-token
prompt goes through the decode graph); models whose cache has sliding-window layers convert for
a cache within the window (it does not roll), other non-static layers are refused; dynamic RoPE
is refused, longrope converts for a cache within its original positions; the converted graphs
are tied to the device they were converted on (export bakes it into the graph's constants).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import functools
import inspect
import itertools
import logging
import operator
import os
import re
import threading
import warnings
import weakref
from typing import Any, Iterable, Optional, Union

import torch

from mpgraph.api import convert
from mpgraph.errors import DECODER_FIX, GENERAL_FIX, CaptureError
from mpgraph.frontend.capture import in_inference_mode, outside_inference_mode
from mpgraph.ir.fake import has_meta_tensors, module_tensors
from mpgraph.ir.graph import fetch_attr, is_inplace, seeded, set_attr
from mpgraph.tools.cuda_graph import GraphedModule
from mpgraph.ir.meta import dtype_name
from mpgraph.ir.modules import autocasting, caller_outside
from mpgraph.plans.weights import load_weights_shared

log = logging.getLogger(__name__)

KEY, VALUE, LENGTH = "key_cache_", "value_cache_", "cumulative_length_"


# the keyword a causal LM's forward takes its KV cache by: transformers 5.24 renamed
# past_key_values (its earlier releases', and remote code's) to cache
_CACHE_ARGS = ("cache", "past_key_values")
# the oldest transformers convert_decoder was checked on: the StaticCache layers keep their
# write position in a tensor (cumulative_length, from 5.4 on), which the graphs set from
# cache_position on every call; 5.5 converts Llama and GPT-2, but its vmap-built masks
# (Falcon) do not capture
MIN_TRANSFORMERS = "5.17"


def _require_transformers() -> None:
    """Refuse a transformers older than ``MIN_TRANSFORMERS`` up front, with the version needed
    (before 5.4 the static cache writes where the model's cache_position says, which the step
    does not drive; later ones failed deep inside capture)."""
    import transformers
    from packaging.version import Version
    if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
        raise ImportError(
            f"convert_decoder needs transformers >= {MIN_TRANSFORMERS} (the oldest whose "
            f"static cache and masks it captures); transformers "
            f"{transformers.__version__} is installed: pip install -U "
            f"'transformers>={MIN_TRANSFORMERS}'")


class StaticCacheStep(torch.nn.Module):
    """One call of a HuggingFace causal LM on a static KV cache whose tensors are buffers here.

    ``forward(input_ids, position_ids, cache_position, attention_mask)``:
    ``input_ids``/``position_ids`` (B, T); ``cache_position`` (1,): the cache slot of the first
    of the T tokens (they go to slots ``cache_position[0] + 0..T-1``); ``attention_mask``
    (B, max_cache_len), 1 where a slot holds a real (not padding) token. Returns the logits of
    the last position, (B, vocab), in the model's dtype.

    The cache's key/value tensors are this module's buffers and are handed to the cache layers
    on every call (read through the module, so torch.export names them and keeps their in-place
    updates); the cache write position is set from ``cache_position`` on every call.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, max_cache_len: int,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
        config = getattr(model, "config", None)
        if config is None:
            raise TypeError(f"expected a HuggingFace causal LM (with .config), got "
                            f"{type(model).__name__}")
        _require_transformers()
        params = inspect.signature(model.forward).parameters
        self._cache_arg = next((name for name in _CACHE_ARGS if name in params), None)
        if self._cache_arg is None and callable(getattr(model, "get_base_model", None)):
            raise TypeError(  # a peft wrapper
                f"{type(model).__name__} is a peft wrapper: convert_decoder takes the causal LM "
                "itself, which holds the adapter layers: convert_decoder(model.get_base_model(), "
                "...) (LoRA and the like), or model.merge_and_unload() first; prompt-learning "
                "adapters (virtual tokens) are not supported")
        head = getattr(model, "get_output_embeddings", None)
        if (head is None or head() is None) and getattr(model, "lm_head", None) is None:
            # (its output has no logits to generate from; a remote-code LM that does not
            # override get_output_embeddings still has its lm_head)
            raise TypeError(f"{type(model).__name__} has no language-model head (it returns "
                            "hidden states, not logits): convert_decoder takes a causal LM, "
                            "the *ForCausalLM class (LlamaForCausalLM, not LlamaModel)")
        if getattr(config, "is_encoder_decoder", False):  # (T5's own "exactly one of
            raise TypeError(  # input_ids or inputs_embeds" came first)
                f"{type(model).__name__} is an encoder-decoder model: convert_decoder takes a "
                "decoder-only causal LM (LlamaForCausalLM, GPT2LMHeadModel); convert the "
                "encoder and decoder with mpgraph.convert, or generate with the HF model's own "
                "generate")
        if self._cache_arg is None:
            raise TypeError(f"{type(model).__name__}.forward takes no `cache` (or "
                            "`past_key_values`) argument: not a transformers 5 causal LM with "
                            "a KV cache")
        self.model = model
        self._logits_to_keep = "logits_to_keep" in params
        text = config.get_text_config(decoder=True)
        _check_rope(model, text, max_cache_len)
        layers = getattr(text, "decoder_layers", None)  # (Marian/BART as causal LMs: their
        if isinstance(layers, int) and layers != getattr(text, "num_hidden_layers", layers):
            text = copy.deepcopy(text)  # num_hidden_layers is the encoder's count)
            text.num_hidden_layers = layers
        self.cache = StaticCache(config=text, max_cache_len=max_cache_len)
        window = getattr(text, "sliding_window", None)
        if window is None:  # (Llama4's chunked layers: their size is the chunk's)
            window = getattr(text, "attention_chunk_size", None)
        sliding = [i for i, layer in enumerate(self.cache.layers)
                   if type(layer) is StaticSlidingWindowLayer]
        if sliding and window is not None and max_cache_len <= window:
            # a window the cache never outgrows: every slot stays in it, so a sliding layer
            # computes what a full one does (its mask's window test always passes), without its
            # Python count of tokens that a traced graph would freeze
            for i in sliding:
                self.cache.layers[i] = StaticLayer(max_cache_len=max_cache_len)
        elif sliding:
            raise ValueError(
                f"{type(model).__name__} has sliding-window attention (window {window}) in "
                f"{len(sliding)} layers, and max_cache_len={max_cache_len} outgrows the window: "
                "convert_decoder's static cache does not roll. Convert with max_cache_len <= "
                f"{window} (prompt + new tokens within the window), or generate with the HF "
                "model's own generate")
        local = [i for i, kind in enumerate(getattr(text, "attention_layers", None) or ())
                 if kind == "local"]  # (GPT-Neo's windows: window_size, in full cache layers)
        neo_window = getattr(text, "window_size", None)
        if local and isinstance(neo_window, int) and max_cache_len > neo_window:
            # (its local layers slice their window from the cache's length, not the tokens'
            # count: past the window, real prompt keys are masked, logits 10-15% off)
            raise ValueError(
                f"{type(model).__name__} has local (windowed) attention (window {neo_window}) "
                f"in {len(local)} layers, and max_cache_len={max_cache_len} outgrows the "
                "window: its local layers mask real keys under a static cache. Convert with "
                f"max_cache_len <= {neo_window} (prompt + new tokens within the window), or "
                "generate with the HF model's own generate")
        kinds = {type(layer).__name__ for layer in self.cache.layers
                 if type(layer) is not StaticLayer}
        if kinds:
            raise ValueError(f"{type(model).__name__}'s cache has {sorted(kinds)} layers; "
                             "convert_decoder supports full-attention StaticLayer caches (and "
                             "sliding windows up to their window) only")
        self._initialize_cache(model, batch_size, dtype)
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"{KEY}{i}", layer.keys, persistent=False)
            self.register_buffer(f"{VALUE}{i}", layer.values, persistent=False)
            self.register_buffer(f"{LENGTH}{i}", layer.cumulative_length, persistent=False)
        self.batch_size, self.max_cache_len = batch_size, max_cache_len

    def _initialize_cache(self, model, batch_size: int, dtype) -> None:
        """Allocate the cache as HF's StaticCache does in ``generate``: lazily, from the keys and
        values the model writes on its first call (one token here), so each layer's head count
        and head size are the model's, not the config's guess (multi-query Falcon writes one
        key/value head where its config counts all of them). Then zeroed."""
        device = next(model.parameters()).device
        with torch.no_grad(), seeded():  # (a model in training mode draws dropout: not from
            ids = torch.zeros((batch_size, 1), dtype=torch.long, device=device)  # the caller's
            model(input_ids=ids, attention_mask=torch.ones_like(ids),  # RNG; a mask: token 0
                  **{self._cache_arg: self.cache}, use_cache=True)  # may be the pad id, and
            # transformers warned that the ids "may be padded")
        unwritten = [i for i, layer in enumerate(self.cache.layers) if not layer.is_initialized]
        if unwritten:
            raise ValueError(f"{type(model).__name__} did not write its cache layers {unwritten}: "
                             "convert_decoder needs a model that fills one StaticCache layer "
                             "per attention layer")
        for layer in self.cache.layers:
            layer.keys = layer.keys.to(dtype=dtype or layer.keys.dtype).zero_()
            layer.values = layer.values.to(dtype=dtype or layer.values.dtype).zero_()
            layer.cumulative_length.zero_()

    def forward(self, input_ids, position_ids, cache_position, attention_mask):
        for i, layer in enumerate(self.cache.layers):
            layer.keys = getattr(self, f"{KEY}{i}")
            layer.values = getattr(self, f"{VALUE}{i}")
            layer.cumulative_length = getattr(self, f"{LENGTH}{i}")
            layer.cumulative_length.copy_(cache_position[0])
        extra = {"logits_to_keep": 1} if self._logits_to_keep else {}
        with _short_longrope(self.model):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, **{self._cache_arg: self.cache},
                             use_cache=True, **extra)
        return out.logits[:, -1]


@contextlib.contextmanager
def _short_longrope(model: torch.nn.Module):
    """Longrope rotary embeddings called as plain ones: their per-call choice of the short or
    long factors (transformers 5.20 and earlier branch in Python on ``max(position_ids)``, which
    no tracer captures) always picks the short ones here, since ``_check_rope`` keeps the cache
    within ``original_max_position_embeddings``; their ``inv_freq`` holds the short factors since
    the cache was built by a one-token call."""
    saved = [(m, m.rope_type) for m in model.modules()
             if hasattr(m, "original_inv_freq") and "longrope" in (
                 m.rope_type.values() if isinstance(getattr(m, "rope_type", None), dict)
                 else [getattr(m, "rope_type", None)])]
    try:
        for m, kind in saved:
            m.rope_type = ({k: "default" if v == "longrope" else v for k, v in kind.items()}
                           if isinstance(kind, dict) else "default")
        yield
    finally:
        for m, kind in saved:
            m.rope_type = kind


def _check_rope(model: torch.nn.Module, text, max_cache_len: int) -> None:
    """Refuse the rotary embeddings whose frequencies depend on the sequence in a way the
    static cache cannot follow: dynamic NTK scaling recomputes them from the sequence length
    on each call (a Python branch on the positions, and state kept between calls: no captured
    graph follows it); longrope switches from its short to its long factors once the sequence
    passes ``original_max_position_embeddings``, where HF's generate (Phi-3) recomputes the
    whole cache with the long factors; a static cache would keep the keys made with the short
    ones."""
    params = getattr(text, "rope_parameters", None) or {}
    for rope in [params] if "rope_type" in params else \
            [p for p in params.values() if isinstance(p, dict)]:
        kind = rope.get("rope_type")
        if kind is not None and "dynamic" in kind:
            raise ValueError(
                f"{type(model).__name__} uses rope_type {kind!r} (dynamic NTK scaling), which "
                "recomputes the rotary frequencies from the sequence length at run time: "
                "convert_decoder's captured graphs cannot follow it. Generate with the HF "
                "model's own generate")
        limit = rope.get("original_max_position_embeddings",
                         getattr(text, "original_max_position_embeddings", None))
        if kind == "longrope" and limit is not None and max_cache_len > limit:
            raise ValueError(
                f"{type(model).__name__} uses rope_type 'longrope', which switches to its long "
                "factors once the sequence passes original_max_position_embeddings="
                f"{limit}: the keys cached before were made with the short ones, and HF's "
                "generate (Phi-3) recomputes them all at that point, which the static cache "
                f"cannot. Convert with max_cache_len <= {limit} (prompt + new tokens within "
                "it), or generate with the HF model's own generate")


def _position_table(decoder) -> Optional[tuple[str, int]]:
    """(name, positions) of the decoder's learned position table, if it has one (GPT-2's
    ``wpe``, OPT's ``embed_positions``, with its offset of 2): a sequence longer than it makes
    positions that index out of range inside the graph."""
    return _learned_positions(decoder.config, decoder.prefill)


def _learned_positions(config, module) -> Optional[tuple[str, int]]:
    """``_position_table`` of a model (its config, and a module holding its parameters)."""
    text = config.get_text_config(decoder=True)
    limit = getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    # a learned table is a parameter (GPT-2's wpe, OPT's embed_positions); a fixed one a buffer
    # (GPT-J's and CodeGen's sin/cos embed_positions, XGLM's sinusoids), read past its end as
    # an IndexError deep in the graph
    tensors = [(n, t, True) for n, t in module.named_parameters()] \
        + [(n, t, False) for n, t in module.named_buffers()]
    for name, t, param in tensors:
        owner, _, leaf = name.rpartition(".")
        last = owner.rpartition(".")[2]
        named = (leaf == "weight" and ("pos" in last or last == "wpe")) if param \
            else ("pos" in leaf or "pos" in last)
        if named and t.dim() == 2 and limit <= t.shape[0] <= limit + 2:
            # (the cache step holds the model)
            return (owner if param else name).removeprefix("model."), limit
    return None


def cache_names(module: torch.nn.Module) -> list[str]:
    """The cache tensors' attribute names of a converted step (key_cache_0, value_cache_0, ...)."""
    names = [n for n, _ in module.named_buffers() if n.startswith((KEY, VALUE))]
    return sorted(names, key=lambda n: (int(n.rsplit("_", 1)[1]), not n.startswith(KEY)))


@dataclasses.dataclass
class Sharing:
    """What the decode graph shares with the prefill graph (tensors by attribute name)."""

    shared: list                  # names both graphs hold one tensor for (the prefill graph's;
    #                               the decode graph's where the two layouts differed)
    unshared: list                # (name, why): tensors each graph keeps its own copy of
    bytes_shared: int             # bytes the decode graph would otherwise hold twice
    bytes_stored: int             # bytes both graphs hold together (each storage counted once)
    bytes_separate: int           # ... had each kept its own copies
    tensors_stored: int           # distinct storages of both graphs together

    def __str__(self) -> str:
        mib = 2 ** 20
        text = (f"{len(self.shared)} tensors shared ({self.bytes_shared / mib:.2f} MiB), "
                f"{len(self.unshared)} not; both graphs hold {self.tensors_stored} tensors, "
                f"{self.bytes_stored / mib:.2f} MiB ({self.bytes_separate / mib:.2f} MiB unshared)")
        if self.unshared:
            text += "; not shared: " + ", ".join(f"{n} ({why})" for n, why in self.unshared)
        return text


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the graph reads by name: parameters, buffers, and tensor attributes its
    get_attr nodes name (lifted constants)."""
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    for node in module.graph.nodes:
        if node.op == "get_attr" and node.target not in out:
            value = fetch_attr(module, node.target)
            if isinstance(value, torch.Tensor):
                out[node.target] = value
    return out


def _storage_bytes(tensors) -> tuple[int, int]:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return len(seen), sum(seen.values())


_ANY_LAYOUT = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.mv.default,
               torch.ops.aten.t.default, torch.ops.aten.linear.default,
               torch.ops.aten.matmul.default}


def _reads_any_layout(gm: torch.nn.Module, name: str) -> bool:
    """Whether every reader of the tensor at ``name`` in ``gm``'s graph takes it in any strides
    (a matmul; a transpose feeding one is a view, and the matmul takes that)."""
    readers = [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == name
               for u in n.users]
    return bool(readers) and all(u.op == "call_function" and u.target in _ANY_LAYOUT
                                 for u in readers)


def share_tensors(prefill: torch.nn.Module, decode: torch.nn.Module,
                  must_share: tuple = ()) -> Sharing:
    """Point ``decode``'s tensors at ``prefill``'s where both have the name with the same shape
    and dtype; where their layouts differ (a weight the decode plan stores transposed for its
    GEMV), the prefill graph's at the decode graph's, if the prefill graph's readers of it take
    any strides (matmuls, transposes). ``must_share``: names that must be
    shared (the cache): a difference there is a ValueError."""
    ours, theirs = _tensors(prefill), _tensors(decode)
    fused = getattr(decode, "fused_weights", None)
    stacks, members = (fused.stacks, fused.members) if fused is not None else (set(), set())
    separate = _storage_bytes(list(ours.values()))[1] + _storage_bytes(list(theirs.values()))[1]
    shared, unshared, rejoin = [], [], []
    for name, t in theirs.items():
        src = ours.get(name)
        why = None
        if src is None:
            why = ("only in the decode graph (sibling weights stacked for one GEMV; the weights "
                   "are views of it)") if name in stacks else "only in the decode graph"
        elif src.shape != t.shape:
            why = f"shape {tuple(t.shape)} vs the prefill graph's {tuple(src.shape)}"
        elif src.dtype != t.dtype:
            why = (f"the decode plan stores it as {dtype_name(t.dtype)}, the prefill plan as "
                   f"{dtype_name(src.dtype)}")
        elif src.device != t.device:
            why = f"on {t.device}, the prefill graph's on {src.device}"
        elif src.stride() != t.stride() and not _reads_any_layout(prefill, name):
            why = (f"the decode plan stores it with strides {t.stride()}, the prefill plan with "
                   f"{src.stride()}, which one of its ops reads as laid out")
        if why is None:
            if name in members and src is not t:  # a row of a stack the decode graph reads:
                set_attr(decode, name, src)  # the stack takes the prefill graph's values (a
                rejoin.append(name)          # load), then both graphs read its view
            elif src is not t:
                if src.stride() == t.stride():
                    set_attr(decode, name, src)
                else:  # the layout the decode plan stored it in (a Conv1D weight transposed
                    set_attr(prefill, name, t)  # for its GEMV) is the one read per token
            shared.append(name)
        else:
            if name in must_share:
                raise ValueError(f"the cache tensor {name} cannot be shared between the prefill "
                                 f"and decode graphs: {why}")
            unshared.append((name, why))
    if rejoin:
        fused.refresh(decode)
        for name in rejoin:
            set_attr(prefill, name, fetch_attr(decode, name))
    for name in ours:
        if name not in theirs:
            unshared.append((name, "only in the prefill graph"))
    count, stored = _storage_bytes(list(_tensors(prefill).values())
                                   + list(_tensors(decode).values()))
    # (what sharing saves, whether this call or an earlier one pointed the graphs at one copy:
    # counted from what it re-pointed, a second call, after load_weights, said 0.00 MiB)
    return Sharing(shared, unshared, max(0, separate - stored), stored, separate, count)


@dataclasses.dataclass(frozen=True)
class CacheRecord:
    """One cache tensor as planned: its name, shape, dtype, and the plan's reason."""

    name: str
    shape: tuple
    dtype: str
    reason: str


class ConvertedDecoder:
    """A causal LM converted for generation: ``prefill`` and ``decode`` (converted GraphModules,
    each with its ``.plan``) sharing weights and one static KV cache. See ``convert_decoder``."""

    def __init__(self, prefill, decode, *, batch_size: int, max_cache_len: int,
                 sharing: Sharing, cache_plan: list, config=None, generation_config=None):
        self.prefill, self.decode = prefill, decode
        self.batch_size, self.max_cache_len = batch_size, max_cache_len
        self.sharing, self.cache_plan, self.config = sharing, cache_plan, config
        # the model's own generation config (eos, pad, ...): what generate follows by default
        self.generation_config = generation_config
        self._graphed = None

    @property
    def cache(self) -> list[torch.Tensor]:
        """The cache tensors (key and value per layer), shared by both graphs."""
        return [fetch_attr(self.prefill, r.name) for r in self.cache_plan]

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.cache[0].dtype

    @property
    def device(self) -> torch.device:
        return self.cache[0].device

    def load_weights(self, *weights, device=None, strict: bool = True) -> "ConvertedDecoder":
        """``mpgraph.load_weights`` for both graphs, by the causal LM's own names (its
        ``state_dict()``, its checkpoint): the prefill graph's tensors are loaded, the decode
        graph pointed at them by name (share_tensors) and given its own only where the plans
        differ, so the two keep one copy of what they shared. The graphs stay on their device."""
        names = tuple(cache_names(self.prefill))

        def share() -> list:
            return [name for name, _ in share_tensors(self.prefill, self.decode, names).unshared]
        load_weights_shared(self.prefill, self.decode, weights, share, device=device,
                            strict=strict)
        self.sharing = share_tensors(self.prefill, self.decode, names)
        self._graphed = None  # a CUDA graph captured the tensors this replaced
        self.reset_cache()
        return self

    def reset_cache(self) -> None:
        """Zero the cache in place (``generate`` does it first: no stale value, not even a NaN
        from another run, can reach a masked slot's product)."""
        with torch.no_grad():
            for t in self.cache:
                t.zero_()

    def graphed_decode(self, backend=None):
        """The decode step replayed from a CUDA graph (``mpgraph.cuda_graph`` with static
        outputs: the logits are read before the next step overwrites them), built on first use.
        Every decode call has the same signature, so one graph serves a whole generation and
        the next ones; it reads the weights and writes the cache at their fixed addresses.
        ``backend``: a ``CudaGraphBackend`` to use instead of CUDA's (tests)."""
        if self._graphed is None or (backend is not None and self._graphed.backend is not backend):
            self._graphed = GraphedModule(self.decode, static_outputs=True, max_graphs=2,
                                          backend=backend)
        return self._graphed

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """As the HF model's ``generate(inputs, generation_config, **kwargs)``, positions
        included (``generate(ids, config)`` took the config for the attention mask):
        ``mpgraph.generate(self, input_ids, ...)``."""
        if isinstance(generation_config, torch.Tensor):
            raise TypeError("generate's second positional argument is the generation config, as "
                            "in HuggingFace's generate: pass the mask as attention_mask=...")
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        return generate(self, input_ids, attention_mask=kwargs.pop("attention_mask", None),
                        generation_config=generation_config, **kwargs)

    def summary(self) -> str:
        cache = ", ".join(sorted({f"{r.dtype} ({r.reason})" for r in self.cache_plan}))
        return (f"prefill: {self.prefill.plan.summary()}\ndecode: {self.decode.plan.summary()}\n"
                f"cache: {len(self.cache_plan)} tensors of {self.cache_plan[0].shape} "
                f"(batch {self.batch_size}, {self.max_cache_len} slots) in {cache}\n"
                f"sharing: {self.sharing}")

    def __repr__(self) -> str:
        plan = self.prefill.plan  # (its low dtype where a node has it; else its weights' dtype:
        # a model given in bf16 computes in bf16 with no node planned low)
        dtype = plan.dtype if plan.low_nodes else next(
            (p.dtype for p in self.prefill.parameters() if p.is_floating_point()), torch.float32)
        return (f"ConvertedDecoder(batch_size={self.batch_size}, max_cache_len="
                f"{self.max_cache_len}, dtype={dtype_name(dtype)}, "
                f"cache={dtype_name(self.cache_dtype)})")


def _cache_plan(module, names) -> list[CacheRecord]:
    out = []
    for name in names:
        t = fetch_attr(module, name)
        node = next((n for n in module.graph.nodes
                     if n.op == "get_attr" and n.target == name), None)
        try:
            rec = module.plan.node(node.name) if node is not None else None
        except KeyError:
            rec = None
        reason = rec.reason if rec is not None and rec.reason else "not decided by the plan"
        out.append(CacheRecord(name, tuple(t.shape), dtype_name(t.dtype), reason))
    return out


def _in_place_writes(module, names) -> dict[str, list[str]]:
    """For each cache buffer, the ops of the graph that write into it in place."""
    nodes = {n.target: n for n in module.graph.nodes if n.op == "get_attr" and n.target in names}
    return {name: [u.name for u in node.users if is_inplace(u, module) and u.args[0] is node]
            for name, node in nodes.items()}


def _mask(batch: int, upto: int, max_cache_len: int, device) -> torch.Tensor:
    """The attention mask over the cache slots 0..upto."""
    mask = torch.zeros(batch, max_cache_len, dtype=torch.long, device=device)
    mask[:, :upto + 1] = 1
    return mask


def _prefill_args(prompt, batch: int, max_cache_len: int, device) -> tuple:
    """The prefill graph's inputs for a prompt (the example or a calibration one): its rows
    repeated to the cache's batch, positions from 0, the mask over the prompt and the slot
    after it."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.shape[1] < 2 \
            or prompt.dtype not in (torch.int64, torch.int32) or prompt.shape[1] >= max_cache_len:
        raise ValueError("calibration takes prompts: (batch, length) integer tensors of token "
                         f"ids with 2 <= length < max_cache_len={max_cache_len}")
    ids = prompt.to(device=device, dtype=torch.long)
    ids = ids[torch.arange(batch, device=device) % ids.shape[0]]
    length = ids.shape[1]
    positions = torch.arange(length, device=device).expand(batch, -1).contiguous()
    return (ids, positions, torch.zeros(1, dtype=torch.long, device=device),
            _mask(batch, length, max_cache_len, device))


def _in_slices(prompt, batch: int) -> list:
    """A (B', L') prompt batch in slices of at most ``batch`` rows (none of no rows); anything
    else as it is, for ``_prefill_args`` to refuse."""
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 2:
        return list(prompt.split(batch)) if prompt.shape[0] else []
    return [prompt]


def _step_args(tokens: torch.Tensor, position: int, max_cache_len: int) -> tuple:
    """The decode graph's inputs: one token per row at cache slot ``position``."""
    batch, device = tokens.shape[0], tokens.device
    return (tokens, torch.full((batch, 1), position, dtype=torch.long, device=device),
            torch.full((1,), position, dtype=torch.long, device=device),
            _mask(batch, position, max_cache_len, device))


@contextlib.contextmanager
def _decoder_fix():
    """A capture failure of a decoder's graph with the way out that applies to it (MPT's ALiBi
    bias sliced by the prompt's length: torch.export's "8 not in VR[0, 2]" came with convert's
    "convert the submodules before and after it")."""
    try:
        yield
    except CaptureError as e:
        raise e.retold(GENERAL_FIX, DECODER_FIX)


@contextlib.contextmanager
def _told_as_the_lm(model: torch.nn.Module):
    """convert's warnings about the two graphs, as the user knows the model: the LM's class,
    not StaticCacheStep, its module paths (``model.layers.0``), not ours (``model.model.layers.0``),
    each once (not once per graph), and not "starts in training mode" (convert_decoder returns
    both graphs in eval mode, and warns of a training-mode model itself)."""
    paths = {name for name, _ in model.named_modules() if name} | {
        name for name, _ in itertools.chain(model.named_parameters(), model.named_buffers())}
    name = type(model).__name__

    def as_the_lm(text: str) -> str:
        text = text.replace(StaticCacheStep.__name__, name)
        return re.sub(r"\bmodel\.([\w.]+)", lambda m: m[1] if m[1].rstrip(".") in paths
                      else m[0], text)

    seen: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                seen = list(caught)
    finally:  # (told outside the recording, through the caller's own filters)
        said = set()
        for w in seen:
            text = as_the_lm(str(w.message))
            if (text, w.category) in said or "is converted for inference: the converted " \
                    "module starts in training mode" in text:
                continue
            said.add((text, w.category))
            warnings.warn_explicit(text, w.category, w.filename, w.lineno)


@contextlib.contextmanager
def _cache_holding_prompt(step: StaticCacheStep, prefill_args: tuple):
    """The step's cache filled by a float32 run of the example prompt, as it is when a decode
    step runs, then put back as it was: a decode graph captured and calibrated on an all-zero
    cache saw only the current token's key and value, so its ranges and its value check missed
    what attending to the prompt brings (a prompt token with a large value vector: every
    decode step NaN in fp16, "checked: error 0.00036")."""
    cache = list(step.buffers(recurse=False))  # (its own: state_kept's copy_ of every buffer
    saved = [t.clone() for t in cache]  # fails on a model built under inference_mode)
    try:
        with torch.no_grad(), seeded():
            step(*prefill_args)
        yield
    finally:
        with torch.no_grad():
            for t, was in zip(cache, saved):
                t.copy_(was)


def _decode_calibration(model, first: tuple, ids, max_cache_len: int) -> Optional[list]:
    """The decode graph's calibration: one token at the first free slot (``first``) and one,
    another token, at the last slot the model can take (its last position embedding, if fewer):
    one batch alone shows a single position, too small a range for the rotary angles, and its
    position input would count as constant. None (the example alone) where there is no second
    slot."""
    nxt, _, start, _ = first
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    last = min(max_cache_len, limit if isinstance(limit, int) and limit > 0 else max_cache_len) - 1
    if last <= int(start):
        return None
    other = ids[:, :1].contiguous()
    vocab = getattr(config, "vocab_size", None)
    if torch.equal(other, nxt) and isinstance(vocab, int) and vocab > 1:
        other = (nxt + 1) % vocab
    return [first, _step_args(other, last, max_cache_len)]


def convert_decoder(model: torch.nn.Module, example_ids: torch.Tensor, *, max_cache_len: int,
                    batch_size: Optional[int] = None,
                    dtype: Union[str, torch.dtype, None] = None,
                    target=None, calibration: Optional[Iterable[torch.Tensor]] = None,
                    **convert_options) -> ConvertedDecoder:
    """Convert a HuggingFace causal LM for generation with a static KV cache.

    ``example_ids`` (B, L), L >= 2: an example prompt; B is the batch the cache is built for
    (``batch_size`` overrides it; ``generate`` pads a smaller batch). ``max_cache_len``: cache
    slots, at least prompt length + new tokens of any later ``generate``. ``dtype`` (None: the
    one the cost model finds fastest on the target, as ``convert``'s default), ``target`` and
    every other option go to ``mpgraph.convert`` for both graphs, which are
    planned by the same passes: the prefill graph on the example prompt, the decode graph on
    one token after it and one at the last cache slot. ``calibration``: prompts (each a (B', L')
    tensor of token ids, L' >= 2; one of more rows than the cache's batch is taken in slices
    of it) the prefill graph is calibrated on instead of the example alone (an fp16 plan's
    ranges come from them: a few real prompts). Returns a ``ConvertedDecoder``: ``.prefill``/``.decode`` (each with its
    ``.plan``), ``.cache_plan`` (each cache tensor's planned dtype and the plan's reason),
    ``.sharing`` (what the two graphs share) and ``.generate(...)``. The model is not modified.
    """
    if in_inference_mode(locals()):  # (see outside_inference_mode)
        return outside_inference_mode(convert_decoder, locals())
    if type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod  # torch.compile's wrapper: the model it compiles is the LM
    refused = sorted(set(convert_options) & {"plan", "example_kwargs", "mode"})
    if refused:
        raise ValueError(f"convert_decoder does not take {refused}: the two graphs have their "
                         "own inputs (the prompts, and one token at each end of the cache), are "
                         "planned separately and run for inference")
    if not isinstance(example_ids, torch.Tensor) or example_ids.dim() != 2 or \
            example_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("example_ids must be a (batch, length) integer tensor of token ids")
    batch, length = example_ids.shape
    batch = batch_size or batch
    if length < 2:
        raise ValueError("the example prompt needs at least 2 tokens (the prefill graph's "
                         "length is dynamic from 2 up; one-token prompts use the decode graph)")
    if isinstance(max_cache_len, (bool, torch.Tensor)) or not hasattr(max_cache_len, "__index__"):
        # (a float failed inside transformers' masking, a 0-d tensor in torch.export)
        raise TypeError(f"max_cache_len must be an int (the cache's slots), got "
                        f"{type(max_cache_len).__name__} {max_cache_len!r}: pass int(...)")
    max_cache_len = operator.index(max_cache_len)  # (a numpy int: the int it is)
    if max_cache_len <= length:
        raise ValueError(f"max_cache_len={max_cache_len} leaves no slot after the "
                         f"{length}-token example prompt")
    if has_meta_tensors(model):  # (its static cache is built by a call of the model)
        meta = next(name for name, t in module_tensors(model) if t.device.type == "meta")
        raise ValueError(f"convert_decoder needs the materialised model: {type(model).__name__} "
                         f"has tensors on the meta device ({meta}, ...), and the static cache "
                         "is built by running it. Load its weights first (from_pretrained, or "
                         "to_empty and load_state_dict), then convert_decoder; a decoder's "
                         "load_weights replaces the weights of one converted already")
    step = StaticCacheStep(model, batch, max_cache_len)
    table = _learned_positions(model.config, model)
    if table is not None and length >= table[1]:  # (the decode graph's example: one more)
        raise ValueError(f"the {length}-token example prompt fills the model's position "
                         f"table ({table[0]}: {table[1]} positions), leaving none for a "
                         "generated token: give a shorter example prompt")
    step.training = model.training  # a new Module says "training"; the model's flag, unchanged
    if model.training:
        warnings.warn(f"{type(model).__name__} is in training mode; generation wants "
                      "model.eval() (dropout off) before convert_decoder", UserWarning,
                      stacklevel=2)
    device = next(model.parameters()).device
    prefill_args = _prefill_args(example_ids, batch, max_cache_len, device)
    ids = prefill_args[0]
    # (a prompt batch larger than the cache's is calibrated in slices of its batch: every row
    # counts; repeating rows to fill the batch had cut a larger one to its first rows)
    prompts = [_prefill_args(part, batch, max_cache_len, device) for p in calibration
               for part in _in_slices(p, batch)] if calibration is not None else None
    decode_args = _step_args(ids[:, -1:].contiguous(), length, max_cache_len)
    options = dict(convert_options, dtype=dtype, target=target)
    if "overrides" in options:
        options["overrides"] = _in_step_paths(options["overrides"], model)

    def convert_prefill(**options):
        with _decoder_fix():
            return convert(step, prefill_args, calibration=prompts, **options).eval()

    def convert_decode(**options):
        with _cache_holding_prompt(step, prefill_args), _decoder_fix():
            return convert(step, decode_args, calibration=_decode_calibration(
                model, decode_args, ids, max_cache_len), **options).eval()

    with _told_as_the_lm(model):  # (convert's warnings name the LM, not our wrapper)
        prefill, decode = convert_prefill(**options), convert_decode(**options)
        fell_back = [gm for gm in (prefill, decode)
                     if (gm.plan.dtype_choice or {}).get("fallback")]
        if dtype is None and fell_back and prefill.plan.dtype != decode.plan.dtype:
            # one graph's automatic fp16 failed its value check and fell back to bf16: the other
            # in bf16 too (the graphs share the cache, so they share its dtype)
            log.info("convert_decoder: the %s graph fell back to bfloat16 (%s): the other graph "
                     "too", "prefill" if fell_back[0] is prefill else "decode",
                     fell_back[0].plan.dtype_choice["fallback"])
            options = dict(options, dtype=torch.bfloat16)  # (and for any reconversion below)
            if fell_back[0] is prefill:
                decode = convert_decode(**options)
            else:
                prefill = convert_prefill(**options)
        names = cache_names(prefill)
        if names != cache_names(decode):
            raise ValueError(f"the two graphs have different cache buffers: {names} vs "
                             f"{cache_names(decode)}")
        prefill, decode = _agree_on_float32_cache(prefill, decode, names, options,
                                                  convert_prefill, convert_decode)
    for gm, which in ((prefill, "prefill"), (decode, "decode")):
        writes = _in_place_writes(gm, set(names))
        missing = [n for n in names if not writes.get(n)]
        if missing:
            raise ValueError(f"the {which} graph does not write the cache buffers {missing} in "
                             "place: the capture did not keep the static cache's updates")
    sharing = share_tensors(prefill, decode, must_share=tuple(names))
    plan = _cache_plan(prefill, names)
    other = _cache_plan(decode, names)
    for a, b in zip(plan, other):
        if a.dtype != b.dtype:  # share_tensors refused already; kept for a clear record
            raise ValueError(f"cache {a.name}: {a.dtype} in the prefill plan, {b.dtype} in "
                             "the decode plan")
    if sharing.unshared:  # e.g. a decode plan that keeps float32 GEMVs the prefill lowers
        log.info("convert_decoder: the two graphs keep separate copies of %d tensors "
                 "(ConvertedDecoder.sharing lists them), e.g. %s", len(sharing.unshared),
                 "; ".join(f"{n} ({w})" for n, w in sharing.unshared[:2]))
    out = ConvertedDecoder(prefill, decode, batch_size=batch, max_cache_len=max_cache_len,
                           sharing=sharing, cache_plan=plan,
                           # (copies: editing the decoder's settings must not edit the model's,
                           # nor the model's edits reach a decoder that holds its own weights)
                           config=copy.deepcopy(getattr(model, "config", None)),
                           generation_config=copy.deepcopy(getattr(model, "generation_config",
                                                                   None)))
    out.reset_cache()
    log.info("%s", out.summary())
    return out


def _in_step_paths(overrides, model):
    """``overrides`` keyed by the causal LM's own module paths (``"model.layers.0"``,
    ``"lm_head"``, as in ``model.named_modules()``) keyed as the graphs know them: they are
    captured from the StaticCacheStep, which holds the LM as ``model``. A key that names no
    module of the LM stays as given: node names, ``op:``/``class:`` keys, the step's own paths,
    and globs that match the LM's root too (``"*"`` covers the cache buffers as well)."""
    if not isinstance(overrides, dict):
        return overrides  # (convert names what is wrong with it)
    paths = [name for name, _ in model.named_modules() if name]

    def ours(key) -> bool:
        return (isinstance(key, str) and not key.startswith(("node:", "op:", "class:"))
                and not fnmatch.fnmatchcase("", key)
                and any(fnmatch.fnmatchcase(p, key) or fnmatch.fnmatchcase(p, key + ".*")
                        for p in paths))
    return {f"model.{key}" if ours(key) else key: value for key, value in overrides.items()}


def _agree_on_float32_cache(prefill, decode, names, options, convert_prefill, convert_decode):
    """The graphs share the cache, so a cache tensor one plan keeps float32 (its own tolerance
    search or error attribution pinned the tensor's writes or readers) is pinned float32 in the
    other as well, by an override of its name, and that graph converted again; until the two
    agree (a reconversion may pin another)."""
    pinned: dict = {}
    for _ in range(len(names)):
        dtypes = [{n: fetch_attr(gm, n).dtype for n in names} for gm in (prefill, decode)]
        fp32 = [n for n in names if dtypes[0][n] != dtypes[1][n]
                and torch.float32 in (dtypes[0][n], dtypes[1][n])]
        if not fp32:
            break
        log.info("convert_decoder: %s float32 in one plan only: pinned float32 in both",
                 ", ".join(fp32))
        pinned.update(dict.fromkeys(fp32, "fp32"))
        again = dict(options, overrides={**(options.get("overrides") or {}), **pinned})
        if any(dtypes[0][n] != torch.float32 for n in fp32):
            prefill = convert_prefill(**again)
        if any(dtypes[1][n] != torch.float32 for n in fp32):
            decode = convert_decode(**again)
    return prefill, decode


@dataclasses.dataclass
class GenerateOutput:
    """``sequences`` (B, L + new): the prompt and the generated tokens (finished rows padded
    with ``pad_token_id``); ``logits``: (new, B, vocab) float32, the logits each token was
    chosen from (``return_logits=True``), else None."""

    sequences: torch.Tensor
    logits: Optional[torch.Tensor] = None


@functools.lru_cache(maxsize=None)
def _rules_class():
    """transformers' own generation rules (the generation config's merge and lengths, special
    tokens, the attention mask inferred from pad ids, logits processors, stopping criteria),
    asked as the model's ``generate`` asks them: they read only ``config`` and
    ``generation_config``. (transformers is imported here: mpgraph itself does not need it.)"""
    from transformers import GenerationConfig, GenerationMixin

    class Rules(GenerationMixin):
        def __init__(self, config, generation_config):
            self.config = config
            self.generation_config = generation_config or GenerationConfig()
    return Rules


_NOT_SUPPORTED = {  # GenerationConfig field: (the value that means "off", why not)
    "num_beams": (1, "beam search keeps several hypotheses per row; the static cache holds one "
                     "sequence per row"),
    "num_return_sequences": (1, "one sequence per prompt row: repeat the prompt rows instead"),
    "penalty_alpha": (None, "contrastive search is not supported"),
    "prompt_lookup_num_tokens": (None, "prompt lookup decoding is not supported"),
    "guidance_scale": (None, "classifier-free guidance needs a second cache"),
    "token_healing": (False, "token healing rewrites the prompt with the tokenizer first"),
    "output_attentions": (False, "the converted graphs return the last position's logits only "
                                 "(return_dict_in_generate gives sequences, scores and logits)"),
    "output_hidden_states": (False, "the converted graphs return the last position's logits "
                                    "only (return_dict_in_generate gives sequences, scores and "
                                    "logits)"),
}

_DRAFTS = ("assisted generation checks a draft's tokens several at a time; the decode graph "
           "takes one token per row")
_GUIDANCE = ("classifier-free guidance runs the model on a second, negative prompt, which needs "
             "a second cache")
_OWN_CACHE = ("the decoder keeps its own static cache (decoder.cache), filled from the prompt on "
              "every call: pass the whole sequence as the prompt instead")
_REFUSED = {  # arguments of HF's generate (not GenerationConfig fields) the decoder cannot take
    "assistant_model": _DRAFTS, "assistant_tokenizer": _DRAFTS,
    "negative_prompt_ids": _GUIDANCE, "negative_prompt_attention_mask": _GUIDANCE,
    "custom_generate": "a custom decoding loop calls the HF model, not the converted graphs",
    "cache": _OWN_CACHE, "past_key_values": _OWN_CACHE,
}


def _generation_config(rules, generation_config, kwargs: dict, ids: torch.Tensor):
    """The config this call runs with, made by transformers' own steps of ``generate``: the
    given config (or a default one) with every field it leaves unset taken from the model's
    generation config, then HF's defaults, then the keyword arguments
    (``_prepare_generation_config``), and its lengths counted from the prompt
    (``_prepare_generated_length``: 20 new tokens where nothing sets a length). What the static
    cache cannot do is refused with the reason; an unknown keyword is a TypeError."""
    from transformers.generation.configuration_utils import GenerationMode
    if kwargs.get("eos_token_id") == []:
        kwargs["eos_token_id"] = None  # [] means no EOS: generate every new token
    default_max, default_min = (  # as HF's generate decides them, before the merge
        kwargs.get(name) is None and getattr(generation_config, name, None) is None
        and getattr(rules.generation_config, name, None) is None
        for name in ("max_length", "min_length"))
    config, unused = rules._prepare_generation_config(generation_config, **kwargs)
    for field, (off, why) in _NOT_SUPPORTED.items():
        value = getattr(config, field, off)
        if value is not None and value != off:
            raise ValueError(f"generate({field}={value!r}): {why}; run it with the HF model's "
                             "own generate, or set it back to " + repr(off))
    if unused:
        raise TypeError(f"generate got arguments it does not know: {sorted(unused)} (the "
                        "GenerationConfig fields and attention_mask, generation_config, "
                        "logits_processor, stopping_criteria, prefix_allowed_tokens_fn, "
                        "synced_gpus, streamer, tokenizer, generator, cuda_graph, return_logits, "
                        "forced_tokens are taken)")
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"generate: {mode.value} is not supported (greedy search and sampling "
                         "are); run it with the HF model's own generate")
    if config.do_sample and config.temperature is not None and config.temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {config.temperature}")
    return rules._prepare_generated_length(config, default_max, default_min, "input_ids",
                                           ids.shape[1], ids)


def _generate(decoder: ConvertedDecoder, input_ids: torch.Tensor,
              max_new_tokens: Optional[int] = None, *,
             attention_mask: Optional[torch.Tensor] = None, generation_config=None,
             logits_processor=None, stopping_criteria=None, prefix_allowed_tokens_fn=None,
             synced_gpus: Optional[bool] = None, streamer=None, tokenizer=None,
             generator: Optional[torch.Generator] = None, cuda_graph: Any = None,
             return_logits: bool = False, forced_tokens: Optional[torch.Tensor] = None,
             **kwargs) -> Union[torch.Tensor, GenerateOutput]:
    """Generate after ``input_ids`` (B, L) with a ``ConvertedDecoder`` as HuggingFace's
    ``model.generate`` does: one prefill call, then one decode call per token.

    The arguments are HF's: ``generation_config`` (merged with the model's own, as HF merges
    it, so its EOS, pad, lengths and penalties apply where the given one leaves them unset) and
    any of its fields as keywords (``max_new_tokens``/``max_length``, ``min_new_tokens``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``stop_strings`` (with ``tokenizer``), ``eos_token_id`` (an int
    or a list; ``[]``: none), ``pad_token_id``, ``max_time``, ``return_dict_in_generate``,
    ``output_scores``, ``output_logits``, ...), ``logits_processor`` and ``stopping_criteria``
    lists merged with the config's, ``prefix_allowed_tokens_fn``, and a ``streamer`` (``put``
    the prompt, then each token; ``end``). The processors and criteria are transformers' own,
    built by its ``GenerationMixin`` from the config, and run in the same order on the same
    float32 logits of the prompt's rows, so a converted model gives HF's tokens for its logits
    (and, sampling, HF's draws for the same seed). Beam search, contrastive and assisted
    decoding, guidance and another call's cache are refused with the reason.
    ``attention_mask`` (B, L): 0 on padding, on the left as HF pads decoder-only prompts
    (inferred from the pad id where not given, as HF does); positions count real tokens only.
    ``generator`` seeds the sampling. ``cuda_graph`` (default: on CUDA) replays the decode step
    from a CUDA graph (or a ``CudaGraphBackend``). ``forced_tokens`` (B, N): feed these tokens
    instead of the chosen ones (teacher forcing; with ``return_logits`` it scores a given
    continuation). Returns the sequences (B, L + generated), finished rows padded with the pad
    id, as HF's generate; HF's ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``
    (sequences, scores, logits; no cache: the decoder keeps its own); else a ``GenerateOutput``
    with each step's raw logits when ``return_logits``.
    """
    if not isinstance(decoder, ConvertedDecoder):
        raise TypeError("generate takes what mpgraph.convert_decoder returns, got "
                        f"{type(decoder).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, length) tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    for what, tokens in (("input_ids", input_ids), ("forced_tokens", forced_tokens)):
        if isinstance(tokens, torch.Tensor) and (
                tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool):
            # (made long below: 5.9 became token 5, where HF's embedding refuses it)
            raise ValueError(f"{what} must be an integer tensor of token ids, got "
                             f"{dtype_name(tokens.dtype)} (the tokenizer's ids, as "
                             "convert_decoder's example_ids)")
    if input_ids.shape[0] == 0:  # (a torch reduction error on the mask further down)
        raise ValueError(f"input_ids {tuple(input_ids.shape)} holds no prompt: generate takes "
                         "a batch of at least one")
    for name, why in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"generate({name}=...): {why}; run it with the HF model's own "
                             "generate")
    if synced_gpus:
        raise ValueError("generate(synced_gpus=True) keeps several processes' loops in step "
                         "(DeepSpeed ZeRO-3, FSDP); the converted decoder generates in one process")
    kwargs = {k: v for k, v in kwargs.items() if k not in _REFUSED}
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    from transformers import LogitsProcessorList, StoppingCriteriaList
    rows, length = input_ids.shape
    device = decoder.device
    ids = input_ids.to(device=device, dtype=torch.long)
    rules = _rules_class()(decoder.config, decoder.generation_config)
    config = _generation_config(rules, generation_config, kwargs, ids)
    new = config.max_length - length
    if new < 1:
        raise ValueError(f"max_length={config.max_length} leaves no new token after the "
                         f"{length}-token prompt (set max_new_tokens)")
    batch, slots = decoder.batch_size, decoder.max_cache_len
    if rows > batch:
        raise ValueError(f"batch of {rows} prompts; the decoder's cache holds {batch} (convert "
                         f"with batch_size={rows})")
    if length + new > slots:
        raise ValueError(f"{length} prompt tokens + {new} new tokens exceed the "
                         f"cache's {slots} slots (convert_decoder(..., max_cache_len=...))")
    if forced_tokens is not None and tuple(forced_tokens.shape) != (rows, new):
        raise ValueError(f"forced_tokens must be (batch, new tokens) = {(rows, new)}, got "
                         f"{tuple(forced_tokens.shape)}")
    vocab = getattr(decoder.config.get_text_config(decoder=True), "vocab_size", None)
    for what, tokens in (("input_ids", ids), ("forced_tokens", forced_tokens)):
        if isinstance(vocab, int) and tokens is not None and tokens.numel() and (
                int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
            raise ValueError(f"{what} holds token id {bad}, outside the model's vocabulary of "
                             f"{vocab} (ids 0..{vocab - 1})")  # (an IndexError inside the graph)
    rules._prepare_special_tokens(config, attention_mask is not None, device, rows)
    if attention_mask is None:  # HF's: 0 on the pad id where it is in the prompt and not EOS
        given = rules._prepare_attention_mask_for_generation(ids, config, {})
    else:
        given = attention_mask.to(device=device, dtype=torch.long)
    if given.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(given.shape)} does not match input_ids "
                         f"{tuple(ids.shape)}")
    empty = (given == 0).all(dim=1)
    if bool(empty.any()):  # (not right padding: nothing at all to generate from)
        raise ValueError(f"attention_mask masks every token of row "
                         f"{int(empty.nonzero()[0])}: that row has no prompt to generate from "
                         "(drop it from the batch, or give it at least one token)")
    if bool((given[:, -1] == 0).any()):
        raise ValueError(("attention_mask has" if attention_mask is not None else
                          "input_ids end in the pad id, so the inferred attention_mask has")
                         + " padding on the right: pad prompts on the left "
                         "(tokenizer.padding_side = 'left') for generation")
    table = _position_table(decoder) if length + new > 1 else None
    real = int(given.sum(dim=1).max())  # positions count real tokens: left padding takes none
    if table is not None and real + new > table[1]:
        raise ValueError(f"{real} prompt tokens + {new} new tokens exceed the model's "
                         f"position table ({table[0]}: {table[1]} positions; positions past it "
                         "do not exist, as in HF's generate): generate fewer tokens")
    # the processors and criteria see the prompt's rows only, as HF's; the graphs take the
    # cache's batch: a smaller one is filled with copies of the first row, dropped at the end
    processors = rules._get_logits_processor(
        config, input_ids_seq_length=length, encoder_input_ids=ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor or LogitsProcessorList(), device=device,
        model_kwargs={"attention_mask": given})
    criteria = rules._get_stopping_criteria(
        config, stopping_criteria or StoppingCriteriaList(), tokenizer=tokenizer)
    fill = torch.cat([torch.arange(rows, device=device),
                      torch.zeros(batch - rows, dtype=torch.long, device=device)])
    pad = config._pad_token_tensor
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    step_fn = decoder.graphed_decode() if cuda_graph is True else \
        decoder.graphed_decode(cuda_graph) if cuda_graph else decoder.decode

    mask = torch.zeros(batch, slots, dtype=torch.long, device=device)
    mask[:, :length] = given[fill]
    positions = (mask[:, :length].cumsum(-1) - 1).masked_fill(mask[:, :length] == 0, 0)
    next_pos = positions[:, -1:] + 1                                    # (batch, 1)
    # HF's return_dict_in_generate: its output object, with each step's processed scores
    # (output_scores) and raw logits (output_logits), as tuples of (B, vocab)
    as_dict = bool(config.return_dict_in_generate)
    kept = [] if return_logits or (as_dict and config.output_logits) else None
    kept_scores = [] if as_dict and config.output_scores else None
    forced = None if forced_tokens is None else forced_tokens.to(device=device, dtype=torch.long)
    unfinished = torch.ones(rows, dtype=torch.bool, device=device)
    if streamer is not None:
        streamer.put(ids.cpu())
    decoder.reset_cache()
    with torch.no_grad():
        start = torch.zeros(1, dtype=torch.long, device=device)
        logits = (decoder.prefill if length >= 2 else step_fn)(ids[fill], positions, start, mask)
        cache_position = torch.full((1,), length, dtype=torch.long, device=device)
        for i in range(new):
            # as HF: float32 logits of the prompt's rows (a copy: the next step overwrites them)
            logits = logits[:rows].to(dtype=torch.float32, copy=True)
            if kept is not None:
                kept.append(logits.clone())
            scores = processors(ids, logits)
            if kept_scores is not None:
                kept_scores.append(scores.clone())
            if forced is not None:
                token = forced[:, i]
            elif config.do_sample:
                token = torch.multinomial(scores.softmax(dim=-1), 1,
                                          generator=generator).squeeze(-1)
            else:
                token = scores.argmax(dim=-1)
            if pad is not None:
                token = torch.where(unfinished, token, pad)
            ids = torch.cat([ids, token[:, None]], dim=1)
            if streamer is not None:
                streamer.put(token.cpu())
            unfinished &= ~criteria(ids, scores)
            if not bool(unfinished.any()):
                break
            mask[:, length + i] = 1
            logits = step_fn(token[fill, None], next_pos, cache_position, mask)
            next_pos += 1
            cache_position += 1
    if streamer is not None:
        streamer.end()
    if as_dict:
        from transformers.generation.utils import GenerateDecoderOnlyOutput
        return GenerateDecoderOnlyOutput(
            sequences=ids,
            scores=tuple(kept_scores) if kept_scores is not None else None,
            logits=tuple(kept) if kept is not None else None)
    if return_logits:
        return GenerateOutput(ids, torch.stack(kept))
    return ids


# the decoders generating now: one has one static cache, which a second call while the first
# runs (another thread, a streamer or processor calling generate) would overwrite under it
_BUSY: "weakref.WeakKeyDictionary[torch.nn.Module, threading.Lock]" = weakref.WeakKeyDictionary()
_BUSY_LOCK = threading.Lock()


@functools.wraps(_generate)
def generate(decoder, *args, **kwargs):
    if not isinstance(decoder, ConvertedDecoder):
        return _generate(decoder, *args, **kwargs)  # (its TypeError)
    with _BUSY_LOCK:  # (by its graphs, which hold the cache: a copy.copy shares them)
        busy = _BUSY.setdefault(decoder.prefill, threading.Lock())
    if not busy.acquire(blocking=False):
        raise RuntimeError(
            "this decoder is already generating (in another thread, or a streamer, logits "
            "processor or stopping criterion called generate during a generate): it has one "
            "static KV cache, which a second call would overwrite under the first (wrong tokens, "
            "silently). Convert one decoder per thread (mpgraph.convert_decoder), or call "
            "generate after the first returns")
    try:
        on = [d for d in autocasting() if d == decoder.device.type]
        if not on:
            return _generate(decoder, *args, **kwargs)
        if not getattr(decoder, "_said_autocast", False):
            decoder._said_autocast = True
            dtypes = ", ".join(f"torch.autocast({d!r}, dtype={torch.get_autocast_dtype(d)})"
                               for d in on)
            warnings.warn(
                f"generate was called inside {dtypes}: a converted decoder decides its own "
                "precision (its plans put each node low or in float32), so it generates with "
                "autocast off. Call it outside torch.autocast", UserWarning,
                stacklevel=caller_outside(os.path.dirname(os.path.dirname(__file__))))
        with torch.autocast(on[0], enabled=False):  # (its graphs then say nothing of it)
            return _generate(decoder, *args, **kwargs)
    finally:
        busy.release()
