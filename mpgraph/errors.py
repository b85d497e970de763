"""Exceptions raised by mpgraph. Each says what went wrong and what to do about it."""
from __future__ import annotations

import re


class MpgraphError(Exception):
    """Base class for every error mpgraph raises on purpose."""


# What a tracer's report says -> what to do about it (the causes users meet most)
KV_CACHE_FIX = ("the model returns a KV cache object (a HuggingFace model with use_cache=True): "
                "for generation with a KV cache use mpgraph.convert_decoder(model, prompt_ids, "
                "max_cache_len=...); to convert the forward alone, pass use_cache=False (in "
                "example_kwargs, or on the config its decoder reads: model.config.use_cache = "
                "False, a composite model's model.config.get_text_config(decoder=True).use_cache"
                " = False)")
# the same, where use_cache=False was given (it repeated "pass use_cache=False")
BUILT_CACHE_FIX = ("the model returns a cache object though use_cache=False was given (in the "
                   "call or its config): it builds "
                   "one itself (peft's prefix or prompt tuning passes its virtual tokens as "
                   "past_key_values), which no tracer takes as an output: convert the model "
                   "without that adapter (peft: model.get_base_model() holds LoRA-style "
                   "layers), or call it from a forward of your own that returns the logits alone")
# a cache object given as an input (past_key_values=): export's "Unsupported input type
# <class '...DynamicCache'>" said DynamicCache too, and was told the output's fix (or, with
# use_cache=False, BUILT_CACHE_FIX's peft adapter)
INPUT_CACHE_FIX = ("the model is given a KV cache object (past_key_values=, cache=) as an input, "
                   "which no tracer takes: a converted graph computes the whole sequence "
                   "(convert runs a HuggingFace decoder with use_cache=False); for generation "
                   "with a KV cache use mpgraph.convert_decoder(model, prompt_ids, "
                   "max_cache_len=...)")

# a tensor's value turned into a Python number (`int(t)`, a length to slice with): .item() is
# what the graph keeps, torch.cond is no way out for it
VALUE_AS_NUMBER_FIX = (
    "the code at the line named above turns a tensor's value into a Python number (`int(t)`, "
    "`float(t)`), which no tracer keeps in its graph: write `t.item()` instead (`T = "
    "lengths.max().item()`), which the graph computes on each call; where torch.export then "
    "asks about its range, state it, `torch._check(T >= 0)`. A branch on the value needs "
    "torch.cond(pred, true_fn, false_fn, (x,))")
VALUE_BRANCH_FIX = (
    "the code at the line named above reads a tensor's value in Python (a branch on it, `if "
    "x.sum() > 0:`, `if t.item() > 0:`), which no tracer captures as one graph. Write a "
    "branch with torch.cond(pred, true_fn, false_fn, (x,)), make the value static (a Python "
    "bool argument, a shape, a module attribute), or keep that submodule out of the graph: "
    "convert the parts before and after it and call them from your own forward")

# accelerate's prepare(model) with mixed precision: model.forward =
# convert_outputs_to_fp32(autocast(...)(model.forward)), a wrapper deepcopy shares
REPLACED_FORWARD_FIX = (
    "convert a module whose class's forward computes what you want: for accelerate's mixed-"
    "precision wrapper, accelerator.unwrap_model(model, keep_fp32_wrapper=False) (mpgraph "
    "chooses the precision itself and returns float32 outputs, keep_io_types=True); for a "
    "wrapper of your own, a module whose forward calls the model and does what the wrapper "
    "adds; del model.forward converts the class's forward without the wrapper")


