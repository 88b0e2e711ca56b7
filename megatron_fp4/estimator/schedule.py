"""How many micro-batches' activations a pipeline rank holds at once, from the order Megatron's
schedules (megatron/core/pipeline_parallel/schedules.py) run forwards and backwards in.

- No pipeline (PP 1): forward then backward of each micro-batch: one in flight.
- 1F1B (PP > 1, no virtual stages): rank r runs PP - r - 1 warm-up forwards, then alternates one
  forward and one backward: at most PP - r micro-batches held.
- Interleaved 1F1B (virtual stages): forwards follow the schedule table (groups of
  `microbatch_group_size_per_vp_stage` micro-batches, default PP, through chunk 0, 1, ...), backwards
  the same table with chunks reversed; rank r runs (PP - r - 1) * 2 + (VPP - 1) * group warm-up
  forwards, then one forward and one backward per step. Chunks hold different layers, so the
  estimator replays the order and takes the largest sum of held chunks' activations.
"""

from collections.abc import Sequence


def schedule_table(num_microbatches: int, num_chunks: int, group: int) -> list[int]:
    """Model chunk of each forward, in order (Megatron's get_schedule_table)."""
    chunks = []
    for start in range(0, num_microbatches, group):
        size = min(group, num_microbatches - start)
        for chunk in range(num_chunks):
            chunks += [chunk] * size
    return chunks


def warmup_forwards(pp: int, rank: int, vpp: int, group: int, total: int) -> int:
    if pp == 1:
        return 0
    warmup = pp - rank - 1 if vpp == 1 else (pp - rank - 1) * 2 + (vpp - 1) * group
    return min(warmup, total)


def peak_held(chunk_bytes: Sequence[float], pp: int, rank: int, num_microbatches: int, group: int = 0,
              forward_extra: Sequence[float] = (), backward_extra: Sequence[float] = ()) -> tuple[float, float, list[int]]:
    """The worst point of this rank's schedule: (saved activations held then, transient on top,
    micro-batches held per chunk then).

    chunk_bytes[c]: one micro-batch's saved activations of chunk c; forward_extra[c]: transient
    memory at the end of a forward of chunk c (on top of everything held, that micro-batch
    included); backward_extra[c]: transient memory while a backward of chunk c runs (before its
    activations are released)."""
    vpp = len(chunk_bytes)
    forward_extra = list(forward_extra) or [0.0] * vpp
    backward_extra = list(backward_extra) or [0.0] * vpp
    group = group or pp
    if pp == 1:  # forward of every chunk, then backward from the last chunk
        held = sum(chunk_bytes)
        return held, max(max(forward_extra), max(backward_extra)), [1] * vpp
    if vpp == 1:
        n = min(pp - rank, num_microbatches)
        return n * chunk_bytes[0], max(forward_extra[0], backward_extra[0]), [n]
    table = schedule_table(num_microbatches, vpp, group)
    total = len(table)
    warmup = warmup_forwards(pp, rank, vpp, group, total)
    held = [0] * vpp
    best = (-1.0, 0.0, [])

    def consider(extra):
        nonlocal best
        now = sum(h * b for h, b in zip(held, chunk_bytes))
        if now + extra > best[0] + best[1]:
            best = (now, extra, list(held))

    for k in range(warmup):
        held[table[k]] += 1
        consider(forward_extra[table[k]])
    for k in range(total - warmup):
        forward = table[k + warmup]
        held[forward] += 1  # one forward ...
        consider(forward_extra[forward])
        backward = vpp - 1 - table[k]
        consider(backward_extra[backward])
        held[backward] -= 1  # ... then one backward
    return best
