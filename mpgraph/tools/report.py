"""Reports of a plan: a text table, JSON, Graphviz DOT, and one self-contained HTML page.

``report(converted_or_plan, format="text" | "json" | "html" | "dot", path=None)`` returns the
report and writes it to ``path`` when given. The HTML page needs no network: the graph is drawn as
inline SVG by a small layered layout here (one collapsible drawing per module, so BERT-base's
~300 nodes stay readable), with a searchable table of every node and the summary on top. It is
made to show where the casts are at first sight: the summary counts them and links the sections
that read them; those sections start open, the cast-free ones folded (tiny ones merged); casts are
thick arrows in CAST_COLOUR labelled "f32→f16"; every drawing scales down to the page width.
"""
from __future__ import annotations

import html
import json
import math
import os
import re
from collections import OrderedDict
from typing import Optional, Union

import torch

from mpgraph.ir.meta import SHORT_DTYPE_NAMES, dtype_name
from mpgraph.plans.plan import CastRecord, NodeRecord, Plan, jsonable

FORMATS = ("text", "json", "html", "dot")
COLOURS = {"float32": "#6c8ebf", "float16": "#82b366", "bfloat16": "#d79b00", None: "#bbbbbb"}



def report(obj, format: str = "text", path: Union[None, str, os.PathLike] = None,
           profile=None) -> str:
    """The plan of ``obj`` (a converted module or a Plan) as text, json, html or dot; with a
    ``profile`` (``mpgraph.profile(...)``), measured time per node beside the prediction."""
    if format not in FORMATS:
        raise ValueError(f"unknown report format {format!r}; one of {', '.join(FORMATS)}")
    plan = Plan.of(obj, "report")
    if path is not None:
        check_folder(path)
    measured = {n.name: n for n in profile.nodes} if profile is not None else None
    if format == "dot":
        text = dot_report(plan)
    else:
        text = {"text": text_report, "json": json_report, "html": html_report}[format](plan, measured)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def check_folder(path, name: Optional[str] = None) -> None:
    """FileNotFoundError, naming ``name`` (default: the path), where the folder ``path`` would
    be written in does not exist; ValueError where ``path`` is a directory itself (open() says
    only "Is a directory"). The CLI checks before converting, not after."""
    if os.path.isdir(path):
        raise ValueError(f"cannot write {name or path}: it is a directory; name the file to "
                         "write in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {name or path}: directory {folder} does not exist")


# -- shared pieces ----------------------------------------------------------------------------
def group_of(record: NodeRecord) -> str:
    """The module group a node is listed and drawn under: its path up to the first index (one
    group per repeated block: "encoder.layer.0"), else its top-level module ("embeddings");
    "(top level)" outside any module."""
    parts = [p for p in record.module.split(".") if p]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0] if parts else "(top level)"


def _groups(nodes: list[NodeRecord]) -> "OrderedDict[str, list[NodeRecord]]":
    groups: OrderedDict[str, list[NodeRecord]] = OrderedDict()
    for r in nodes:
        groups.setdefault(group_of(r), []).append(r)
    return groups


def cast_bytes(c: CastRecord) -> int:
    """Bytes one run of the cast moves: its input read plus its output written."""
    return c.numel * (getattr(torch, c.src).itemsize + getattr(torch, c.dst).itemsize)


def totals(plan: Plan) -> dict:
    low = dtype_name(plan.dtype)
    compute = plan.compute_nodes
    flops = sum(r.flops or 0.0 for r in compute)
    low_flops = sum(r.flops or 0.0 for r in compute if r.dtype not in (None, "float32"))
    out = {"nodes": len(compute), "low_nodes": len([r for r in compute if r.dtype == low]),
           "other_low_nodes": len(plan.range_nodes), "flops": flops, "low_flops": low_flops,
           "casts": len(plan.casts), "cast_bytes": sum(cast_bytes(c) for c in plan.casts)}
    if plan.estimate.get("plan_s") and math.isfinite(plan.estimate["plan_s"]):
        out["speedup"] = plan.estimate["fp32_s"] / plan.estimate["plan_s"]
    return out