def replaced_forward(model, reads: str) -> str | None:
    """The report for a ``forward`` set on the instance (a wrapper around the model's bound
    method), naming the wrappers, or None. deepcopy shares functions, so the copy's forward
    still ran the user's model, and the error blamed a global name."""
    forward = vars(model).get("forward")
    if forward is None:
        return None
    chain, fn = [], forward
    while fn is not None and len(chain) < 8:
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        chain.append(getattr(code, "co_qualname", None) or getattr(fn, "__qualname__", None)
                     or type(fn).__name__)
        fn = getattr(fn, "__wrapped__", None)
    accelerate = any("autocast" in c or "convert_outputs_to_fp32" in c for c in chain)
    return (f"the forward is replaced on the instance by {' wrapping '.join(chain)} (model.forward "
            "= wrapper(model.forward)" + (", as accelerate's prepare does with mixed precision: "
                                          "autocast and convert_outputs_to_fp32" if accelerate
                                          else "") +
            "), which the copy mpgraph converts shares: "
            f"it runs the {type(model).__name__} you passed and reads {reads} of it")


CAPTURE_FIXES = (
    (("a write through .data is not an op",),
     "write the buffer in place, which the graph records: self.ema.copy_(new value) (under "
     "torch.no_grad() where it is computed from activations), or assign it (self.ema = new "
     "value)"),
    (("torch.export takes tensors, Python numbers, strings and None",),
     "the report names the argument and how to pass it: torch.export traces the model with "
     "tensors and plain Python values only"),
    # (a cache class's is the KV cache's fix below, not this one)
    (re.compile(r"(?<!Cache'>) in output, which is not a known type"),
     "register the output's class before converting, torch.export.register_dataclass(Out) for a "
     "dataclass (torch.utils._pytree.register_pytree_node for another class), or return a "
     "tuple or dict"),
    (("grows it once, on its first call",),
     "build the buffer at its largest size in __init__ (the longest length the model takes), "
     "or run the model once at that length before converting; the forward then only reads a "
     "slice of it, self.pe[:T]"),
    (("a graph writes a buffer back in its shape",),
     "allocate the buffer at its largest size once and write each call's part in place, with "
     "the position as an input: self.kc.index_copy_(1, pos, k) or self.kc[:, pos] = k (a "
     "HuggingFace decoder: mpgraph.convert_decoder)"),
    (("is wrapped by torch.distributed",),
     "convert the unwrapped model (ddp.module, or the model before fully_shard), then wrap the "
     "converted module: DistributedDataParallel(converted) or fully_shard(converted), on every "
     "rank (README, torch.distributed)"),
    (("calls torch.autograd.grad",),
     "convert the network the forward differentiates (mpgraph.convert(model.net, ...)) and take "
     "the gradient outside the converted graph: in your own forward, around the converted "
     "module, torch.autograd.grad runs through it"),
    (("that its graph never reads",),
     "keep such a template out of the module's tensors (hold it in a plain list: "
     "functional_call takes it from there), or materialise it (to_empty(device=...))"),
    (("calls torch.vmap",),
     "convert the member model (mpgraph.convert(members[0], ...), one plan for all: plan=) and "
     "run the ensemble over the converted members in your own forward, or vmap outside the "
     "converted graph"),
    (("no module call is left to run it on",),
     "a training conversion computes the whole forward as ATen ops, with no submodule call for a "
     "backward hook to run on: remove the hook before converting (handle.remove()), register "
     "it on the model itself (the model's own backward hooks are kept on the converted "
     "module), or keep that submodule out of the converted graph (convert the parts before "
     "and after it and call it, hooked, from your own forward)"),
    # torch.export on int(t) / float(t): a guard on a bare symbol ("expression zuf0"; a branch's
    # is a comparison, "Eq(u0, 1)", "u0 > 1.5"); torch.fx: "float() argument must be ... 'Proxy'"
    (re.compile(r"Could not extract specialized integer|data-dependent expression [a-z]+\d+ \("
                r"|(?:int|float)\(\) argument must be .* not 'Proxy'"), VALUE_AS_NUMBER_FIX),
    (("cannot be used as inputs to control flow", "data-dependent", "DataDependent"),
     VALUE_BRANCH_FIX),
    (re.compile(r"Unsupported input type <class '[\w.]*Cache'>"), INPUT_CACHE_FIX),
    (("DynamicCache", "Cache in output", "Cache'> in output", "past_key_values"), KV_CACHE_FIX),
    (("is replaced on the instance",), REPLACED_FORWARD_FIX),
    (("not of the copy mpgraph converts",),
     "reach them through the module the forward runs on: a method, a lambda over self stored on "
     "the module (directly or in a list, dict, functools.partial or object it holds), or the "
     "module argument of a hook (lambda module, inputs, output: module.head(output))"),
    (("must be deep-copyable",),
     "make copy.deepcopy(model) work (mpgraph converts a copy, so that your model is never "
     "modified): a tensor attribute computed with autograd, compute it under torch.no_grad() or "
     "register it as a buffer; a file, lock or process a module holds, keep it outside the model"),
    (("missing a required argument", "missing 1 required positional argument",
      "got an unexpected keyword argument"),
     "the example inputs do not bind to the forward's parameters: a tuple is taken as positional "
     "arguments and a dict as keyword arguments, so a forward that takes one dict (a batch) is "
     "given it as (batch,)"),
)
# The line a report says it was raised at -> what to do (torch.nn's own code the user cannot edit)
SOURCE_FIXES = (
    (("float(self.num_batches_tracked)",),
     "a BatchNorm with momentum=None (a cumulative average: 1 / batches seen) reads its batch "
     "counter's value in Python in training mode, which no tracer captures; give it a momentum "
     "(BatchNorm(..., momentum=0.1): an exponential average), or keep that BatchNorm out of "
     "the converted graph (convert the parts before and after it)"),
)
# convert_decoder's graphs: what GENERAL_FIX says of convert's (converting the parts around the
# construct) does not apply to a decoder's generation step
DECODER_FIX = ("convert_decoder traces the model's own forward on a static KV cache (a prefill of "
               "any prompt length, and one decode step), and this model's forward could not be "
               "traced so: generate with the HF model's own generate (mpgraph.convert of it for "
               "a fixed-shape forward without a cache still applies)")
