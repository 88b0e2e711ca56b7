"""The training data's order apart from the model's initialization, and the validation set's identity.

Megatron's --seed drives both the model's initialization (megatron.training.initialize) and, through
the dataset provider (launch.gpt), the GPTDataset's shuffling of documents and samples, which fixes
the training order and where the sample windows fall. MEGATRON_FP4_DATA_SEED, when set, replaces
--seed for the datasets only: two runs with different --seed and the same data seed start from
different weights and see the same batches in the same order (and the same validation samples).

With --full-validation (the whole validation split evaluated), the provider prints a SHA-256 of the
validation samples' tokens: runs that print the same hash were evaluated on the same samples.
"""

import hashlib
import os

import numpy

DATA_SEED_ENV = "MEGATRON_FP4_DATA_SEED"


def data_seed(args) -> int:
    """The datasets' random seed: MEGATRON_FP4_DATA_SEED if set, else --seed."""
    text = os.environ.get(DATA_SEED_ENV, "").strip()
    if not text:
        return args.seed
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{DATA_SEED_ENV}={text!r} is not an integer seed") from None


def samples_sha256(dataset) -> str:
    """SHA-256 over every sample's input tokens and labels, in the dataset's order."""
    digest = hashlib.sha256()
    for index in range(len(dataset)):
        sample = dataset[index]
        for key in ("tokens", "labels"):
            digest.update(numpy.ascontiguousarray(sample[key].numpy(), dtype="<i8").tobytes())
    return digest.hexdigest()


def validation_identity_line(dataset) -> str:
    """The log line the convergence harness reads (benchmarks/convergence/log.py)."""
    return f"> validation set: {len(dataset)} samples, sha256 {samples_sha256(dataset)}"


__all__ = ["DATA_SEED_ENV", "data_seed", "samples_sha256", "validation_identity_line"]
