"""Text generation with a converted decoder: ``mpgraph.convert_decoder`` and ``mpgraph.generate``.

A HuggingFace causal LM is converted twice, through the same passes: a *prefill* graph (the
prompt, any length from 2 up, cache slots 0..L-1) and a one-token *decode* graph (cache slot
t). Both wrap the model around one ``transformers.StaticCache`` whose key and value tensors are
buffers of the wrapper (``key_cache_<i>``, ``value_cache_<i>``), so torch.export sees them as
buffers written in place (``index_copy_`` into the buffer, no new tensor per step) and each plan
records their dtype as it records any value's (``ConvertedDecoder.cache_plan``: the dtype and the
plan's reason; today's AssignPrecision keeps a buffer written in place in its own dtype, so the
cache is float32, as the model's). After conversion the decode graph's parameters, buffers and cache are pointed at the
prefill graph's tensors wherever both plans stored the same name with the same shape and dtype:
weights are stored once, and the cache both graphs read and write is one set of tensors
(``ConvertedDecoder.sharing`` counts what is shared and what is not).

``generate`` runs the prefill graph once, then the decode graph per new token (greedy or
sampling; per-sequence EOS; batch > 1 with left padding through ``attention_mask``); on CUDA the
decode step is replayed from a CUDA graph (``mpgraph.cuda_graph``), since every decode call has
the same shapes and reads the cache at the same addresses.

Limits: the batch size and the cache length are fixed at conversion (a smaller batch is padded
with copies of its first row; ``prompt length + max_new_tokens`` must fit the cache); the prompt
is prefilled in one call (a one-token prompt goes through the decode graph); models whose cache
has sliding-window or other non-static layers are refused; the converted graphs are tied to the
device they were converted on (export bakes it into the graph's constants).
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from typing import Any, Optional, Union

import torch

from mpgraph.ir.graph import fetch_attr, set_attr
from mpgraph.ir.meta import dtype_name

log = logging.getLogger(__name__)

KEY, VALUE, LENGTH = "key_cache_", "value_cache_", "cumulative_length_"


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
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
        from transformers.configuration_utils import get_head_shapes
        config = getattr(model, "config", None)
        if config is None:
            raise TypeError(f"expected a HuggingFace causal LM (with .config), got "
                            f"{type(model).__name__}")
        params = inspect.signature(model.forward).parameters
        if "cache" not in params:
            raise TypeError(f"{type(model).__name__}.forward takes no `cache` argument: not a "
                            "transformers 5 causal LM with a KV cache")
        self.model = model
        self._logits_to_keep = "logits_to_keep" in params
        param = next(model.parameters())
        dtype = dtype or param.dtype
        device = torch.device(device) if device is not None else param.device
        text = config.get_text_config(decoder=True)
        self.cache = StaticCache(config=text, max_cache_len=max_cache_len)
        kinds = {type(layer).__name__ for layer in self.cache.layers
                 if type(layer) is not StaticLayer}
        if kinds:
            raise ValueError(f"{type(model).__name__}'s cache has {sorted(kinds)} layers; "
                             "convert_decoder supports full-attention StaticLayer caches only")
        heads, head_dim = get_head_shapes(text)
        self.cache.early_initialization(batch_size, heads, head_dim, dtype, device)
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"{KEY}{i}", layer.keys, persistent=False)
            self.register_buffer(f"{VALUE}{i}", layer.values, persistent=False)
            self.register_buffer(f"{LENGTH}{i}", layer.cumulative_length, persistent=False)
        self.batch_size, self.max_cache_len = batch_size, max_cache_len

    def forward(self, input_ids, position_ids, cache_position, attention_mask):
        for i, layer in enumerate(self.cache.layers):
            layer.keys = getattr(self, f"{KEY}{i}")
            layer.values = getattr(self, f"{VALUE}{i}")
            layer.cumulative_length = getattr(self, f"{LENGTH}{i}")
            layer.cumulative_length.copy_(cache_position[0])
        extra = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=self.cache, use_cache=True, **extra)
        return out.logits[:, -1]


def cache_names(module: torch.nn.Module) -> list[str]:
    """The cache tensors' attribute names of a converted step (key_cache_0, value_cache_0, ...)."""
    names = [n for n, _ in module.named_buffers() if n.startswith((KEY, VALUE))]
    return sorted(names, key=lambda n: (int(n.rsplit("_", 1)[1]), not n.startswith(KEY)))


@dataclasses.dataclass
class Sharing:
    """What the decode graph shares with the prefill graph (tensors by attribute name)."""

    shared: list                  # names pointed at the prefill graph's tensor
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