# when no known cause matches: what always works
GENERAL_FIX = ("keep the construct out of the converted graph: convert the submodules before and "
               "after it (mpgraph.convert(model.encoder, ...)) and call them from your own forward")

# the report of the model's own forward, when it fails on the example inputs too (capture.EAGER)
EAGER = "the model itself"
EAGER_FIX = ("the model's own forward fails on these example inputs, before any tracer: give "
             "inputs it takes (the shapes and dtypes model(*example_inputs) runs with); the "
             "line above is where it fails")


def _says(text: str, words) -> bool:
    """Whether a report says one of ``words`` (or matches the pattern ``words``)."""
    return bool(words.search(text)) if isinstance(words, re.Pattern) else any(w in text for w in words)


class CaptureError(MpgraphError):
    """Neither torch.fx.symbolic_trace nor torch.export could capture the model.

    ``reports`` maps each tracer's name to what it said, so the user sees both; ``fixes`` says
    what to do where the reports name a known cause.
    """

    def __init__(self, reports: dict[str, str]):
        self.reports = dict(reports)
        lines = ["could not capture the model's graph:"]
        for tracer, message in self.reports.items():
            lines.append(f"  {tracer}: {message}")
        if "torch.export" not in self.reports and "torch.fx.symbolic_trace" in self.reports:
            lines.append("  (pass example_inputs so that torch.export can be tried)")
        # the fix for what stopped torch.export, the tracer that takes the most: symbolic_trace
        # fails on much that export captures (its "control flow" is not the cause then)
        text = self.reports.get("torch.export") or " ".join(self.reports.values())
        # (not the model's source line a report quotes: "past_key_values" in an HF forward's
        # line is not a cache object returned)
        text = "\n".join(line for line in text.splitlines()
                         if not line.strip().startswith("raised at "))
        sources = "\n".join(line for line in (self.reports.get("torch.export") or "").splitlines()
                            if line.strip().startswith("raised at "))
        if EAGER in self.reports:  # the model's own forward failed: its report says why
            eager = self.reports[EAGER]
            self.fixes = [fix for words, fix in CAPTURE_FIXES if _says(eager, words)] \
                or [EAGER_FIX]
        else:
            self.fixes = [fix for words, fix in SOURCE_FIXES if any(w in sources for w in words)] \
                or [fix for words, fix in CAPTURE_FIXES if _says(text, words)] \
                or [GENERAL_FIX]
            if VALUE_AS_NUMBER_FIX in self.fixes:  # (its report says "data-dependent" too)
                self.fixes = [fix for fix in self.fixes if fix != VALUE_BRANCH_FIX]
            if INPUT_CACHE_FIX in self.fixes:  # (its report names the cache class too)
                self.fixes = [fix for fix in self.fixes if fix != KV_CACHE_FIX]
        lines += [f"fix: {fix}" for fix in self.fixes]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # (pickles and copies with its reports)
        return type(self), (self.reports,)

    def retold(self, old: str, new: str) -> "CaptureError":
        """The fix ``old`` said as ``new`` (what the reports cannot know: the call's arguments)."""
        if old in self.fixes:
            self.fixes = [new if fix == old else fix for fix in self.fixes]
            self.args = (self.args[0].replace(f"fix: {old}", f"fix: {new}"),)
        return self


