"""Nsight Compute and nvprof: build the command, pick metrics that exist, parse the CSV.

``mpgraph.profile`` wraps every node in an NVTX range ``mpgraph:<node>``; ncu filtered on those
ranges (``--nvtx --nvtx-include "regex:mpgraph:.*/"``) reports the kernels each node launched,
with the tensor pipe metrics that prove Tensor Core use. ncu's CSV differs across versions: a
long form (one row per kernel and metric: "Metric Name", "Metric Unit", "Metric Value") and the
``--page raw`` wide form (one row per kernel, a column per metric, a units row under the header),
leading ``==PROF==``/``==WARNING==`` lines, thousands separators, "n/a", NVTX state in a column
whose name and format vary. nvprof (Volta/Turing) prints ``tensor_precision_fu_utilization`` as a
level ("Low (1)" ... "Max (10)") per kernel, without NVTX: its rows map to nodes by kernel name
through a torch.profiler profile.
"""
from __future__ import annotations

import csv
import io
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Iterable, Optional

from mpgraph.tools.profiling import RANGE_PREFIX

# Tensor pipe metrics, most specific first: ncu --query-metrics decides which exist on a GPU.
TENSOR_METRICS = (
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",  # Volta..Ada
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",  # Hopper wgmma
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",          # aggregate
    "sm__inst_executed_pipe_tensor_op_hmma.sum",
    "sm__inst_executed_pipe_tensor_op_gmma.sum",
    "sm__inst_executed_pipe_tensor.sum",
)
TIME_METRIC = "gpu__time_duration.sum"
NVTX_INCLUDE = f"regex:{RANGE_PREFIX}.*/"
_NODE_IN_NVTX = re.compile(re.escape(RANGE_PREFIX) + r"([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class KernelRow:
    """One kernel launch: its node (from NVTX, when known) and its metrics."""

    kernel: str
    node: Optional[str] = None
    metrics: dict = field(default_factory=dict)   # metric name -> float or None (n/a)
    units: dict = field(default_factory=dict)

    @property
    def tensor_active(self) -> Optional[float]:
        """The first tensor pipe metric present: > 0 means the kernel used Tensor Cores."""
        for m in TENSOR_METRICS + ("tensor_precision_fu_utilization",):
            if self.metrics.get(m) is not None:
                return self.metrics[m]
        return None


def available_metrics(query_output: str, wanted: Iterable[str] = TENSOR_METRICS) -> list[str]:
    """Those of ``wanted`` that ``ncu --query-metrics`` lists (base names, suffixes stripped)."""
    listed = set()
    for line in query_output.splitlines():
        word = line.strip().split(" ")[0] if line.strip() else ""
        if word and not word.startswith(("-", "=", "Device")):
            listed.add(word)
    out = []
    for metric in wanted:
        base = metric.split(".")[0]
        if metric in listed or base in listed:
            out.append(metric)
    return out


def query_metrics(ncu: str = "ncu") -> Optional[str]:
    """``ncu --query-metrics`` output on this GPU, or None when ncu cannot run here."""
    if shutil.which(ncu) is None:
        return None
    try:
        done = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def ncu_command(program: list[str], metrics: Optional[list[str]] = None,
                log_file: Optional[str] = None, ncu: str = "ncu") -> list[str]:
    """The ncu command that profiles ``program`` (a command that runs the model under
    mpgraph.profile's NVTX ranges) node by node, with tensor pipe metrics and kernel time, in
    base units (nanoseconds), its CSV to ``log_file`` (else stdout, mixed with the program's)."""
    chosen = list(metrics) if metrics else list(TENSOR_METRICS[:1])
    if TIME_METRIC not in chosen:
        chosen.append(TIME_METRIC)
    log = ["--log-file", log_file] if log_file else []
    return [ncu, "--nvtx", "--nvtx-include", NVTX_INCLUDE, "--metrics", ",".join(chosen),
            "--csv", "--page", "raw", "--print-units", "base", *log, *program]


def shell(command: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in command)


def _number(text: str) -> Optional[float]:
    text = (text or "").strip().replace(",", "")
    if text in ("", "n/a", "N/A", "nan", "-"):
        return None
    level = re.search(r"\((\d+)\)", text)  # nvprof levels: "Low (1)", "Max (10)"
    if level:
        return float(level.group(1))
    try:
        return float(text)
    except ValueError:
        return None


def _csv_rows(text: str) -> list[list[str]]:
    """CSV rows from the first header line on: tool chatter (==PROF==, ==123==, warnings) dropped."""
    lines = [l for l in text.splitlines() if l.strip() and not re.match(r"^\s*==[^=]*==", l)]
    for i, line in enumerate(lines):
        if line.lstrip().startswith('"'):
            return list(csv.reader(io.StringIO("\n".join(lines[i:]))))
    return []


def _node_of(row: dict) -> Optional[str]:
    for key, value in row.items():
        if key and ("nvtx" in key.lower() or "push/pop" in key.lower() or "range" in key.lower()):
            found = _NODE_IN_NVTX.findall(value or "")
            if found:
                return found[-1]  # the innermost range
    return None


def parse_ncu_csv(text: str) -> list[KernelRow]:
    """Kernel rows of an ``ncu --csv`` report, long form or ``--page raw``, any recent version."""
    rows = _csv_rows(text)
    if not rows:
        raise ValueError("no CSV table in the ncu output (was it run with --csv?)")
    header, body = rows[0], rows[1:]
    name_col = next((h for h in header if h in ("Kernel Name", "Function Name", "Name")), None)
    if name_col is None:
        raise ValueError(f"the ncu CSV has no kernel name column: {header[:8]}")
    dicts = [dict(zip(header, r)) for r in body if len(r) == len(header)]
    if "Metric Name" in header:  # long form: one row per (launch, metric)
        by_launch: dict[str, KernelRow] = {}
        for d in dicts:
            key = d.get("ID") or str(len(by_launch))
            k = by_launch.setdefault(key, KernelRow(d[name_col], _node_of(d)))
            k.metrics[d["Metric Name"]] = _number(d.get("Metric Value", ""))
            k.units[d["Metric Name"]] = d.get("Metric Unit", "")
        return list(by_launch.values())
    units = {}
    if dicts and not dicts[0].get(name_col, "").strip():  # raw page: a units row under the header
        units, dicts = dicts[0], dicts[1:]
    metric_cols = [h for h in header if "__" in h or h in ("tensor_precision_fu_utilization",)]
    return [KernelRow(d[name_col], _node_of(d), {m: _number(d.get(m, "")) for m in metric_cols},
                      {m: units.get(m, "") for m in metric_cols}) for d in dicts]


def parse_nvprof_csv(text: str) -> list[KernelRow]:
    """``nvprof --csv --metrics tensor_precision_fu_utilization`` rows, one per kernel."""
    rows = _csv_rows(text)
    if not rows:
        raise ValueError("no CSV table in the nvprof output (was it run with --csv?)")
    header, body = rows[0], rows[1:]
    out = []
    for r in body:
        d = dict(zip(header, r))
        if "Kernel" not in d or "Metric Name" not in d:
            continue
        value = _number(d.get("Avg", "")) if d.get("Avg") else _number(d.get("Max", ""))
        out.append(KernelRow(d["Kernel"], None, {d["Metric Name"]: value}))
    return out


@dataclass
class NodeTensorUse:
    node: str
    kernels: list[str]
    tensor_active: Optional[float]   # the largest tensor pipe value over the node's kernels
    time_ns: Optional[float]


_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
       "second": 1e9, "s": 1e9}


