"""Which runs, and which BF16 run each is compared with.

A run is "NAME CONFIG SEED [data_seed=N] [FLAGS ...]". CONFIG is a name in configs/convergence/
("fp4", "h512/fp4"), a path under it ("h512/fp4.yaml"), or a path to a YAML file (absolute, or
relative to the working directory or to the repository: config_candidates). SEED sets the
initialization; the data order (the GPTDataset shuffle and the sample windows, validation included)
follows data_seed when given (MEGATRON_FP4_DATA_SEED, launch/data_order.py), else SEED.

Each run is compared with a BF16 run of its proxy (bf16.yaml in the folder of its config) trained on
the same data order: the BF16 run whose flags are all among the run's own flags, the one with the
most of them. So runs that share flags (`--split 980,20,0` on one's own corpus) are compared with
the BF16 run with those flags, and a run with a setting of its own (`--moe-fp4-storage experts`)
with the BF16 run without it. A BF16 run with flags is compared with a BF16 run with fewer flags
where there is one (a changed learning rate against the plain run), else it is the reference of
its flags.
"""

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "convergence"
REFERENCE_CONFIG = "bf16"
SEEDS = (1234, 5678, 9012, 3456)
CORPUS_JSON = "corpus.json"  # in the out dir: the corpus record the rows need (from-logs)
HARNESS_JSON = "harness.json"  # in the out dir: the rows' run info, the iterations and the runs
LOG_NAME = "train_node0.log"  # each run's log in its run directory


class RunSpecError(ValueError):
    """A run spec that names no run: one sentence."""


def config_candidates(config: str) -> List[Path]:
    """Where CONFIG is looked for, in order: a name without .yaml in configs/convergence/; a path
    ending .yaml as given (relative to the working directory), then under configs/convergence/, then
    under the repository ("configs/convergence/h512/fp4.yaml" from anywhere)."""
    given = Path(config)
    if given.suffix != ".yaml":
        return [CONFIGS / f"{config}.yaml"]
    if given.is_absolute():
        return [given]
    return list(dict.fromkeys([Path.cwd() / given, CONFIGS / given, REPO / given]))


def resolve_config(config: str) -> Path:
    """CONFIG as the file a run trains with; RunSpecError naming the paths tried when none exists."""
    tried = config_candidates(config)
    for path in tried:
        if path.is_file():
            return path.resolve()
    raise RunSpecError(f"config {config} not found: tried {', '.join(str(path) for path in tried)}")


def reference_config_of(config: str) -> str:
    """The BF16 config a config's runs are compared with: bf16.yaml in its folder ("h512/fp4.yaml" ->
    "h512/bf16.yaml"; each proxy size has its own)."""
    return str(Path(config).with_name(f"{REFERENCE_CONFIG}.yaml"))


def flag_set(flags: Iterable[str]) -> FrozenSet[Tuple[str, Tuple[str, ...]]]:
    """Flags as a set of (option, its values): `--split 980,20,0` and `--split=980,20,0` are one
    element, and their order does not matter."""
    groups: List[list] = []
    for word in flags:
        if word.startswith("--"):
            name, equals, value = word.partition("=")
            groups.append([name.replace("_", "-"), [value] if equals else []])
        elif groups:
            groups[-1][1].append(word)
        else:
            groups.append(["", [word]])
    return frozenset((name, tuple(values)) for name, values in groups)


@dataclass(frozen=True)
class Run:
    name: str
    config: str
    seed: int
    data_seed: Optional[int] = None  # None: the data order follows the seed
    flags: tuple = field(default_factory=tuple)

    @property
    def order(self) -> int:
        """The seed of the data order."""
        return self.seed if self.data_seed is None else self.data_seed

    def config_path(self) -> Path:
        return resolve_config(self.config)

    @property
    def config_name(self) -> str:
        """The config as the rows name it: its path under configs/convergence/ ("fp4.yaml",
        "h512/fp4.yaml"), else its file name."""
        path = self.config_path()
        return str(path.relative_to(CONFIGS)) if path.is_relative_to(CONFIGS) else path.name

    @property
    def reference_config(self) -> str:
        return reference_config_of(self.config_name)

    @property
    def is_bf16(self) -> bool:
        """A BF16 run of its proxy whose data order follows its seed: a possible reference."""
        return self.config_name == self.reference_config and self.data_seed is None


def _catalogue() -> Dict[str, Run]:
    first, second = SEEDS[:2]
    runs = [Run(precision, precision, first) for precision in ("bf16", "fp8", "fp4")]
    # Seeds 2, 3, 4: each seed's runs differ from the first seed's in initialization and data order.
    runs += [Run(f"{precision}_seed{n}", precision, seed)
             for n, seed in enumerate(SEEDS[1:], 2) for precision in ("bf16", "fp8", "fp4")]
    runs += [Run("bf16_repeat", "bf16", first),  # the kernels' nondeterminism
             Run("bf16_init2", "bf16", second, data_seed=first)]  # another init, the same data order
    runs += [Run(name, name, first) for name in ("fp4_dispatch", "fp4_dispatch_experts", "fp4_dispatch_experts_linears")]
    # The FP8 linears by role: attention, or the dense MLP and shared expert, left to BF16.
    runs += [Run(f"{precision}_bf16_{role}", f"{precision}_bf16_{role}", first)
             for precision in ("fp8", "fp4") for role in ("attention", "mlps")]
    # The FP8 linears' backward GEMMs in BF16, at the first two seeds.
    runs += [Run(f"{precision}_bf16_grads{suffix}", f"{precision}_bf16_grads", seed)
             for precision in ("fp8", "fp4") for suffix, seed in (("", first), ("_seed2", second))]
    return {run.name: run for run in runs}


