"""Reports of a plan: a text table, JSON, Graphviz DOT, and one self-contained HTML page.

``report(converted_or_plan, format="text" | "json" | "html" | "dot", path=None)`` returns the
report and writes it to ``path`` when given. The HTML page needs no network: the graph is drawn as
inline SVG by a small layered layout here (one collapsible drawing per module, so BERT-base's
~300 nodes stay readable), with a searchable table of every node and the summary on top.
"""
from __future__ import annotations

import html
import json
import os
from collections import OrderedDict
from typing import Optional, Union

import torch

from mpgraph.ir.meta import SHORT_DTYPE_NAMES, dtype_name
from mpgraph.plans.plan import CastRecord, NodeRecord, Plan

FORMATS = ("text", "json", "html", "dot")
COLOURS = {"float32": "#6c8ebf", "float16": "#82b366", "bfloat16": "#d79b00", None: "#bbbbbb"}



def report(obj, format: str = "text", path: Union[None, str, os.PathLike] = None,
           profile=None) -> str:
    """The plan of ``obj`` (a converted module or a Plan) as text, json, html or dot; with a
    ``profile`` (``mpgraph.profile(...)``), measured time per node beside the prediction."""
    if format not in FORMATS:
        raise ValueError(f"unknown report format {format!r}; one of {', '.join(FORMATS)}")
    plan = Plan.of(obj, "report")
    measured = {n.name: n for n in profile.nodes} if profile is not None else None
    if format == "dot":
        text = dot_report(plan)
    else:
        text = {"text": text_report, "json": json_report, "html": html_report}[format](plan, measured)
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"cannot write {path}: directory {folder} does not exist")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


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
    if plan.estimate.get("plan_s"):
        out["speedup"] = plan.estimate["fp32_s"] / plan.estimate["plan_s"]
    return out


def _op(r: NodeRecord) -> str:
    return r.kind or r.target


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
    lines = [f"mpgraph plan: {low} on {plan.target or '?'} ({plan.strategy or '?'} strategy)",
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
            for finding in (r.tensor_core,) if r.tensor_core.startswith("eligible but") else ():
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
              else "estimated speed-up: not estimated (rules strategy)"]
    return "\n".join(lines) + "\n"


# -- json -------------------------------------------------------------------------------------
def json_report(plan: Plan, measured: Optional[dict] = None) -> str:
    data = {**plan.to_dict(), "totals": totals(plan)}
    if measured is not None:
        data["profile"] = [{"node": n.name, "measured_s": n.time_s, "predicted_s": n.predicted_s,
                            "kernels": list(n.kernels), "tensor_core": n.tensor_core,
                            "finding": n.finding} for n in measured.values()]
    return json.dumps(data, indent=1)


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
_W, _H, _GAP_X, _GAP_Y = 150, 34, 24, 26


def _layout(nodes: list[NodeRecord]) -> dict[str, tuple[float, float]]:
    """Layered layout: a node's row is one below its lowest input in the group; columns in order."""
    row: dict[str, int] = {}
    names = {r.name for r in nodes}
    for r in nodes:  # graph order is topological
        row[r.name] = 1 + max((row[s] for s in r.inputs if s in names), default=-1)
    col: dict[int, int] = {}
    pos = {}
    for r in nodes:
        c = col.get(row[r.name], 0)
        col[row[r.name]] = c + 1
        pos[r.name] = (c * (_W + _GAP_X) + 10, row[r.name] * (_H + _GAP_Y) + 10)
    return pos


