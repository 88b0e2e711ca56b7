"""--moe-fp4-telemetry in Megatron's own training log.

Megatron's training_log (megatron-core 0.18-0.19) asks the process's MoE metrics tracker
(megatron.core.transformer.moe.moe_logging, the one that reports the routers' auxiliary losses) for
the text it appends to the iteration log line, once per iteration on every rank, and hands it the
TensorBoard and W&B writers. `install` makes that tracker one that reports like Megatron's and
then ends the telemetry's step; at iterations that Megatron logs (--log-interval) it reads the
telemetry (a collective over all ranks, one host read), writes its scalars to the writers Megatron
passed and appends its fields to the line. Nothing of Megatron is patched: the tracker is set with
Megatron's own set_moe_metrics_tracker.
"""

import inspect

from megatron.core.transformer.moe.moe_logging import (
    MoEMetricsTracker,
    get_moe_metrics_tracker,
    set_moe_metrics_tracker,
)

from .. import telemetry
from ..options import FP4Options


class TrackerWithTelemetry(MoEMetricsTracker):
    def __init__(self, recorder: telemetry.Telemetry, log_interval: int):
        super().__init__()
        self.recorder = recorder
        self.log_interval = log_interval

    def report(self, *args, **kwargs) -> str:
        text = super().report(*args, **kwargs)
        call = inspect.signature(MoEMetricsTracker.report).bind(self, *args, **kwargs)
        iteration = call.arguments["iteration"]
        self.recorder.end_step()
        if iteration % self.log_interval:
            return text
        numbers = self.recorder.read()
        if numbers is None:
            return text
        writer, wandb_writer = call.arguments.get("writer"), call.arguments.get("wandb_writer")
        for name, value in numbers.scalars().items():
            if writer is not None:
                writer.add_scalar(name, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: value}, iteration)
        return text + numbers.log_text()


def install(args) -> bool:
    """With --moe-fp4-telemetry in Megatron's parsed `args`: report the telemetry through Megatron's
    MoE metrics tracker (keeping what it already tracks). Returns whether it did."""
    if not FP4Options.from_args(args).telemetry:
        return False
    current = get_moe_metrics_tracker()
    if isinstance(current, TrackerWithTelemetry):
        return True
    tracker = TrackerWithTelemetry(telemetry.recorder(), args.log_interval)
    tracker.metrics.update(current.metrics)
    set_moe_metrics_tracker(tracker)
    return True


__all__ = ["TrackerWithTelemetry", "install"]