def _op(r: NodeRecord) -> str:
    """The op as the model calls it: the op-table key, else the target, both qualified names;
    there a torch function reads torch._VariableFunctionsClass.relu (its C binding) and a
    wrapper made inside a function F.boolean_dispatch.<locals>.fn (F.max_pool2d): the binding
    is dropped, and a wrapper takes the name torch.fx gave its node (the function's __name__,
    without fx's _N counter)."""
    text = re.sub(r"(^|\.)_VariableFunctions(Class)?\.", r"\1", r.kind or r.target)
    if "<locals>" in text and r.op == "call_function":
        module = text[:text.index("<locals>")].rstrip(".").rpartition(".")[0]
        text = (module + "." if module else "") + re.sub(r"_\d+$", "", r.name)
    return text


def _us(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.3g}"


def _size(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


# -- text -------------------------------------------------------------------------------------
def _measured(measured, name: str) -> str:
    n = (measured or {}).get(name)
    if n is None:
        return "-"
    tc = "" if n.tensor_core is None else (" TC" if n.tensor_core else " noTC")
    return f"{n.time_s * 1e6:.3g}{tc}"


def text_report(plan: Plan, measured: Optional[dict] = None) -> str:
    low = dtype_name(plan.dtype)
    lines = [f"mpgraph plan: {plan.headline_dtype} on {plan.target or '?'} "
             f"({plan.strategy or '?'} strategy)",
             plan.summary(), ""]
    head = (f"{'node':<28} {'op':<24} {'class':<13} {'dtype':<9} {'t fp32 us':>9} "
            f"{'t low us':>9}" + (f" {'measured us':>13}" if measured is not None else "")
            + "  decided by")
    for group, nodes in _groups(plan.compute_nodes).items():
        n_low = len([r for r in nodes if r.dtype not in (None, "float32")])
        lines.append(f"== {group}: {len(nodes)} nodes, {n_low} low ==")
        lines.append(head)
        for r in nodes:
            lines.append(f"{r.name[:28]:<28} {_op(r)[:24]:<24} {r.op_class:<13} {r.dtype or '-':<9} "
                         f"{_us(r.t_fp32):>9} {_us(r.t_low):>9}"
                         + (f" {_measured(measured, r.name):>13}" if measured is not None else "")
                         + f"  {r.reason}")
            for finding in (r.tensor_core,) if r.tensor_core.startswith(
                    ("eligible but", "not on Tensor Cores")) else ():
                lines.append(f"{'':<28} tensor cores: {finding}")
            for finding in r.safety:
                lines.append(f"{'':<28} safety: {finding}")
        lines.append("")
    lines.append(f"== casts: {len(plan.casts)} ==")
    if plan.casts:
        lines.append(f"{'value':<28} {'from -> to':<22} {'elements':>10} {'bytes/run':>10}  readers")
        for c in plan.casts:
            lines.append(f"{c.value[:28]:<28} {c.src + ' -> ' + c.dst:<22} {c.numel:>10} "
                         f"{cast_bytes(c):>10}  {', '.join(c.consumers)}")
    t = totals(plan)
    lines += ["", "== totals ==",
              f"nodes: {t['nodes']} deciding a precision, {t['low_nodes']} in {low}"
              + (f", {t['other_low_nodes']} in {plan.range_nodes[0].dtype}" if t["other_low_nodes"] else ""),
              f"FLOPs per run: {_size(t['flops'])}, {_size(t['low_flops'])} in low precision "
              f"({t['low_flops'] / t['flops']:.1%})" if t["flops"] else "FLOPs per run: unknown",
              f"casts: {t['casts']}, {_size(t['cast_bytes'])}B moved per run",
              f"estimated speed-up on {plan.target}: {t['speedup']:.2f}x" if "speedup" in t
              else "estimated speed-up: not estimated (a low dtype this CPU emulates is never "
                   "timed)" if "plan_s" in plan.estimate else "estimated speed-up: not estimated"]
    return "\n".join(lines) + "\n"


# -- json -------------------------------------------------------------------------------------
def json_report(plan: Plan, measured: Optional[dict] = None) -> str:
    data = {**plan.to_dict(), "totals": totals(plan)}
    if measured is not None:
        data["profile"] = [{"node": n.name, "measured_s": n.time_s, "predicted_s": n.predicted_s,
                            "kernels": list(n.kernels), "tensor_core": n.tensor_core,
                            "finding": n.finding} for n in measured.values()]
    return json.dumps(jsonable(data), indent=1, allow_nan=False)


# -- dot --------------------------------------------------------------------------------------
def _dot_id(name: str) -> str:
    return '"' + name.replace('"', '\\"') + '"'


def _drawn(plan: Plan) -> list[NodeRecord]:
    """The nodes a picture shows: inputs, the output and the nodes that decide a precision (not
    weights, nor the integer shape arithmetic of exported graphs)."""
    return [r for r in plan.nodes if r.op in ("placeholder", "output")
            or (r.op.startswith("call_") and r.dtype is not None)]


def _arrow(c: CastRecord) -> str:
    return "->".join(SHORT_DTYPE_NAMES.get(getattr(torch, name), name) for name in (c.src, c.dst))


def _cast_on(plan: Plan) -> dict[tuple[str, str], CastRecord]:
    """(value, reader) -> the cast between them."""
    return {(c.value, reader): c for c in plan.casts for reader in c.consumers}


def dot_report(plan: Plan) -> str:
    drawn = _drawn(plan)
    names = {r.name for r in drawn}
    casts = _cast_on(plan)
    lines = ["digraph plan {", "  rankdir=TB; node [shape=box, style=filled, fontname=Helvetica];",
             f"  label={_dot_id(plan.summary())}; labelloc=t;"]
    for i, (group, nodes) in enumerate(_groups(drawn).items()):
        lines.append(f"  subgraph cluster_{i} {{ label={_dot_id(group)}; color=grey;")
        for r in nodes:
            label = f"{r.name}\\n{_op(r)}\\n{r.dtype or '-'}"
            lines.append(f"    {_dot_id(r.name)} [label={_dot_id(label)}, "
                         f"fillcolor={_dot_id(COLOURS.get(r.dtype, '#bbbbbb'))}];")
        lines.append("  }")
    for r in drawn:
        for src in r.inputs:
            if src not in names:
                continue
            c = casts.get((src, r.name))
            attrs = f' [color=red, style=dashed, label="{_arrow(c)}"]' if c else ""
            lines.append(f"  {_dot_id(src)} -> {_dot_id(r.name)}{attrs};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- html -------------------------------------------------------------------------------------
# cast edges, their labels and the legend's sample; nothing else on the page is this red (the
# cast counts in titles are dark red badges), so a screenshot shows where the casts are drawn
CAST_COLOUR = "#e00000"
_EDGE = "#8c8c8c"
_W, _H, _GAP_X, _GAP_Y = 124, 34, 14, 30
_PAD, _TOP = 8, 26        # _TOP: room above the first row for casts arriving from another section
_TINY = 2                 # sections of at most this many nodes merge with tiny neighbours


def _html_arrow(c: CastRecord) -> str:
    return "\u2192".join(SHORT_DTYPE_NAMES.get(getattr(torch, name), name) for name in (c.src, c.dst))


def _short(dtype: Optional[str]) -> str:
    return SHORT_DTYPE_NAMES.get(getattr(torch, dtype, None), dtype) if dtype else "-"


def _layout(nodes: list[NodeRecord]) -> dict[str, tuple[float, float]]:
    """Layered layout: a node's row is one below its lowest input in the group; in each row the
    nodes sit under their inputs where they can (the mean column of their inputs), else in order."""
    row: dict[str, int] = {}
    for r in nodes:  # graph order is topological
        row[r.name] = 1 + max((row[s] for s in r.inputs if s in row), default=-1)
    rows: dict[int, list[NodeRecord]] = {}
    for r in nodes:
        rows.setdefault(row[r.name], []).append(r)
    col: dict[str, int] = {}
    for k in sorted(rows):
        wanted = []
        for i, r in enumerate(rows[k]):
            above = [col[s] for s in r.inputs if s in col]
            wanted.append((sum(above) / len(above) if above else float(i), i, r))
        free = 0
        for want, _, r in sorted(wanted, key=lambda w: (w[0], w[1])):
            col[r.name] = max(free, round(want))
            free = col[r.name] + 1
    return {name: (_PAD + col[name] * (_W + _GAP_X), _TOP + row[name] * (_H + _GAP_Y)) for name in col}


def _markers(sid: str) -> str:
    """Arrowheads for one drawing: ordinary edges grey, casts in the cast colour."""
    return "".join(
        f'<marker id="{sid}{kind}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="{size}" '
        f'markerHeight="{size}" markerUnits="userSpaceOnUse" orient="auto">'
        f'<path d="M0,0L10,5L0,10z" fill="{fill}"/></marker>'
        for kind, fill, size in (("a", _EDGE, 8), ("c", CAST_COLOUR, 10)))


def _label(x: float, y: float, text: str) -> str:
    """Cast colour text with a white halo, legible over edges and nodes."""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="11" font-weight="bold" '
            f'fill="{CAST_COLOUR}" stroke="#fff" stroke-width="3" paint-order="stroke">'
            f'{html.escape(text)}</text>')


def _svg(nodes: list[NodeRecord], casts: dict, sid: str) -> str:
    """One section's drawing: nodes coloured by dtype, every edge an arrow, casts thick and red
    with their direction; a cast on a value from another section is a short red arrow into its
    reader, labelled with the value's name. Scales down to the page width (viewBox)."""
    pos = _layout(nodes)
    ins: dict[str, list[tuple[str, Optional[CastRecord], bool]]] = {}  # reader -> (src, cast, here)
    for r in nodes:
        ins[r.name] = [(s, casts.get((s, r.name)), s in pos) for s in dict.fromkeys(r.inputs)
                       if s in pos or (s, r.name) in casts]
    plain, cast_edges, labels = [], [], []
    right = max((x for x, _ in pos.values()), default=0) + _W + _PAD
    named: set[str] = set()  # casts from other sections already labelled with their value's name
    for r in nodes:
        x, y = pos[r.name]
        k = len(ins[r.name])
        step = min(16.0, (_W - 24) / max(k - 1, 1))
        for i, (src, c, here) in enumerate(ins[r.name]):
            tx, ty = x + _W / 2 + (i - (k - 1) / 2) * step, y
            if here:
                sx, sy = pos[src][0], pos[src][1]
                if ty - sy - _H <= _GAP_Y + 1:  # the next row down: straight
                    d = f"M{sx + _W / 2:.1f},{sy + _H:.1f}L{tx:.1f},{ty:.1f}"
                else:  # further down: along the gap right of its column, clear of the boxes
                    lane = sx + _W + _GAP_X / 2
                    d = (f"M{sx + _W:.1f},{sy + _H / 2:.1f}L{lane:.1f},{sy + _H / 2:.1f}"
                         f"L{lane:.1f},{ty - _GAP_Y / 2:.1f}L{tx:.1f},{ty:.1f}")
                text = _html_arrow(c) if c else ""
            else:  # a cast on a value computed in another section: a short arrow from above
                d = f"M{tx:.1f},{ty - 22:.1f}L{tx:.1f},{ty:.1f}"
                text = _html_arrow(c) if c.name in named else f"{src[:14]} {_html_arrow(c)}"
                named.add(c.name)
            if c is None:
                plain.append(f'<path d="{d}" fill="none" stroke="{_EDGE}" stroke-width="1.2" '
                             f'marker-end="url(#{sid}a)"/>')
                continue
            tip = html.escape(f"cast {c.name}: {src} {c.src} \u2192 {c.dst} for {r.name}")
            cast_edges.append(f'<path d="{d}" fill="none" stroke="{CAST_COLOUR}" stroke-width="2.5" '
                              f'stroke-linejoin="round" marker-end="url(#{sid}c)"><title>{tip}</title></path>')
            labels.append(_label(tx + 5, ty - 10, text))
            right = max(right, tx + 5 + 6.6 * len(text) + _PAD)
    boxes = []
    for r in nodes:
        x, y = pos[r.name]
        tip = html.escape(f"{r.name} ({_op(r)}) in {r.module or '(top level)'}: {r.dtype} — {r.reason}")
        boxes.append(f'<g><title>{tip}</title><rect x="{x}" y="{y}" width="{_W}" height="{_H}" rx="4" '
                     f'fill="{COLOURS.get(r.dtype, "#bbbbbb")}" stroke="#333"/>'
                     f'<text x="{x + 5}" y="{y + 14}" font-size="11">{html.escape(r.name[:19])}</text>'
                     f'<text x="{x + 5}" y="{y + 28}" font-size="9">{html.escape(_op(r)[:16])} '
                     f'{html.escape(_short(r.dtype))}'
                     f'</text></g>')
    width = int(right + 0.5)
    height = int(max((y for _, y in pos.values()), default=0) + _H + _PAD)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}"><defs>{_markers(sid)}</defs>'
            + "".join(plain + cast_edges + boxes + labels) + "</svg>")


