"""What a run writes: markdown tables (stdout), PNG plots and the JSON of every record, through
:mod:`lavo.report` and :mod:`lavo.files`."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from ..files import write_json
from ..report import length_label, line_plot, markdown_table, number
from .attention import BY_LABEL, OPS, SDPA, time_complexity
from .measure import MIB
from .settings import Settings


def wide_table(records: list[dict], row: Callable[[dict], str], cell: Callable[[dict], str], title: str,
               notes: bool = True) -> str:
    """Rows by ``row(record)``, one column per length. Skipped and failed cells show ``—``, with their reason as
    a numbered note under the table when ``notes`` (not where an earlier table of the same records gave them)."""
    lengths = sorted({r["length"] for r in records})
    by_row: dict[str, dict[int, dict]] = {}
    for r in records:
        by_row.setdefault(row(r), {})[r["length"]] = r
    reasons: list[str] = []

    def text(name: str, length: int) -> str:
        r = by_row[name].get(length)
        if r is None:
            return ""
        if r["status"] == "ok":
            return cell(r)
        if not notes:
            return "—"
        reasons.append(f"{name} at {length_label(length)}: {r['note']}")
        return f"— [{len(reasons)}]"

    rows = [[name] + [text(name, n) for n in lengths] for name in by_row]
    return markdown_table([title] + [length_label(n) for n in lengths], rows, notes=reasons)


def _ratio(r: dict) -> str:
    return f" (×{number(r['ratio'], 2)})" if r.get("ratio") is not None else ""


def _mechanism(r: dict) -> str:
    return r["mechanism"]


def _section(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r["section"] == name]


def markdown(records: list[dict], info: dict, settings: Settings) -> str:
    s = settings
    out = [f"# lavo benchmark ({s.dtype}, {info['device']}: {info['cpu']}, {info['threads']} threads, "
           f"torch {info['torch']})", ""]
    attention = _section(records, "attention")
    for which in s.passes:
        part = [r for r in attention if r["op"] == which]
        if not part:
            continue
        # as the decode and model tables say "× —" without their reference
        reference = "SDPA op at the same length" if any(r["mechanism"] == SDPA for r in part) else "—"
        out += [f"## Attention, {which}: B={s.batch}, H={s.heads}, D={s.head_dim}; ms (× {reference})", "",
                wide_table(part, _mechanism, lambda r: number(r["ms"]) + _ratio(r), "mechanism"), "",
                f"## Attention, {which}: peak memory growth, MiB", "",
                wide_table(part, _mechanism, lambda r: number(r["peak_mib"]), "mechanism", notes=False), ""]
    out += _capped(s, s.lengths, [OPS[op].label for op in s.ops] + s.attentions) if attention else []
    decode = _section(records, "decode")
    if decode:
        reference = next((r["ratio_to"] for r in decode if r["ratio_to"]), "—")
        out += [f"## Decoding: ms per token step at a context length (× {reference})", "",
                wide_table(decode, _mechanism, lambda r: number(r["ms"]) + _ratio(r), "mechanism"), "",
                "## Decoding: cache MiB after the context", "",
                wide_table(decode, _mechanism, lambda r: number(_cache_mib(r)), "mechanism", notes=False), ""]
    model = _section(records, "model")
    if model:
        reference = next((r["ratio_to"] for r in model if r["ratio_to"]), "—")
        shape = f" with {', '.join(f'{k}={v}' for k, v in s.model_overrides.items())}" if s.model_overrides else ""
        compiled = ", compiled" if s.model_compile else ""
        also = ", a checkpointed one × its checkpointed step" if s.model_checkpointing else ""
        out += [f"## Model `{s.model_preset}`{shape}, training step{compiled}, batch {s.model_batch}: tokens/s "
                f"(step time × {reference}'s{also}) / peak MiB", "",
                wide_table(model, _mechanism,
                           lambda r: f"{number(r['tokens_per_s'])}{_ratio(r)} / {number(r['peak_mib'])}",
                           "attention"), ""] + _capped(s, s.model_lengths, s.model_attentions)
    flops = _section(records, "flops")
    if flops:
        out += ["## LAVO op FLOP efficiency: GFLOP/s (fraction of the matmul rate)", ""]
        out += [f"matmul {r['length']}x{r['length']} {r['dtype']}: " + (
            f"{number(r['gflops_per_s'])} GFLOP/s" if r["status"] == "ok" else r["note"])
            for r in flops if r["mechanism"] == "matmul"]
        out += ["", wide_table([r for r in flops if r["mechanism"] != "matmul"], lambda r: r["op"],
                               lambda r: number(r["gflops_per_s"]) + (
                                   f" ({100 * r['ratio']:.0f}%)" if r["ratio"] is not None else ""), "pass"), ""]
    profiles = _section(records, "profile")
    if profiles:
        out += [f"## Profile: self time per call by {profiles[0]['kind']}, longest first", ""]
        for r in profiles:
            where = f"{r['mechanism']} {r['op']} at {length_label(r['length'])}"
            if r["status"] != "ok":
                out += [f"**{where}**: {r['note']}", ""]
                continue
            out += [f"**{where}**: {number(r['ms'])} ms per call under the profiler, {number(r['busy_ms'])} ms "
                    f"({100 * r['busy']:.0f}%) of it in the {r['kind']}s below", "",
                    markdown_table([r["kind"], "calls", "ms", "share"],
                                   [[k["name"], f"{k['calls']:g}", number(k["ms"]),
                                     f"{100 * k['share']:.1f}%"] for k in r["kernels"]]), ""]
    return "\n".join(out)


def _capped(s: Settings, lengths: list[int], names: list[str]) -> list[str]:
    """The note that explains the empty cells past ``--max-quadratic-length``, where some length is and some
    mechanism or op of ``names`` is quadratic (the others run at every length)."""
    if max(lengths, default=0) <= s.max_quadratic_length or not any(map(quadratic, names)):
        return []
    return [f"Empty cells: quadratic mechanisms are not run past --max-quadratic-length "
            f"{length_label(s.max_quadratic_length)}, and where the reference of the ratios is not run, the others "
            "have no ratio.", ""]


def quadratic(name: str) -> bool:
    """Whether the mechanism or raw op (by its label) ``name`` stops at ``--max-quadratic-length``."""
    return time_complexity(name) == "quadratic"


def _cache_mib(r: dict) -> float | None:
    return r["cache_bytes"] / MIB if r.get("cache_bytes") is not None else None


def plots(records: list[dict], directory: Path, settings: Settings) -> list[Path]:
    """PNG plots, log-log, one line per mechanism (raw ops dashed); returns the files written."""
    written = []

    def plot(name: str, part: list[dict], value: Callable[[dict], float | None], ylabel: str, title: str,
             xlabel: str = "sequence length") -> None:
        series: dict[str, list] = {}
        for r in part:
            series.setdefault(r["mechanism"], []).append((r["length"], value(r) if r["status"] == "ok" else None))
        path = line_plot(series, directory / name, xlabel=xlabel, ylabel=ylabel, title=title, logy=True,
                         dashed=list(BY_LABEL), length_ticks=True)
        if path is not None:
            written.append(path)

    attention = _section(records, "attention")
    for which in settings.passes:
        part = [r for r in attention if r["op"] == which]
        tag = which.replace("+", "_")
        plot(f"time_{tag}.png", part, lambda r: r["ms"], "ms", f"{which} time ({settings.dtype})")
        plot(f"memory_{tag}.png", part, lambda r: r["peak_mib"], "peak memory growth (MiB)",
             f"{which} peak memory ({settings.dtype})")
    decode = _section(records, "decode")
    plot("decode_step.png", decode, lambda r: r["ms"], "ms per token", "decoding step time", "context length")
    plot("decode_cache.png", decode, _cache_mib, "cache (MiB)", "decoding cache size", "context length")
    model = _section(records, "model")
    plot("model_tokens_per_s.png", model, lambda r: r.get("tokens_per_s"), "tokens/s",
         f"training throughput, {settings.model_preset} model")
    plot("model_memory.png", model, lambda r: r["peak_mib"], "peak memory growth (MiB)",
         f"training step peak memory, {settings.model_preset} model")
    return written


def write_records(path: Path, records: list[dict], info: dict, settings: Settings) -> None:
    """``{"machine": ..., "settings": ..., "records": [...]}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"machine": info, "settings": dataclasses.asdict(settings), "records": records})
