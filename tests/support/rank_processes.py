"""Run one command per rank as fresh processes, all at once, and collect what they printed."""

import subprocess
import tempfile
from pathlib import Path


def run_ranks(commands, cwd, env, timeout_s: int):
    """(exit codes, outputs) of `commands` (one argv per rank) run side by side, stdout and stderr
    together; a rank still running after timeout_s is killed and its code is a sentence saying so."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(len(commands))]
        ranks = [subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
                 for argv, log in zip(commands, logs)]
        codes = []
        try:
            for rank in ranks:
                codes.append(rank.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            codes.append(f"timed out after {timeout_s} s")
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    return codes, outputs
