"""bench_proxy_memory's results: each run's log read into numbers (`measure`), those numbers as
result rows (`memory_rows`: bench proxy_memory, `throughput_rows`: bench proxy_throughput), and the
summary table."""

import statistics
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

from benchmarks import proxy_log
from benchmarks.proxy_runs import PRECISIONS, Run, RunResult
from benchmarks.rows import Recorder

ESTIMATE = "megatron-fp4 estimate (installed)"
MIB_PER_GIB = 1024.0


@dataclass(frozen=True)
class Estimate:
    peak_mib: float
    fits: Optional[bool]  # under the config's cluster.gpu_memory_gib


@dataclass
class Measured:
    run: Run
    outcome: str
    seconds: float
    cap_gib: Optional[float]  # the config's cluster.gpu_memory_gib (enforced only for a capped run)
    max_allocated_mib: Optional[float] = None
    max_reserved_mib: Optional[float] = None
    tokens_per_s: Optional[float] = None
    oom: Optional[proxy_log.OutOfMemory] = None
    estimate: Optional[Estimate] = None
    error: str = ""
    tokens_per_s_rounds: Tuple[float, ...] = ()  # with --rounds: each round's tokens/s (the median is tokens_per_s)

    @property
    def trained(self) -> bool:
        return self.outcome in proxy_log.TRAINED_OUTCOMES

    @property
    def case(self) -> str:
        where = f"under the {self.cap_gib:g} GiB cap" if self.run.capped else "uncapped"
        return f"proxy/{self.run.config}.yaml, {where}"


def measure(result: RunResult, cap_gib: Optional[float], seq_length: int, warmup: int, gpus: int = 1,
            estimate: Optional[Estimate] = None) -> Measured:
    log = result.log_path.read_text(errors="replace")
    m = Measured(result.run, result.outcome, result.seconds, cap_gib, estimate=estimate)
    peak = proxy_log.peak_memory(log)
    if peak and m.trained:
        m.max_allocated_mib, m.max_reserved_mib = peak.max_allocated_mib, peak.max_reserved_mib
        m.tokens_per_s = proxy_log.tokens_per_second(proxy_log.iteration_lines(log), seq_length, gpus, warmup)
    if m.outcome == proxy_log.OUT_OF_MEMORY:
        m.oom = proxy_log.out_of_memory(log)
    if not m.trained:
        m.error = proxy_log.last_error(log)
    return m


