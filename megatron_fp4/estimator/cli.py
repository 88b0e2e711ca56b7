"""`megatron-fp4 estimate`: the subcommand's parser and its run function."""

import argparse
import sys
import textwrap

import yaml

from ..console import fail
from ..options import UnsupportedConfiguration
from ..run_config import ConfigError, load_config, validate_config
from .core import apply_overrides, estimate
from .plot import PlotPathError, PlotUnavailable, check_plot_path, plot
from .report import FP4_MEMORY_ROWS, as_json, detail, table
from .shapes import EstimateError

DESCRIPTION = """\
Estimate per-GPU memory and expert-parallel all-to-all traffic of YAML run configs, without a GPU.
A config that a launch would refuse (--set overrides included) is refused here too: one sentence,
exit status 2.

Memory per GPU, on the pipeline rank with the largest peak:
  weights    parameters in the model dtype (+ the FP8 copies of the FP8 GEMMs' weights: two per
             Transformer Engine GEMM weight, row- and column-wise; one, W, per weight of our FP8
             linears and experts)
  grads      main gradients (main_grads_dtype, fp32 by default)
  optim      Adam master weights and moments on the GPU (distributed optimizer: sharded over data
             parallelism, expert parameters over expert data parallelism; less what
             optimizer_cpu_offload moves to the host)
  activ      saved activations of the micro-batches the pipeline schedule holds at its worst
             point (an inventory of Megatron-Core's saved tensors per layer, less what
             recompute_modules recomputes)
  transient  one layer's backward working set (its MLP or attention backward: what that recompute
             restores + two of its largest tensors, or unfused attention's score-sized buffers and
             gradients, + the W^T our FP8 layers make for their largest data-gradient GEMM unless
             --moe-fp4-keep-transposed-weights keeps it in weights; less
             what the backward has freed by then), the logits during the loss, persistent
             attention buffers
  peak       the sum, in GiB (2^30 bytes): comparable with Megatron's "max allocated", not with
             "reserved"
  device     device-level rows outside max allocated (assumptions, docs/estimator.md): the CUDA
             context, NCCL's buffers, DeepEP's buffers (flex dispatcher), the caching allocator's
             reserve (a fraction of the peak)
  GPU GiB    peak + device: what a GPU monitor shows; % GPU and fits compare it with the config's
             cluster.gpu_memory_gib ('tight': fits only if the allocator gives its reserve back)
a2a: GB (10^9 bytes) one GPU sends per step through the MoE dispatch and combine all-to-alls,
forward and backward, and again for `moe` recompute; under the flex dispatcher on DeepEP one row
per token and destination rank (the expected distinct ranks of uniform top-k routing), else one
per routed expert.

{fp4_rows}

Not modeled: routing imbalance (experts assumed to receive k*T rows on average), and the code paths
of Megatron options the configs here do not use. Assumptions and validation: docs/estimator.md.
""".format(fp4_rows=textwrap.fill(
    "For an fp4 config (moe_fp4_dispatch: true) two rows (--fp4-memory): " + FP4_MEMORY_ROWS, width=100,
    break_on_hyphens=False))  # flags stay whole


def _parse_set(text: str):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip().replace("-", "_"), yaml.safe_load(value)


def register(subparsers) -> None:
    parser = subparsers.add_parser("estimate", help="per-GPU memory and all-to-all bytes of YAML run configs",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", metavar="CONFIG", help="YAML run config(s)")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per row) instead of the table")
    parser.add_argument("--fp4-memory", choices=("both", "recipe", "installed"), default="both",
                        help="for fp4 configs: the paper's recipe, what the installed package delivers, or both "
                             "(default)")
    parser.add_argument("--set", dest="overrides", action="append", type=_parse_set, default=[], metavar="KEY=VALUE",
                        help="override a flag of every config (YAML value), e.g. --set optimizer_cpu_offload=true; "
                             "repeatable")
    parser.add_argument("--detail", action="store_true",
                        help="after the table, each row's per-rank peaks and one micro-batch's activations by tensor")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw each row's peak memory per GPU as a bar stacked by part (weights, gradients, "
                             "optimizer, activations, transient) against the GPU's memory; the suffix picks the "
                             "format (.png, .svg, .pdf, or another that matplotlib writes); its folder must exist. "
                             "Needs matplotlib (pip install 'megatron_fp4[plot]')")
    parser.set_defaults(run=run)


def run(args) -> int:
    if args.plot:
        try:  # before the estimates, which take a while
            check_plot_path(args.plot)
        except (PlotUnavailable, PlotPathError) as err:
            return fail(str(err))
    modes = ("recipe", "installed") if args.fp4_memory == "both" else (args.fp4_memory,)
    overrides = dict(args.overrides)
    estimates = []
    try:
        for path in args.configs:
            # Refuse what a launch of this config would refuse (the plan is for another machine).
            validate_config(apply_overrides(load_config(path), overrides))
            first = estimate(path, modes[0], overrides)
            estimates.append(first)
            if first.precision.name == "fp4" and len(modes) > 1:
                estimates.append(estimate(path, modes[1], overrides))
    except (ConfigError, EstimateError, UnsupportedConfiguration) as err:
        return fail(str(err))
    if args.json:
        print(as_json(estimates))
    else:
        print(table(estimates))
        if args.detail:
            for e in estimates:
                print()
                print(detail(e))
    if args.plot:
        try:
            written = plot(estimates, args.plot)
        except OSError as err:  # the folder changed since the check
            return fail(f"cannot write --plot {args.plot}: {err.strerror or err}")
        print(f"plot: {written}", file=sys.stderr if args.json else sys.stdout)
    return 0