class PassError(MpgraphError):
    """A pass failed. Names the pass, the node if known, and the passes that ran before."""

    def __init__(self, pass_name: str, message: str, node=None, ran_before: list[str] | None = None):
        self.pass_name = pass_name
        self.message = message
        self.node = node
        self.ran_before = list(ran_before or [])
        super().__init__(message)

    def __reduce__(self):  # (pickles and copies with its fields; the node does not travel)
        return type(self), (self.pass_name, self.message, None, self.ran_before)

    def __str__(self) -> str:
        text = f"pass {self.pass_name} failed: {self.message}"
        if self.node is not None:
            text += f"\n  at node: {self.node.format_node()}"
        if self.ran_before:
            text += f"\n  passes run before it: {', '.join(self.ran_before)}"
        return text


class InputMismatchError(MpgraphError, ValueError):
    """A call's inputs break a condition the converted graph was captured under (a shape it was
    specialised to, a branch of the model's Python code taken at capture); says which, and the
    way out."""


class WeightOverflowError(MpgraphError, ValueError):
    """Weights written into a converted module whose values do not fit the dtype the plan
    stored them in (a float16 slot given 1e5): the cast would store inf. Raised before anything
    is written; names each tensor, its absmax and the dtype's max."""


class MissingWeightsError(MpgraphError, RuntimeError):
    """A converted module planned without weights (on the meta device) called while some of its
    tensors still have no value: names them, and says to load them (``mpgraph.load_weights``)."""


class ConversionError(MpgraphError):
    """The converted graph does not match its plan (a bug in mpgraph, or an op we mis-classified)."""


class ValueCheckError(ConversionError):
    """The converted module's outputs differ from float32's by more than its dtype's bound:
    ``error`` (relative L2 of the worst output), ``bound``, ``dtype`` (the plan's low dtype)."""

    def __init__(self, message: str, error: float, bound: float, dtype: torch.dtype):
        super().__init__(message)
        self.error, self.bound, self.dtype = error, bound, dtype

    def __reduce__(self):  # (pickles and copies with its fields: a conversion in a worker)
        return type(self), (str(self), self.error, self.bound, self.dtype)


class ExportError(MpgraphError):
    """ONNX export failed, or the exported file does not match the plan or its numbers."""


class CalibrationError(MpgraphError, ValueError):
    """Calibration data that cannot be used: no batches, or a batch that does not fit the model."""


class ToleranceError(MpgraphError, ValueError):
    """The stated tolerance cannot be met, not even with every node in float32."""


class PlanMismatchError(MpgraphError, ValueError):
    """A saved plan that does not fit the model it is applied to; ``mismatches`` lists why."""

    def __init__(self, mismatches: list[str]):
        self.mismatches = list(mismatches)
        shown = self.mismatches[:20]
        more = len(self.mismatches) - len(shown)
        super().__init__("the plan does not match this model:\n  " + "\n  ".join(shown)
                         + (f"\n  ... and {more} more" if more > 0 else ""))

    def __reduce__(self):  # (pickles and copies with its mismatches)
        return type(self), (self.mismatches,)