def _time_ns(row: KernelRow) -> Optional[float]:
    value = row.metrics.get(TIME_METRIC)
    if value is None:
        return None
    return value * _NS.get((row.units.get(TIME_METRIC) or "nsecond").strip(), 1.0)


def per_node(rows: list[KernelRow], kernel_nodes: Optional[dict[str, str]] = None) -> list[NodeTensorUse]:
    """Rows grouped by node: from their NVTX range, else through ``kernel_nodes`` (kernel name ->
    node, from a torch.profiler run: how nvprof rows find their node)."""
    grouped: dict[str, list[KernelRow]] = {}
    for r in rows:
        node = r.node or (kernel_nodes or {}).get(r.kernel)
        if node is not None:
            grouped.setdefault(node, []).append(r)
    out = []
    for node, rs in grouped.items():
        active = [r.tensor_active for r in rs if r.tensor_active is not None]
        times = [t for t in (_time_ns(r) for r in rs) if t is not None]
        out.append(NodeTensorUse(node, [r.kernel for r in rs], max(active) if active else None,
                                 sum(times) if times else None))
    return out


def format_per_node(uses: list[NodeTensorUse]) -> str:
    rows = [f"{'node':<28} {'tensor pipe':>11} {'time us':>9}  kernels"]
    for u in uses:
        active = "-" if u.tensor_active is None else f"{u.tensor_active:.3g}"
        time = "-" if u.time_ns is None else f"{u.time_ns / 1e3:.3g}"
        rows.append(f"{u.node[:28]:<28} {active:>11} {time:>9}  {', '.join(u.kernels[:2])}")
    return "\n".join(rows)
