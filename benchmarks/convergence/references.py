"""Each run's BF16 reference: among the runs of the invocation (runs.py), else from another
invocation's out dir (`from-logs --reference-from DIR`), else from stored rows (`--reference-rows
DIR`).

Stored rows: a device call returns its rows reliably but not always its logs (the number of files
that come back is limited), and a call that trains only candidate runs fits one more of them. The
rows of a BF16 run that was its own reference (`role` "reference") hold what a comparison needs: its
final validation loss in convergence.jsonl and its logged training losses in
convergence_curves.jsonl, with the validation set's and the corpus's SHA-256 to check that the
comparison is like for like.
"""

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

from benchmarks.convergence.log import Point, RunLog, read_log
from benchmarks.convergence.runs import (CORPUS_JSON, Run, closest_bf16, flag_set, invocation_runs,
                                         matched_references, own_references, read_json)

FINAL_LOSS = "final validation loss (whole split)"


@dataclass
class Reference:
    """A run's BF16 reference: a run of the same invocation, or of another one (`source`, the out dir
    of --reference-from, or `rows_of`, which stored rows of --reference-rows)."""
    run: Run
    log: RunLog
    source: Optional[Path] = None
    rows_of: Optional[str] = None

    @property
    def other_invocation(self) -> bool:
        return self.source is not None or self.rows_of is not None

    @property
    def label(self) -> str:
        return f"BF16 {self.run.name}" + (" (another invocation)" if self.other_invocation else "")


class StoredReference(NamedTuple):
    name: str  # the BF16 run's name in the rows
    flags: tuple  # its flags
    log: RunLog  # what its rows say of its log
    origin: str  # which rows: "commit C, run R"