def merge_rounds(rounds: List[Measured]) -> Measured:
    """One run's rounds as one Measured: the first round that did not train, if any; else the median
    tokens/s (each round's kept in tokens_per_s_rounds), the largest peaks and the summed seconds."""
    if len(rounds) == 1:
        return rounds[0]
    failed = [m for m in rounds if not m.trained]
    if failed:
        return failed[0]
    tokens = tuple(m.tokens_per_s for m in rounds if m.tokens_per_s)

    def largest(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    return replace(rounds[0], seconds=sum(m.seconds for m in rounds),
                   max_allocated_mib=largest(m.max_allocated_mib for m in rounds),
                   max_reserved_mib=largest(m.max_reserved_mib for m in rounds),
                   tokens_per_s=statistics.median(tokens) if tokens else None, tokens_per_s_rounds=tokens)


def _extras(m: Measured) -> dict:
    extras = {"config": f"configs/proxy/{m.run.config}.yaml", "precision": m.run.precision, "scope": m.run.scope,
              "capped": m.run.capped, "cap_gib": m.cap_gib, "outcome": m.outcome, "seconds": round(m.seconds, 1)}
    if m.tokens_per_s_rounds:
        extras["tokens_per_s_rounds"] = [round(t, 1) for t in m.tokens_per_s_rounds]
    if m.estimate:
        extras.update(estimate_mib=round(m.estimate.peak_mib, 1), estimate_fits=m.estimate.fits)
    return extras


def _same_scope(measured: List[Measured], precision: str, scope: str, capped: bool) -> Optional[Measured]:
    """The trained run of `precision` at `scope`, preferring one with the same cap setting."""
    runs = [m for m in measured if m.trained and m.run.precision == precision and m.run.scope == scope]
    runs.sort(key=lambda m: m.run.capped != capped)
    return runs[0] if runs else None


def memory_rows(recorder: Recorder, measured: List[Measured]) -> None:
    """Per trained run its peak against the estimate; per capped run the allocator's peak (or, for
    an OOM, what it would have held) against the cap; FP4's peak against FP8's at the same scope."""
    for m in measured:
        extras = _extras(m)
        if m.trained and m.max_allocated_mib and m.estimate:
            recorder.add(m.case, "max allocated (Megatron's memory report)", m.max_allocated_mib, "MiB", ESTIMATE,
                         m.estimate.peak_mib, better="closer_to_1", max_reserved_mib=m.max_reserved_mib, **extras)
        if m.run.capped and m.cap_gib:
            held = m.max_reserved_mib if m.trained else (m.oom.demand_mib if m.oom else None)
            if held:
                metric = ("max reserved (Megatron's memory report)" if m.trained else
                          "reserved + the failed allocation (PyTorch's out-of-memory error)")
                recorder.add(m.case, metric, held, "MiB", "the cap (cluster.gpu_memory_gib)", m.cap_gib * MIB_PER_GIB,
                             better="lower", fits=m.trained, **extras)
        if m.run.precision == "fp4" and m.trained and m.max_allocated_mib:
            fp8 = _same_scope(measured, "fp8", m.run.scope, m.run.capped)
            if fp8 and fp8.max_allocated_mib:
                recorder.add(m.case, "max allocated vs FP8 at the same scope", m.max_allocated_mib, "MiB",
                             f"FP8: {fp8.case}", fp8.max_allocated_mib, better="lower", **extras)


def best_fitting(measured: List[Measured], precision: str) -> Optional[Measured]:
    """The precision's fastest run that trained under the cap."""
    runs = [m for m in measured if m.run.precision == precision and m.run.capped and m.trained and m.tokens_per_s]
    return max(runs, key=lambda m: m.tokens_per_s, default=None)


def throughput_rows(recorder: Recorder, measured: List[Measured], warmup: int) -> None:
    """Per trained FP8 / FP4 run its tokens/s against BF16 at the same scope, and per FP4 run against
    FP8 at the same scope (capped or not, the same setting preferred); per precision its best fitting
    run under the cap against FP8's."""
    metric = f"tokens/s per GPU (iterations after the first {warmup})"
    for m in measured:
        if m.run.precision == "bf16" or not m.tokens_per_s:
            continue
        against = ("bf16", "fp8") if m.run.precision == "fp4" else ("bf16",)
        for precision in against:
            other = _same_scope(measured, precision, m.run.scope, m.run.capped)
            if other and other.tokens_per_s:
                recorder.add(m.case, metric, m.tokens_per_s, "tokens/s", f"{precision.upper()}: {other.case}",
                             other.tokens_per_s, better="higher", **_extras(m))
    fp8 = best_fitting(measured, "fp8")
    if fp8 is None:
        return
    for precision in PRECISIONS:
        best = best_fitting(measured, precision)
        if best:
            recorder.add(f"best fitting under the cap, {precision.upper()}: {best.case}", metric, best.tokens_per_s,
                         "tokens/s", f"FP8's best fitting: {fp8.case}", fp8.tokens_per_s, better="higher",
                         **_extras(best))


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def summary(measured: List[Measured]) -> str:
    """One line per run: outcome, peak against estimate and cap, tokens/s (with --rounds the median,
    and each round's) against BF16 and, for FP4, FP8 at the scope."""
    header = ("config", "cap GiB", "outcome", "max alloc MiB", "estimate MiB", "meas/est", "max resv MiB",
              "tokens/s", "vs BF16", "vs FP8", "each round")
    rows = [header]

    def versus(m: Measured, precision: str) -> Optional[float]:
        other = _same_scope(measured, precision, m.run.scope, m.run.capped)
        return m.tokens_per_s / other.tokens_per_s if m.tokens_per_s and other and other.tokens_per_s else None

    for m in measured:
        ratio = (m.max_allocated_mib / m.estimate.peak_mib) if (m.max_allocated_mib and m.estimate) else None
        outcome = m.outcome + (f" ({m.oom.demand_mib:.0f} MiB wanted)" if m.oom and m.oom.demand_mib else "")
        rows.append((m.run.config, f"{m.cap_gib:g}" if m.run.capped and m.cap_gib else "none", outcome,
                     _cell(m.max_allocated_mib, ".0f"), _cell(m.estimate.peak_mib if m.estimate else None, ".0f"),
                     _cell(ratio, ".3f"), _cell(m.max_reserved_mib, ".0f"), _cell(m.tokens_per_s, ".0f"),
                     _cell(versus(m, "bf16"), ".3f"), _cell(versus(m, "fp8") if m.run.precision == "fp4" else None,
                                                            ".3f"),
                     " / ".join(f"{t:.0f}" for t in m.tokens_per_s_rounds) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    best = {p: best_fitting(measured, p) for p in PRECISIONS}
    lines.append("best fitting under the cap: " + ", ".join(
        f"{p.upper()} {b.run.config} {b.tokens_per_s:.0f} tokens/s" if b else f"{p.upper()} none"
        for p, b in best.items()))
    return "\n".join(lines)


__all__ = ["Estimate", "Measured", "best_fitting", "measure", "memory_rows", "merge_rounds", "summary",
           "throughput_rows"]