def share_tensors(prefill: torch.nn.Module, decode: torch.nn.Module,
                  must_share: tuple = ()) -> Sharing:
    """Point ``decode``'s tensors at ``prefill``'s where both have the name with the same shape
    and dtype (and, for parameters, neither needs grad). ``must_share``: names that must be
    shared (the cache): a difference there is a ValueError."""
    ours, theirs = _tensors(prefill), _tensors(decode)
    separate = _storage_bytes(list(ours.values()))[1] + _storage_bytes(list(theirs.values()))[1]
    shared, unshared, saved = [], [], 0
    for name, t in theirs.items():
        src = ours.get(name)
        why = None
        if src is None:
            why = "only in the decode graph"
        elif src.shape != t.shape:
            why = f"shape {tuple(t.shape)} vs the prefill graph's {tuple(src.shape)}"
        elif src.dtype != t.dtype:
            why = (f"the decode plan stores it as {dtype_name(t.dtype)}, the prefill plan as "
                   f"{dtype_name(src.dtype)}")
        elif src.device != t.device:
            why = f"on {t.device}, the prefill graph's on {src.device}"
        if why is None:
            if src is not t:
                saved += t.untyped_storage().nbytes() if t.untyped_storage().data_ptr() != \
                    src.untyped_storage().data_ptr() else 0
                set_attr(decode, name, src)
            shared.append(name)
        else:
            if name in must_share:
                raise ValueError(f"the cache tensor {name} cannot be shared between the prefill "
                                 f"and decode graphs: {why}")
            unshared.append((name, why))
    for name in ours:
        if name not in theirs:
            unshared.append((name, "only in the prefill graph"))
    count, stored = _storage_bytes(list(ours.values()) + list(_tensors(decode).values()))
    return Sharing(shared, unshared, saved, stored, separate, count)


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
            from mpgraph.tools.cuda_graph import GraphedModule
            self._graphed = GraphedModule(self.decode, static_outputs=True, max_graphs=2,
                                          backend=backend)
        return self._graphed

    def generate(self, input_ids, max_new_tokens: int, **options):
        """``mpgraph.generate(self, input_ids, max_new_tokens, **options)``."""
        return generate(self, input_ids, max_new_tokens, **options)

    def summary(self) -> str:
        cache = ", ".join(sorted({f"{r.dtype} ({r.reason})" for r in self.cache_plan}))
        return (f"prefill: {self.prefill.plan.summary()}\ndecode: {self.decode.plan.summary()}\n"
                f"cache: {len(self.cache_plan)} tensors of {self.cache_plan[0].shape} "
                f"(batch {self.batch_size}, {self.max_cache_len} slots) in {cache}\n"
                f"sharing: {self.sharing}")

    def __repr__(self) -> str:
        return (f"ConvertedDecoder(batch_size={self.batch_size}, max_cache_len="
                f"{self.max_cache_len}, dtype={dtype_name(self.prefill.plan.dtype)}, "
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
    from mpgraph.ir.graph import is_inplace
    nodes = {n.target: n for n in module.graph.nodes if n.op == "get_attr" and n.target in names}
    return {name: [u.name for u in node.users if is_inplace(u, module) and u.args[0] is node]
            for name, node in nodes.items()}


def convert_decoder(model: torch.nn.Module, example_ids: torch.Tensor, *, max_cache_len: int,
                    batch_size: Optional[int] = None,
                    dtype: Union[str, torch.dtype] = torch.float16,
                    target=None, **convert_options) -> ConvertedDecoder:
    """Convert a HuggingFace causal LM for generation with a static KV cache.

    ``example_ids`` (B, L), L >= 2: an example prompt; B is the batch the cache is built for
    (``batch_size`` overrides it; ``generate`` pads a smaller batch). ``max_cache_len``: cache
    slots, at least prompt length + new tokens of any later ``generate``. ``dtype``,
    ``target`` and every other option go to ``mpgraph.convert`` for both graphs, which are
    planned by the same passes: the prefill graph on the example prompt, the decode graph on
    one token after it. Returns a ``ConvertedDecoder``: ``.prefill``/``.decode`` (each with its
    ``.plan``), ``.cache_plan`` (each cache tensor's planned dtype and the plan's reason),
    ``.sharing`` (what the two graphs share) and ``.generate(...)``. The model is not modified.
    """
    from mpgraph.api import convert
    refused = sorted(set(convert_options) & {"calibration", "plan", "example_kwargs", "mode"})
    if refused:
        raise ValueError(f"convert_decoder does not take {refused}: the two graphs have their "
                         "own inputs (calibrated on the example prompt and one token after it), "
                         "are planned separately and run for inference")
    if not isinstance(example_ids, torch.Tensor) or example_ids.dim() != 2 or \
            example_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("example_ids must be a (batch, length) integer tensor of token ids")
    batch, length = example_ids.shape
    batch = batch_size or batch
    if length < 2:
        raise ValueError("the example prompt needs at least 2 tokens (the prefill graph's "
                         "length is dynamic from 2 up; one-token prompts use the decode graph)")
    if max_cache_len <= length:
        raise ValueError(f"max_cache_len={max_cache_len} leaves no slot after the "
                         f"{length}-token example prompt")
    step = StaticCacheStep(model, batch, max_cache_len)
    step.training = model.training  # a new Module says "training"; the model's flag, unchanged
    if model.training:
        warnings.warn(f"{type(model).__name__} is in training mode; generation wants "
                      "model.eval() (dropout off) before convert_decoder", UserWarning,
                      stacklevel=2)
    device = next(model.parameters()).device
    ids = example_ids.to(device=device, dtype=torch.long)
    if ids.shape[0] != batch:
        ids = ids[torch.arange(batch, device=device) % ids.shape[0]]
    mask = torch.zeros(batch, max_cache_len, dtype=torch.long, device=device)
    mask[:, :length + 1] = 1
    positions = torch.arange(length + 1, device=device).expand(batch, -1)
    prefill_args = (ids, positions[:, :length].contiguous(),
                    torch.zeros(1, dtype=torch.long, device=device), mask)
    nxt = ids[:, -1:].contiguous()
    decode_args = (nxt, positions[:, length:].contiguous(),
                   torch.full((1,), length, dtype=torch.long, device=device), mask)
    options = dict(convert_options, dtype=dtype, target=target)
    prefill = convert(step, prefill_args, **options).eval()
    decode = convert(step, decode_args, **options).eval()
    names = cache_names(prefill)
    if names != cache_names(decode):
        raise ValueError(f"the two graphs have different cache buffers: {names} vs "
                         f"{cache_names(decode)}")
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
    if sharing.unshared:
        log.warning("convert_decoder: the two graphs keep separate copies of %d tensors: %s",
                    len(sharing.unshared), "; ".join(f"{n} ({w})" for n, w in sharing.unshared))
    out = ConvertedDecoder(prefill, decode, batch_size=batch, max_cache_len=max_cache_len,
                           sharing=sharing, cache_plan=plan, config=getattr(model, "config", None),
                           generation_config=getattr(model, "generation_config", None))
    out.reset_cache()
    log.info("%s", out.summary())
    return out


@dataclasses.dataclass
class GenerateOutput:
    """``sequences`` (B, L + new): the prompt and the generated tokens (finished rows padded
    with ``pad_token_id``); ``logits``: (new, B, vocab) float32, the logits each token was
    chosen from (``output_logits=True``), else None."""

    sequences: torch.Tensor
    logits: Optional[torch.Tensor] = None


def _choose(logits, do_sample, temperature, top_k, top_p, generator):
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, index = torch.sort(scores, descending=True, dim=-1)
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - ordered.softmax(dim=-1) > top_p   # keep the smallest set reaching top_p
        scores = scores.masked_fill(drop.scatter(-1, index, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(decoder: ConvertedDecoder, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: Optional[torch.Tensor] = None, eos_token_id=None,
             pad_token_id: Optional[int] = None, do_sample: bool = False,
             temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             generator: Optional[torch.Generator] = None, cuda_graph: Any = None,
             output_logits: bool = False, forced_tokens: Optional[torch.Tensor] = None,
             ) -> Union[torch.Tensor, GenerateOutput]:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (B, L) with a
    ``ConvertedDecoder``: one prefill call, then one decode call per token.

    ``attention_mask`` (B, L): 0 on padding, which must be on the left (as HuggingFace pads
    decoder-only prompts for generation); positions count real tokens only, as HF's generate
    does. Greedy by default; ``do_sample=True`` samples from ``softmax(logits / temperature)``,
    optionally restricted to the ``top_k`` tokens and the ``top_p`` nucleus, drawing from
    ``generator`` (seed it for reproducible samples). ``eos_token_id`` (an int or a list; by
    default the model's generation config's, as HuggingFace's generate): a row that produced it
    is finished and gets ``pad_token_id`` (the config's, else the first EOS id) from then on;
    generation stops when every row is finished. ``cuda_graph`` (default: on CUDA):
    replay the decode step from a CUDA graph (or a ``CudaGraphBackend`` to replay with).
    ``forced_tokens`` (B, N): feed these tokens instead of the chosen ones (teacher forcing;
    with ``output_logits`` it scores a given continuation). Returns the sequences
    (B, L + generated), like HF's generate, or a ``GenerateOutput`` with the per-step logits
    when ``output_logits``.
    """
    if not isinstance(decoder, ConvertedDecoder):
        raise TypeError("generate takes what mpgraph.convert_decoder returns, got "
                        f"{type(decoder).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    rows, length = input_ids.shape
    batch, slots = decoder.batch_size, decoder.max_cache_len
    if rows > batch:
        raise ValueError(f"batch of {rows} prompts; the decoder's cache holds {batch} (convert "
                         f"with batch_size={rows})")
    if length + max_new_tokens > slots:
        raise ValueError(f"{length} prompt tokens + {max_new_tokens} new tokens exceed the "
                         f"cache's {slots} slots (convert_decoder(..., max_cache_len=...))")
    if forced_tokens is not None and tuple(forced_tokens.shape) != (rows, max_new_tokens):
        raise ValueError(f"forced_tokens must be (batch, max_new_tokens) = "
                         f"{(rows, max_new_tokens)}, got {tuple(forced_tokens.shape)}")
    device = decoder.device
    defaults = decoder.generation_config or decoder.config
    if eos_token_id is None:  # the model's own, as HuggingFace's generate takes it
        eos_token_id = getattr(defaults, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(defaults, "pad_token_id", None)
    eos = [] if eos_token_id is None else \
        ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    ids = input_ids.to(device=device, dtype=torch.long)
    given = torch.ones_like(ids) if attention_mask is None else \
        attention_mask.to(device=device, dtype=torch.long)
    if given.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(given.shape)} does not match input_ids "
                         f"{tuple(ids.shape)}")
    if bool((given[:, -1] == 0).any()):
        raise ValueError("attention_mask has padding on the right: pad prompts on the left "
                         "(tokenizer.padding_side = 'left') for generation")
    if rows < batch:  # fill the cache's batch with copies of the first row, dropped at the end
        fill = torch.cat([torch.arange(rows, device=device),
                          torch.zeros(batch - rows, dtype=torch.long, device=device)])
        ids, given = ids[fill], given[fill]
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    step_fn = decoder.graphed_decode() if cuda_graph is True else \
        decoder.graphed_decode(cuda_graph) if cuda_graph else decoder.decode

    mask = torch.zeros(batch, slots, dtype=torch.long, device=device)
    mask[:, :length] = given
    positions = (given.cumsum(-1) - 1).masked_fill(given == 0, 0)
    next_pos = positions[:, -1:] + 1                                    # (B, 1)
    eos_t = torch.tensor(eos, device=device, dtype=torch.long) if eos else None
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    out = torch.full((batch, max_new_tokens), pad, dtype=torch.long, device=device)
    kept = [] if output_logits else None
    forced = None if forced_tokens is None else forced_tokens.to(device=device, dtype=torch.long)
    if forced is not None and rows < batch:
        forced = forced[fill]
    decoder.reset_cache()
    produced = 0
    with torch.no_grad():
        if length >= 2:
            logits = decoder.prefill(ids, positions, torch.zeros(1, dtype=torch.long,
                                                                 device=device), mask)
        else:
            logits = step_fn(ids, positions, torch.zeros(1, dtype=torch.long, device=device), mask)
        cache_position = torch.full((1,), length, dtype=torch.long, device=device)
        for i in range(max_new_tokens):
            if kept is not None:
                kept.append(logits.float().clone())
            token = forced[:, i] if forced is not None else \
                _choose(logits, do_sample, temperature, top_k, top_p, generator)
            if eos_t is not None:
                token = torch.where(done, torch.full_like(token, pad), token)
                done = done | torch.isin(token, eos_t)
            out[:, i] = token
            produced = i + 1
            if produced == max_new_tokens or (eos_t is not None and bool(done[:rows].all())):
                break
            mask[:, length + i] = 1
            logits = step_fn(token[:, None], next_pos, cache_position, mask)
            next_pos += 1
            cache_position += 1
    sequences = torch.cat([ids, out[:, :produced]], dim=1)[:rows]
    if output_logits:
        return GenerateOutput(sequences, torch.stack(kept)[:, :rows])
    return sequences
