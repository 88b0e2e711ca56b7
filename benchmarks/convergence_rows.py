"""BF16 references from stored rows, for runs trained without their BF16 run in the same invocation.

A device call returns its rows reliably but not always its logs (the number of files that come back
is limited), and a call that trains only candidate runs fits one more of them. The rows of a plain
BF16 run (`role` "reference": its own reference) hold what a comparison needs: its final validation
loss in convergence.jsonl and its logged training losses in convergence_curves.jsonl, with the
validation set's and the corpus's SHA-256 to check that the comparison is like for like.
"""

import json
from pathlib import Path
from typing import List, NamedTuple, Optional

from benchmarks.convergence_log import Point, RunLog

FINAL_LOSS = "final validation loss (whole split)"
REFERENCE_CONFIG = "bf16"


def reference_config_of(config: str) -> str:
    """The BF16 config a config's runs are compared with: bf16.yaml in its folder ("h512/fp4.yaml" ->
    "h512/bf16.yaml"; each proxy size has its own)."""
    return str(Path(config).with_name(f"{REFERENCE_CONFIG}.yaml"))


class StoredReference(NamedTuple):
    name: str  # the BF16 run's name in the rows
    log: RunLog  # what its rows say of its log
    origin: str  # which rows: "commit C, run R"


def read_rows(path: Path) -> List[dict]:
    """The rows of a .jsonl file, none when it does not exist."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def stored_reference(results: Path, config: str, data_order: int, iters: int, validation_sha256: Optional[str],
                     corpus_sha256: str) -> Optional[StoredReference]:
    """The latest plain BF16 run of the config `config` (its path under configs/convergence/, as the
    rows name it: "bf16.yaml", "h512/bf16.yaml"), data order `data_order` and `iters` iterations among the rows in
    the folder `results` that was evaluated on the validation set `validation_sha256` of the corpus
    `corpus_sha256`, or None. (The whole-split validation set does not depend on the run's length:
    a short run of the same seed shares it, hence the iterations.)"""
    if validation_sha256 is None:
        return None
    finals = [row for row in read_rows(results / "convergence.jsonl")
              if row["metric"] == FINAL_LOSS and row.get("role") == "reference" and row.get("config") == config
              and row.get("seed") == data_order
              and row.get("iters") == iters and row.get("validation_sha256") == validation_sha256
              and row.get("corpus_sha256") == corpus_sha256]
    if not finals:
        return None
    final = max(finals, key=lambda row: row["run"])
    curve = sorted((row["iteration"], row["value"]) for row in read_rows(results / "convergence_curves.jsonl")
                   if row["case"] == final["case"] and row["run"] == final["run"] and row["metric"] == "lm loss")
    log = RunLog(points=[Point(iteration, loss) for iteration, loss in curve], total_iterations=final.get("iters"),
                 final_validation_loss=final["value"], validation_samples=final.get("validation_samples"),
                 validation_sha256=validation_sha256)
    return StoredReference(final["case"], log, f"commit {final['commit']}, run {final['run']}")