def _sections(plan: Plan, drawn: list[NodeRecord]) -> list[tuple[list[str], list[NodeRecord], list[CastRecord]]]:
    """(module groups, nodes, casts read there) per section of the page, in graph order. Runs of
    tiny groups (a lone dropout, an input, one module of a Sequential) are merged into one
    section, so they neither flood the page nor hide a cast in a one-node drawing."""
    merged: list[tuple[list[str], list[NodeRecord]]] = []
    tiny_run = False
    for group, nodes in _groups(drawn).items():
        tiny = len(nodes) <= _TINY
        if tiny and tiny_run:
            merged[-1][0].append(group)
            merged[-1][1].extend(nodes)
        else:
            merged.append(([group], list(nodes)))
        tiny_run = tiny
    order = {r.name: i for i, r in enumerate(drawn)}
    out = []
    for groups, nodes in merged:
        nodes.sort(key=lambda r: order[r.name])  # graph order (a merged group may come back later)
        names = {r.name for r in nodes}
        out.append((groups, nodes, [c for c in plan.casts if names.intersection(c.consumers)]))
    return out


def _section_title(groups: list[str]) -> str:
    return ", ".join(groups) if len(groups) <= 3 else f"{groups[0]}, {groups[1]} and {len(groups) - 2} more"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


