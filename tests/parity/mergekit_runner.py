"""Run mergekit 0.1.5 in this process (installed by the test extra) and load its output.

mergekit is imported lazily and once: a merge of a tiny family then takes well under a second, where
a ``mergekit-yaml`` process would spend seconds importing transformers. Used by the parity suite
(tests/parity/): every method and config feature is run here and by MergePipe on the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from merge_helpers import load_dir

MERGEKIT_VERSION = "0.1.5"


def mergekit_merge(config: dict | str, out: Path, seed: int | None = None, copy_tokenizer: bool = False,
                   allow_crimes: bool = False) -> dict[str, torch.Tensor]:
    """Merge ``config`` (a mergekit YAML text or the parsed dict) into ``out`` with mergekit on the CPU
    and return every output tensor (``seed``: mergekit's --random-seed)."""
    import mergekit
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    assert getattr(mergekit, "__version__", MERGEKIT_VERSION) == MERGEKIT_VERSION
    data = yaml.safe_load(config) if isinstance(config, str) else config
    options = MergeOptions(copy_tokenizer=copy_tokenizer, lazy_unpickle=False, random_seed=seed, quiet=True,
                           write_model_card=False, allow_crimes=allow_crimes, num_threads=1)
    run_merge(MergeConfiguration.model_validate(data), str(out), options=options)
    return load_dir(out)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor max |a - b| (float64); the key sets must be equal."""
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:10]
    return {k: float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in sorted(a)}