def _svg(nodes: list[NodeRecord], casts: dict) -> str:
    pos = _layout(nodes)
    width = max((x for x, _ in pos.values()), default=0) + _W + 20
    height = max((y for _, y in pos.values()), default=0) + _H + 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    outside = []
    for r in nodes:
        x, y = pos[r.name]
        for src in r.inputs:
            if src in pos:
                sx, sy = pos[src]
                c = casts.get((src, r.name))
                style = 'stroke="#d62728" stroke-dasharray="5,3" stroke-width="2"' if c else 'stroke="#999"'
                parts.append(f'<line x1="{sx + _W / 2}" y1="{sy + _H}" x2="{x + _W / 2}" y2="{y}" {style}/>')
                if c:
                    parts.append(f'<text x="{(sx + x) / 2 + _W / 2 + 4}" y="{(sy + _H + y) / 2}" '
                                 f'font-size="10" fill="#d62728">{html.escape(_arrow(c))}</text>')
            elif casts.get((src, r.name)):
                outside.append((r.name, src, casts[(src, r.name)]))
    for r in nodes:
        x, y = pos[r.name]
        tip = html.escape(f"{r.name} ({_op(r)}): {r.dtype} — {r.reason}")
        parts.append(f'<g><title>{tip}</title><rect x="{x}" y="{y}" width="{_W}" height="{_H}" rx="4" '
                     f'fill="{COLOURS.get(r.dtype, "#bbbbbb")}" stroke="#333"/>'
                     f'<text x="{x + 5}" y="{y + 14}" font-size="11">{html.escape(r.name[:22])}</text>'
                     f'<text x="{x + 5}" y="{y + 28}" font-size="9">{html.escape(_op(r)[:18])} '
                     f'{html.escape((r.dtype or "-")[:8])}</text></g>')
    for name, src, c in outside:  # a cast on an edge from another group: a marker on the reader
        x, y = pos[name]
        parts.append(f'<text x="{x + _W - 60}" y="{y - 3}" font-size="10" fill="#d62728">'
                     f'{html.escape(src[:10])} {html.escape(_arrow(c))}</text>')
    parts.append("</svg>")
    return "".join(parts)


_STYLE = """body{font-family:Helvetica,Arial,sans-serif;margin:16px;color:#222}
h1{font-size:20px}.summary{background:#f4f4f4;padding:8px;border-radius:4px}
.legend span{display:inline-block;padding:2px 8px;margin-right:6px;border-radius:3px}
details{margin:6px 0;border:1px solid #ddd;border-radius:4px;padding:4px}
summary{cursor:pointer;font-weight:bold}.graph{overflow:auto;max-height:600px}
table{border-collapse:collapse;font-size:12px;width:100%}td,th{border:1px solid #ddd;padding:3px 5px;text-align:left}
th{background:#eee}input{width:40%;padding:4px;margin:8px 0}"""

_SCRIPT = """function filterRows(){var q=document.getElementById('q').value.toLowerCase();
var rows=document.querySelectorAll('#nodes tbody tr');for(var i=0;i<rows.length;i++){
rows[i].style.display=rows[i].textContent.toLowerCase().indexOf(q)>=0?'':'none';}}"""


def html_report(plan: Plan, measured: Optional[dict] = None) -> str:
    drawn = _drawn(plan)
    casts = _cast_on(plan)
    t = totals(plan)
    low = dtype_name(plan.dtype)
    legend = "".join(f'<span style="background:{COLOURS[d]}">{d}</span>'
                     for d in ("float32", "float16", "bfloat16"))
    sections = []
    for group, nodes in _groups(drawn).items():
        n_low = len([r for r in nodes if r.dtype not in (None, "float32") and r.op.startswith("call_")])
        n_casts = len([1 for r in nodes for s in r.inputs if (s, r.name) in casts])
        sections.append(f'<details{" open" if len(nodes) <= 12 else ""}><summary>{html.escape(group)}'
                        f' — {len(nodes)} nodes, {n_low} low, {n_casts} casts in</summary>'
                        f'<div class="graph">{_svg(nodes, casts)}</div></details>')
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
<style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>
<h1>mpgraph plan: {low} on {html.escape(plan.target or '?')}</h1>
<p class="summary">{html.escape(plan.summary())}</p>
<p>{t['low_nodes']}/{t['nodes']} nodes in {low}; {_size(t['low_flops'])} of {_size(t['flops'])} FLOPs in
low precision; {t['casts']} casts moving {_size(t['cast_bytes'])}B per run{speed}.</p>
<p class="legend">{legend} <span style="color:#d62728">- - cast on an edge</span></p>
<h2>Graph, by module</h2>{''.join(sections)}
<h2>Nodes</h2><input id="q" placeholder="search nodes, modules, ops, reasons" oninput="filterRows()">
<table id="nodes"><thead><tr><th>node</th><th>module</th><th>op</th><th>class</th><th>dtype</th>
<th>t fp32 us</th><th>t low us</th><th>measured us</th><th>decided by</th><th>tensor cores</th></tr></thead><tbody>{rows}</tbody></table>
<h2>Casts</h2><table><thead><tr><th>value</th><th>from &#8594; to</th><th>elements</th><th>bytes/run</th>
<th>readers</th></tr></thead><tbody>{cast_rows}</tbody></table></body></html>
"""