_STYLE = """body{font-family:Helvetica,Arial,sans-serif;margin:16px;color:#222}
h1{font-size:20px;margin:4px 0 8px}h2{font-size:17px;margin:14px 0 6px}
.summary{background:#f4f4f4;padding:4px 10px;border-radius:4px}.summary p{margin:6px 0}
.legend span.sw{display:inline-block;padding:1px 8px;margin-right:6px;border-radius:3px}
.legend svg{vertical-align:middle}
.badge{background:#9b1111;color:#fff;padding:0 7px;border-radius:9px;font-weight:bold;white-space:nowrap}
a.badge{text-decoration:none}.none{color:#777;font-weight:normal}
.sections{display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start}
details.section{border:1px solid #ccc;border-radius:4px;padding:4px 6px;max-width:100%;min-width:0;box-sizing:border-box}
details.section.has-casts{border-color:#9b1111}
summary{cursor:pointer;font-weight:bold}svg.graph{display:block;max-width:100%;height:auto;margin-top:4px}
table{border-collapse:collapse;font-size:12px;width:100%}td,th{border:1px solid #ddd;padding:3px 5px;text-align:left;overflow-wrap:break-word}
.wide{overflow-x:auto;max-width:100%}
th{background:#eee}input{width:40%;padding:4px;margin:8px 0}"""

