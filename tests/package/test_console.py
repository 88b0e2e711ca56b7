"""megatron_fp4.console: our entry points quiet the import-time notices of megatron-core and torch
named there, and nothing else; only the entry points do (a library import of megatron_fp4 changes
no warning filter)."""

import logging
import re
import warnings
from pathlib import Path

from megatron_fp4 import console

ROOT = Path(__file__).resolve().parents[2]


def test_only_the_named_notices_are_quieted(caplog):
    with warnings.catch_warnings(record=True) as seen:  # the filters come back afterwards
        warnings.simplefilter("always")
        console.quiet_third_party_notices()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
        warnings.warn("Only transformer-engine>=1.7.0 supports MoE experts, but your version is 0.0.0.", UserWarning)
        warnings.warn("absl.logging is not installed. Using logging.getLogger(__name__) instead.", UserWarning)
        warnings.warn("a user's own warning about Apex is not installed", UserWarning)
        warnings.warn("Apex is not installed, said as a deprecation", DeprecationWarning)
    assert [str(w.message) for w in seen] == ["a user's own warning about Apex is not installed",
                                              "Apex is not installed, said as a deprecation"]
    logger = logging.getLogger("torch.utils.cpp_extension")
    try:
        with caplog.at_level(logging.WARNING):
            logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
            logger.warning("Another cpp_extension warning")
        assert [record.getMessage() for record in caplog.records] == ["Another cpp_extension warning"]
    finally:
        logger.removeFilter(console._not_the_cuda_runtime_notice)


def test_only_entry_points_quiet_them():
    sources = [*ROOT.glob("megatron_fp4/**/*.py"), *ROOT.glob("scripts/*")]
    callers = sorted(str(path.relative_to(ROOT)) for path in sources
                     if re.search(r"^\s*quiet_third_party_notices\(\)", path.read_text(), re.M))
    assert callers == ["megatron_fp4/cli.py", "megatron_fp4/launch/__main__.py", "megatron_fp4/launch/torchrun.py",
                       "scripts/pretrain_gpt_fp4.py"]