def read_rows(path: Path) -> List[dict]:
    """The rows of a .jsonl file, none when it does not exist."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def stored_reference(results: Path, config: str, data_order: int, iters: int, validation_sha256: Optional[str],
                     corpus_sha256: str, flags: Sequence[str] = (), fewer_only: bool = False
                     ) -> Optional[StoredReference]:
    """The BF16 reference among the rows in the folder `results` for a run of `flags`: a BF16 run that
    was its own reference, of the config `config` (its path under configs/convergence/, as the rows
    name it: "bf16.yaml", "h512/bf16.yaml"), data order `data_order` and `iters` iterations,
    evaluated on the validation set `validation_sha256` of the corpus `corpus_sha256`, with flags all
    among `flags` (fewer of them with `fewer_only`): the most flags, then the latest; or None. (The
    whole-split validation set does not depend on the run's length: a short run of the same seed
    shares it, hence the iterations.)"""
    if validation_sha256 is None:
        return None
    mine = flag_set(flags)

    def fits(row: dict) -> bool:
        theirs = flag_set(row.get("flags") or ())
        return theirs < mine if fewer_only else theirs <= mine

    finals = [row for row in read_rows(results / "convergence.jsonl")
              if row["metric"] == FINAL_LOSS and row.get("role") == "reference" and row.get("config") == config
              and row.get("seed") == data_order
              and row.get("iters") == iters and row.get("validation_sha256") == validation_sha256
              and row.get("corpus_sha256") == corpus_sha256 and fits(row)]
    if not finals:
        return None
    final = max(finals, key=lambda row: (len(flag_set(row.get("flags") or ())), row["run"]))
    curve = sorted((row["iteration"], row["value"]) for row in read_rows(results / "convergence_curves.jsonl")
                   if row["case"] == final["case"] and row["run"] == final["run"] and row["metric"] == "lm loss")
    log = RunLog(points=[Point(iteration, loss) for iteration, loss in curve], total_iterations=final.get("iters"),
                 final_validation_loss=final["value"], validation_samples=final.get("validation_samples"),
                 validation_sha256=validation_sha256)
    return StoredReference(final["case"], tuple(final.get("flags") or ()), log,
                           f"commit {final['commit']}, run {final['run']}")


def resolve_references(runs: List[Run], logs: Dict[str, RunLog], reference_dir: Optional[Path] = None,
                       corpus_sha256: Optional[str] = None, reference_rows: Optional[Path] = None,
                       iters: Optional[int] = None) -> Dict[str, Reference]:
    """Each run's reference: among `runs` (runs.closest_bf16); for a run without one, the BF16 run of
    its data order in `reference_dir` (another invocation), when its validation set has the same
    SHA-256 (and its corpus, where that directory's corpus.json says, the same SHA-256); failing that,
    the latest such run of `iters` iterations among the stored rows in the folder `reference_rows`;
    failing that, a BF16 run with flags is the reference of its flags (runs.own_references)."""
    chosen = {name: Reference(run, logs[run.name]) for name, run in matched_references(runs).items()}
    if reference_dir is not None:
        chosen.update(_references_from_logs(runs, logs, chosen, reference_dir, corpus_sha256))
    if reference_rows is not None and corpus_sha256 is not None and iters is not None:
        chosen.update(_references_from_rows(runs, logs, chosen, reference_rows, corpus_sha256, iters))
    unmatched = [run.name for run in runs if run.name not in chosen]
    chosen.update({name: Reference(run, logs[run.name]) for name, run in own_references(runs, unmatched).items()})
    for run in runs:
        if run.name not in chosen:
            flags = f"flags among its own ({shlex.join(run.flags)})" if run.flags else "no flags"
            print(f"{run.name}: no BF16 run of its proxy ({run.reference_config}) with data order {run.order} and "
                  f"{flags}: no comparison rows")
    return chosen


def _references_from_rows(runs: List[Run], logs: Dict[str, RunLog], chosen: Dict[str, Reference], results: Path,
                          corpus_sha256: str, iters: int) -> Dict[str, Reference]:
    """resolve_references' references from stored rows, for the runs not in `chosen`."""
    found = {}
    for run in runs:
        if run.name in chosen:
            continue
        stored = stored_reference(results, run.reference_config, run.order, iters, logs[run.name].validation_sha256,
                                  corpus_sha256, run.flags, fewer_only=run.is_bf16 and bool(run.flags))
        if stored is None:
            print(f"{run.name}: no BF16 run ({run.reference_config}) of data order {run.order} and {iters} "
                  f"iterations on its validation set in the rows of {results} either")
            continue
        reference_config = str(Path(run.reference_config).with_suffix(""))
        found[run.name] = Reference(Run(stored.name, reference_config, run.order, flags=stored.flags), stored.log,
                                    rows_of=stored.origin)
    return found


def _references_from_logs(runs: List[Run], logs: Dict[str, RunLog], chosen: Dict[str, Reference], reference_dir: Path,
                          corpus_sha256: Optional[str]) -> Dict[str, Reference]:
    """resolve_references' references from another invocation's out dir, for the runs not in `chosen`."""
    found_refs = {}
    candidates = [run for run in invocation_runs(reference_dir) if run.is_bf16]
    other_corpus = read_json(reference_dir / CORPUS_JSON)
    for run in runs:
        if run.name in chosen:
            continue
        found = closest_bf16(run, candidates)
        if found is None:
            print(f"{run.name}: no BF16 run ({run.reference_config}) of data order {run.order} in {reference_dir} "
                  "either")
            continue
        ref_log = read_log(reference_dir / found.name)
        where = f"BF16 {found.name} of {reference_dir}"
        if other_corpus and corpus_sha256 and other_corpus["sha256"] != corpus_sha256:
            print(f"{run.name}: no comparison with {where}: it trained on another corpus "
                  f"(sha256 {other_corpus['sha256'][:16]}, not {corpus_sha256[:16]}).")
        elif ref_log.validation_sha256 is None or ref_log.validation_sha256 != logs[run.name].validation_sha256:
            print(f"{run.name}: no comparison with {where}: its validation set (sha256 "
                  f"{(ref_log.validation_sha256 or 'not logged')[:16]}) is not this run's "
                  f"({(logs[run.name].validation_sha256 or 'not logged')[:16]}).")
        else:
            found_refs[run.name] = Reference(found, ref_log, reference_dir)
    return found_refs