_SCRIPT = """function filterRows(){var q=document.getElementById('q').value.toLowerCase();
var rows=document.querySelectorAll('#nodes tbody tr');for(var i=0;i<rows.length;i++){
rows[i].style.display=rows[i].textContent.toLowerCase().indexOf(q)>=0?'':'none';}}"""


def _legend() -> str:
    swatches = "".join(f'<span class="sw" style="background:{COLOURS[d]}">{d}</span>'
                       for d in ("float32", "float16", "bfloat16"))
    sample = _label(45, 13, "f32\u2192f16")
    cast = (f'<svg width="112" height="18" viewBox="0 0 112 18"><defs>{_markers("lg")}</defs>'
            f'<path d="M2,9L40,9" stroke="{CAST_COLOUR}" stroke-width="2.5" marker-end="url(#lgc)"/>'
            f'{sample}</svg>')
    edge = (f'<svg width="46" height="18" viewBox="0 0 46 18"><defs>{_markers("lh")}</defs>'
            f'<path d="M2,9L40,9" stroke="{_EDGE}" stroke-width="1.2" marker-end="url(#lha)"/></svg>')
    return (f'<p class="legend">nodes: {swatches} edges: {cast} a cast (from &#8594; to) &nbsp; '
            f'{edge} a value read as it is</p>')