CATALOGUE = _catalogue()
DEFAULT_RUNS = ("bf16", "fp8", "fp4", "bf16_seed2", "fp8_seed2", "fp4_seed2", "bf16_repeat", "bf16_init2",
                "fp4_dispatch", "fp4_dispatch_experts")


def _in_configs(config: str) -> Path:
    given = Path(config)
    return CONFIGS / (given if given.suffix == ".yaml" else f"{config}.yaml")


def parse_run_spec(text: str) -> Run:
    """"NAME CONFIG SEED [data_seed=N] [FLAGS ...]" -> Run; RunSpecError for a malformed spec or a
    config that does not exist. A config found elsewhere than under configs/convergence/ is kept as
    its absolute path (the runs start in the repository, and from-logs may read the spec elsewhere)."""
    words = shlex.split(text)
    if len(words) < 3 or not words[2].lstrip("-").isdigit():
        raise RunSpecError(f"run spec {text!r}: expected 'NAME CONFIG SEED [data_seed=N] [FLAGS ...]'")
    try:
        path = resolve_config(words[1])
    except RunSpecError as error:
        raise RunSpecError(f"run spec {text!r}: {error}") from None
    config = words[1] if path == _in_configs(words[1]).resolve() else str(path)
    data_seed, flags = None, words[3:]
    if flags and flags[0].startswith("data_seed="):
        data_seed, flags = int(flags[0].split("=", 1)[1]), flags[1:]
    return Run(words[0], config, int(words[2]), data_seed, tuple(flags))


def spec(run: Run) -> str:
    """The run as parse_run_spec reads it."""
    data_seed = [f"data_seed={run.data_seed}"] if run.data_seed is not None else []
    return shlex.join([run.name, run.config, str(run.seed), *data_seed, *run.flags])


def closest_bf16(run: Run, candidates: Sequence[Run]) -> Optional[Run]:
    """The BF16 run among `candidates` that `run` is compared with: of its proxy and data order, with
    flags all among the run's (for a BF16 run with flags: fewer than its own), the most of them; the
    first such run on a tie. None when there is none."""
    mine = flag_set(run.flags)
    fewer_only = run.is_bf16 and bool(mine)
    best, best_size = None, -1
    for candidate in candidates:
        if not (candidate.is_bf16 and candidate.reference_config == run.reference_config
                and candidate.seed == run.order):
            continue
        theirs = flag_set(candidate.flags)
        if (theirs < mine if fewer_only else theirs <= mine) and len(theirs) > best_size:
            best, best_size = candidate, len(theirs)
    return best


def matched_references(runs: Sequence[Run]) -> Dict[str, Run]:
    """Each run's BF16 reference among `runs` by closest_bf16; runs without one are left out."""
    chosen = {}
    for run in runs:
        reference = closest_bf16(run, runs)
        if reference is not None:
            chosen[run.name] = reference
    return chosen


def own_references(runs: Sequence[Run], unmatched: Iterable[str]) -> Dict[str, Run]:
    """For the BF16 runs with flags among `unmatched` (no BF16 run with fewer flags found): the first
    BF16 run of the same proxy, seed and flags, the run itself at the latest."""
    names = set(unmatched)
    chosen = {}
    for run in runs:
        if run.name in names and run.is_bf16:
            chosen[run.name] = next(other for other in runs if other.is_bf16
                                    and other.reference_config == run.reference_config and other.seed == run.seed
                                    and flag_set(other.flags) == flag_set(run.flags))
    return chosen


def references(runs: Sequence[Run]) -> Dict[str, Run]:
    """Each run's BF16 reference among `runs` (the module's docstring says which); runs without one
    are left out."""
    chosen = matched_references(runs)
    chosen.update(own_references(runs, [run.name for run in runs if run.name not in chosen]))
    return chosen


def role(run: Run, reference: Run) -> str:
    if run is reference:
        return "reference"
    if run.config_name != run.reference_config or flag_set(run.flags) != flag_set(reference.flags):
        return "compared"
    return "noise: repeat (same seed, same data)" if run.seed == reference.seed else "noise: init (same data order)"


def read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def invocation_runs(run_dir: Path) -> List[Run]:
    """The runs of the invocation that wrote `run_dir`: those its harness.json names, else the
    catalogue's runs that have a log there."""
    recorded = read_json(run_dir / HARNESS_JSON)
    if recorded is not None:
        return [parse_run_spec(text) for text in recorded["runs"]]
    return [run for name, run in CATALOGUE.items() if (run_dir / name / LOG_NAME).exists()]
