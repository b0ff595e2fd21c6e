"""Compare two checkpoints tensor by tensor; prints one JSON line. ``python benchmarks/compare.py A B``"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors import safe_open  # noqa: E402

from mergepipe.storage.safetensors import open_checkpoint  # noqa: E402


def main(a: str, b: str) -> None:
    ca, cb = open_checkpoint(a), open_checkpoint(b)
    if set(ca.tensors) != set(cb.tensors):
        print(json.dumps({"same_names": False}))
        return
    diff = total = 0
    maxabs = 0.0
    for name in sorted(ca.tensors):
        with safe_open(str(ca.path_of(ca.tensors[name])), "pt") as fa, safe_open(str(cb.path_of(cb.tensors[name])), "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if x.dtype != y.dtype:
            print(json.dumps({"same_names": True, "same_dtypes": False, "tensor": name}))
            return
        d = (x.float() - y.float()).abs()
        diff += int((d > 0).sum())
        total += d.numel()
        maxabs = max(maxabs, float(d.max()) if d.numel() else 0.0)
    print(json.dumps({"same_names": True, "same_dtypes": True, "differing": diff, "total": total,
                      "fraction": diff / max(total, 1), "max_abs": maxabs}))


if __name__ == "__main__":
    main(*sys.argv[1:])
