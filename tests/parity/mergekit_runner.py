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


def config_merge_both(cat, work: Path, cfg: dict, name: str):
    """``cfg`` merged by mergekit into ``work/mk-<name>`` (without MergePipe's own ``mergepipe:`` key) and by
    ``api.merge_config`` into ``work/mp-<name>``: (plan, manifest, MergePipe's tensors, mergekit's tensors)."""
    from mergepipe import api
    from mergepipe.config.parse import parse_config

    ref = mergekit_merge({k: v for k, v in cfg.items() if k != "mergepipe"}, work / f"mk-{name}")
    plan, _, manifest = api.merge_config(cat, parse_config(yaml.safe_dump(cfg)), work / f"mp-{name}",
                                         model_id=f"mp-{name}")
    return plan, manifest, load_dir(work / f"mp-{name}"), ref


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor max |a - b| (float64); the key sets must be equal."""
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:10]
    return {k: float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in sorted(a)}


# --- the three-expert parameter family and side-by-side merges of test_parity_params / _tensor_params ------
PARAM_WEIGHTS = [0.6, 1.3, 0.35]
PARAM_DENSITY = 0.5


def params_family(tmp_path_factory, tag: str) -> dict:
    """A tiny fp32 family of three experts, registered and analyzed on a 4 KiB grid; its paths, catalog and
    tensors (the caller closes ``cat``)."""
    from mergepipe.api import analyze
    from mergepipe.catalog.db import Catalog
    from mergepipe.catalog.models import register
    from mergepipe.research.family import make_family

    root = tmp_path_factory.mktemp(tag)
    paths = make_family(root / "fam", experts=3, size="tiny", dtype="fp32", shard_bytes=1 << 30, seed=5)
    cat = Catalog(root / "c.sqlite")
    register(cat, "base", paths["base"])
    for i, e in enumerate(paths["experts"], start=1):
        register(cat, f"e{i}", e, base_id="base")
    analyze(cat, block_bytes=4096)
    return {"root": root, "cat": cat, "base": paths["base"], "experts": paths["experts"],
            "base_t": load_dir(paths["base"]), "experts_t": [load_dir(e) for e in paths["experts"]]}


def params_config(fam, method, per_model: dict | None = None, experts=(0, 1, 2), weights=PARAM_WEIGHTS,
                  parameters=None) -> dict:
    """A mergekit config of the family's experts (weights, density 0.5, per-model settings, seed 7)."""
    models = []
    for j, i in enumerate(experts):
        p = {"weight": weights[j], "density": PARAM_DENSITY}
        p.update({k: v[j] for k, v in (per_model or {}).items()})
        models.append({"model": fam["experts"][i], "parameters": p})
    cfg = {"merge_method": method, "base_model": fam["base"], "dtype": "float32", "models": models,
           "mergepipe": {"seed": 7}}
    if parameters:
        cfg["parameters"] = parameters
    return cfg


def merge_both(fam, cfg: dict, tag: str, mergekit: bool = True):
    """(plan, MergePipe's tensors, mergekit's tensors or None) of one config, each merged into ``root/tag``."""
    from mergepipe.api import merge_config
    from mergepipe.config.parse import parse_config

    out = fam["root"] / tag
    out.mkdir()
    plan, _, _ = merge_config(fam["cat"], parse_config(yaml.safe_dump(cfg)), out / "mp", model_id=tag)
    theirs = None
    if mergekit:
        theirs = mergekit_merge({k: v for k, v in cfg.items() if k != "mergepipe"}, out / "mk", seed=7)
    return plan, load_dir(out / "mp"), theirs