def html_report(plan: Plan, measured: Optional[dict] = None) -> str:
    drawn = _drawn(plan)
    casts = _cast_on(plan)
    t = totals(plan)
    low = dtype_name(plan.dtype)
    sections, where = [], []
    compute = {r.name for r in plan.compute_nodes}  # counted as the text report and summary do
    for i, (groups, nodes, read) in enumerate(_sections(plan, drawn)):
        title = html.escape(_section_title(groups))
        counted = [r for r in nodes if r.name in compute]  # (not the inputs and output drawn)
        n_low = len([r for r in counted if r.dtype != "float32"])
        count = (f'<span class="badge">{_plural(len(read), "cast")}</span>' if read
                 else '<span class="none">no casts</span>')
        if read:
            where.append(f'<a class="badge" href="#s{i}">{title}: {len(read)}</a>')
        sections.append(f'<details id="s{i}" class="section{" has-casts" if read else ""}" '
                        f'data-casts="{len(read)}"{" open" if read else ""}><summary>{title} — {count} '
                        f'<span class="none">· {_plural(len(counted), "node")}, {n_low} low</span></summary>'
                        f'{_svg(nodes, casts, f"s{i}")}</details>')
    directions: OrderedDict[str, int] = OrderedDict()
    for c in plan.casts:
        directions[_html_arrow(c)] = directions.get(_html_arrow(c), 0) + 1
    if plan.casts:
        cast_line = (f'<b>{_plural(len(plan.casts), "cast")}</b> '
                     f'({", ".join(f"{n} {d}" for d, n in directions.items())}), moving '
                     f'{_size(t["cast_bytes"])}B per run, read in {len(where)} of {len(sections)} '
                     f'sections (open below; the others are folded): {" ".join(where)}')
    else:
        cast_line = "<b>no casts</b>: every section is folded; open one to see its graph."
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{html.escape(r.module)}</td><td>{html.escape(_op(r))}</td>"
        f"<td>{r.op_class}</td><td style='background:{COLOURS.get(r.dtype, '#bbb')}'>{r.dtype or '-'}</td>"
        f"<td>{_us(r.t_fp32)}</td><td>{_us(r.t_low)}</td><td>{_measured(measured, r.name)}</td>"
        f"<td>{html.escape(r.reason)}"
        f"{''.join('<br>safety: ' + html.escape(f) for f in r.safety)}</td>"
        f"<td>{html.escape(r.tensor_core)}</td></tr>" for r in plan.compute_nodes)
    cast_rows = "".join(
        f"<tr><td>{html.escape(c.value)}</td><td>{c.src} &#8594; {c.dst}</td><td>{c.numel}</td>"
        f"<td>{cast_bytes(c)}</td><td>{html.escape(', '.join(c.consumers))}</td></tr>" for c in plan.casts)
    speed = f"; estimated {t['speedup']:.2f}x float32 speed" if "speedup" in t else ""
    return f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>mpgraph plan</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>
<h1>mpgraph plan: {plan.headline_dtype} on {html.escape(plan.target or '?')}</h1>
<div class="summary"><p>{html.escape(plan.summary())}</p>
<p>{t['low_nodes']}/{t['nodes']} nodes in {low}; {_size(t['low_flops'])} of {_size(t['flops'])} FLOPs in
low precision{speed}.</p>
<p>{cast_line}</p>
{_legend()}</div>
<h2>Graph, by module</h2><div class="sections">{''.join(sections)}</div>
<h2>Nodes</h2><input id="q" placeholder="search nodes, modules, ops, reasons" oninput="filterRows()">
<div class="wide"><table id="nodes"><thead><tr><th>node</th><th>module</th><th>op</th><th>class</th><th>dtype</th>
<th>t fp32 us</th><th>t low us</th><th>measured us</th><th>decided by</th><th>tensor cores</th></tr></thead><tbody>{rows}</tbody></table></div>
<h2>Casts</h2><div class="wide"><table><thead><tr><th>value</th><th>from &#8594; to</th><th>elements</th><th>bytes/run</th>
<th>readers</th></tr></thead><tbody>{cast_rows}</tbody></table></div></body></html>
"""
