"""Weight-space fidelity: the deviation of a merge from a reference merge (||M - R||, relative to ||R||
and to the merged update ||R - base||) and the check of a plan's error bound against it."""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

from mergepipe.errors import MergePipeError
from mergepipe.storage.safetensors import FLOAT_DTYPES, open_checkpoint


def load_tensors(model_dir) -> dict[str, torch.Tensor]:
    """Every floating-point tensor of a checkpoint, as float32."""
    ck = open_checkpoint(model_dir)
    out = {}
    for name, info in ck.tensors.items():
        if info.dtype not in FLOAT_DTYPES:
            continue
        path = ck.root / info.file if ck.root.is_dir() else ck.root
        with safe_open(str(path), framework="pt") as fh:
            out[name] = fh.get_tensor(name).float()
    return out


def deviation(model_dir, reference_dir, base_dir=None) -> dict:
    """||M - R||, ||M - R|| / ||R|| and (with a base) ||M - R|| / ||R - base|| over all float tensors.

    Accumulated in float64, tensor by tensor; the two checkpoints must have the same tensor names."""
    m, r = load_tensors(model_dir), load_tensors(reference_dir)
    b = load_tensors(base_dir) if base_dir is not None else None
    for other, label in ((r, reference_dir), (b, base_dir)):
        if other is None:
            continue
        if set(m) != set(other):
            raise MergePipeError(f"{model_dir} and {label} have different tensors: {sorted(set(m) ^ set(other))[:5]}")
        bad = [n for n in m if m[n].shape != other[n].shape]
        if bad:
            raise MergePipeError(f"{model_dir} and {label} differ in shape: {bad[0]} {list(m[bad[0]].shape)} "
                                 f"vs {list(other[bad[0]].shape)}")
    diff2 = ref2 = upd2 = 0.0
    per_tensor = {}
    for name in sorted(r):
        d = (m[name].double() - r[name].double())
        dn = float((d * d).sum())
        diff2 += dn
        ref2 += float((r[name].double() ** 2).sum())
        if b is not None:
            upd2 += float(((r[name].double() - b[name].double()) ** 2).sum())
        if dn > 0:
            per_tensor[name] = math.sqrt(dn)
    absolute = math.sqrt(diff2)
    out = {"absolute": absolute, "reference_norm": math.sqrt(ref2),
           "relative": absolute / math.sqrt(ref2) if ref2 > 0 else 0.0, "per_tensor": per_tensor}
    if b is not None:
        out["update_norm"] = math.sqrt(upd2)
        out["relative_delta"] = absolute / math.sqrt(upd2) if upd2 > 0 else 0.0
    return out


def bound_check(plan, dev: dict, rtol: float = 1e-5) -> dict:
    """Realized ||M_A - M_full|| against the plan's bound (additive operators); ``None`` when no bound.

    ``holds`` allows float32 rounding of the written weights (``rtol`` of the reference norm)."""
    bound = (plan.error_bound if not isinstance(plan, dict) else plan.get("error_bound"))
    if not bound:
        return None
    slack = rtol * dev.get("reference_norm", 0.0)
    return {"bound_absolute": bound["absolute"], "realized_absolute": dev["absolute"],
            "bound_relative": bound["relative"], "realized_relative_delta": dev.get("relative_delta"),
            "holds": dev["absolute"] <= bound["absolute"] + slack}
