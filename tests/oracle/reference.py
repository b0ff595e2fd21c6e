"""An independent reference for budgeted merges: numpy, float64, read straight from the safetensors files.

Nothing here imports MergePipe (no kernel, no engine, no storage module, no torch): the files are parsed
with ``json`` + ``struct`` + ``numpy.frombuffer``, the plan is a plain dict (its ``experts``, ``operator``,
``params``, ``seed``, ``grid`` and ``access`` keys), and every operator is written from its documented
semantics (shared/BRIEF.md "Operator semantics"; the deliberate differences listed in the docstring of
mergepipe/ops/core.py; the random stream defined in the docstring of mergepipe/ops/streams.py):

Per tensor and expert i, the delta δ_i is
  * full checkpoint: x_i − base;  * delta checkpoint: the stored tensor;
  * PEFT LoRA adapter: scale · B @ A (scale = alpha/r, alpha/√r with use_rslora; rank_pattern /
    alpha_pattern keys match a module name ending in them); tensors the adapter does not target: 0.
The access set: δ_i is kept on the rows of the blocks the plan reads, and set to 0 elsewhere ("blocks
left out contribute Δ = 0", coefficients unchanged). The block grid cuts dim 0 (elements of 1-D
tensors) into runs of max(1, block_bytes // row_bytes) rows, row_bytes of the *base* tensor.

Sparsification (density d of expert i on this tensor; ``d >= 1`` keeps δ as it is, for every method, as
mergekit does):
  Exact k: the *whole* tensor's entries (the full delta, not the access set: ANALYZE orders them once per
  (expert, tensor)) ordered by float32 |δ| descending, then flat index (C order) ascending; "rank r" is
  the position in that order. The magnitudes are those of the float32 delta MergePipe computes in (exact
  for full and delta checkpoints: fl32(x − base) is the correctly rounded float64 difference).
  * magnitude (ties): keep ranks [0, k), k = max(1, int(d·numel)) (exactly k, as mergekit's top-k; which
    of the magnitudes tied at the cut-off is MergePipe's flat-order rule). With ``rescale`` (mergekit's
    L1 rescale, per tensor): kept values times ||δ||₁ / ||top-k||₁ (1 when either is below 1e-7).
  * outliers (breadcrumbs, mergekit's magnitude_outliers): keep ranks [k_hi, k_hi + int(d·n)),
    k_hi = min(int(gamma·n), n − int(d·n)); with ``rescale``, the block's L1-preserving rescale (below).
  * random (DARE): per block, keep iff u < float32(d), u the block's random stream (below), element i of
    the block (C order of the block's rows) getting u[i]; with ``rescale`` (default on), kept values
    times ||δ_block||₁ / ||kept_block||₁ when both are >= 1e-8 (per block, not per tensor).
  * della (MAGPRUNE, mergekit's della_magprune): per row of dim 0 within the block (a 1-D block is one
    row) of n entries, rank r = 0..n−1 of |δ| ascending (equal magnitudes by position),
    p = (d − eps) + (r/(n − 1))·2·eps (p = d when n = 1); keep iff u < p; with ``rescale`` the block's
    L1-preserving rescale (as DARE).
The block's random stream: block seed s = blake2b(f"{seed}|{content}|{tensor}|{block}", 8 bytes) read
little-endian, masked to 63 bits, where content = blake2b(digest_size=16).hexdigest() of the expert's
stored bytes of the block's rows (LoRA: the rows of B); k1 = (s mod 2³²) | 1, k2 = s >> 32; element i:
h = mix32((i mod 2³²)·k1 + k2 + (i >> 32)·0x9E3779B9 mod 2³²), u = (h >> 8) / 2²⁴, with mix32 the
"lowbias32" hash x ^= x>>16; x *= 0x21F0AAAD; x ^= x>>15; x *= 0x735A2D97; x ^= x>>15 (mod 2³²).

Compact blocks (the plan's ``compact`` key; the record's file, offset and entries in ``compact_files``): the
block's delta is the record decoded at the level the plan reads, by storage/compact.py's written definition
(groups of G entries; m_g and a_g bfloat16 bits; sign plane; magnitude planes q>>2, (q>>1)&1, q&1; level 1:
±m_g, level 2: ±0.75·a_g where q >= 4 else 0, level 4: ±(q + 0.5)·a_g/8), decoded here from the bytes alone.
It is sparsified like a read block, except that the magnitude cuts are the catalog's per-tensor thresholds
as the plan records them (magnitude: keep |d| > thr, or |d| == thr by the exact-k cut's block rule;
outliers: the band between the two cuts), and its random stream's content id is blake2b of the record.

Combination (w_i the expert's weight, W = Σ_i w_i over all experts, omitted ones included, λ = lambda):
  * additive (linear, task_arithmetic, dare_linear, breadcrumbs, della_linear):
    m = Σ_i w_i δ_i'; with ``normalize`` m /= W (W → 1 when |W| < 1e-8); out = base + λ·m, except
    linear without normalize: out = W·base + λ·m (= Σ w_i x_i).
  * sign consensus (ties, dare_ties, breadcrumbs_ties, della): t = Σ_i w_i δ_i', elected sign
    σ = +1 where t >= 0 else −1; agreeing: w_i δ_i' σ > 0; m = Σ_agreeing w_i δ_i'; with ``normalize``
    m /= Σ_agreeing w_i (0 → 1); out = base + λ·m.
Everything here is float64; rounding to the output dtype is left to the comparison.

Where MergePipe's semantics (followed here) differ from mergekit 0.1.5, beyond the deliberate
differences ops/core.py lists (per-block rescale of DARE/DELLA/breadcrumbs, per-block DELLA ranks of
multi-block 1-D tensors, which of the magnitudes tied at a cut-off are kept, random streams): none known
(issue 15 aligned breadcrumbs' k and d >= 1, TIES' rescale and k >= 1, DELLA's epsilon default, keep
probability and rescale with mergekit). Weights summing to 0 under
``normalize`` (linear) are refused by the planner (|sum| must exceed 1e-12 x sum |w|); the divisor
rule below (1 when |sum| < 1e-8) only matters for sums between the two (mergekit's linear divides by
0; its task-arithmetic family also uses 1 below 1e-8).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# --- safetensors, by hand --------------------------------------------------------------------------------
_NP = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
       "U8": "u1", "BOOL": "?"}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOATS = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class RawTensor:
    dtype: str
    shape: tuple
    data: bytes
    file: Path
    offset: int  # absolute offset of the first byte in ``file``

    def values(self) -> np.ndarray:
        """float64 values (bf16: the 16 bits are the top half of a float32)."""
        if self.dtype == "BF16":
            bits = np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(self.data, dtype=_NP[self.dtype])
        return arr.astype(np.float64).reshape(self.shape)


def read_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return n, json.loads(fh.read(n))


def read_file(path: Path) -> dict[str, RawTensor]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        b, e = h["data_offsets"]
        out[name] = RawTensor(h["dtype"], tuple(h["shape"]), raw[8 + n + b: 8 + n + e], Path(path), 8 + n + b)
    return out


def read_dir(path: Path) -> dict[str, RawTensor]:
    """Every tensor of a checkpoint directory (all its *.safetensors files) or of one file."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out: dict[str, RawTensor] = {}
    for f in files:
        for k, v in read_file(f).items():
            assert k not in out, f"{k} twice in {path}"
            out[k] = v
    return out


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float64 -> the nearest bf16 (round to nearest even, through float32 as a cast does), as float64."""
    bits = np.asarray(x, dtype=np.float64).astype(np.float32).view(np.uint32)
    r = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


def ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` floats at |x| (bf16: 8 significant bits, fp32: 24)."""
    bits = {"BF16": 8, "F32": 24, "F16": 11}[dtype]
    tiny = {"BF16": 2.0 ** -133, "F32": 2.0 ** -149, "F16": 2.0 ** -24}[dtype]
    m = np.maximum(np.abs(x), np.finfo(np.float64).tiny)
    return np.maximum(2.0 ** (np.floor(np.log2(m)) - (bits - 1)), tiny)


# --- expert deltas -----------------------------------------------------------------------------------------
LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def _pattern(patterns: dict | None, module: str, default):
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


@dataclass
class Expert:
    """One expert's full float64 delta per base tensor (zeros where it has none), and a bound on the
    float32 rounding error of the delta MergePipe computes (0 for full and delta checkpoints, whose
    float32 delta is the correctly rounded exact one; LoRA's float32 matmul: rank-term sums)."""

    id: str
    kind: str
    deltas: dict[str, np.ndarray]
    err: dict[str, np.ndarray]  # absolute error bound of the float32 delta, per entry (LoRA only)
    raw: dict[str, tuple[bytes, int]]  # the stored bytes the engine reads per row (B for LoRA), bytes per row

    def content_id(self, name: str, r0: int, r1: int) -> str:
        """blake2b (16 bytes, hex) of the bytes of rows [r0, r1) as stored (ops/streams.py's content id)."""
        data, row = self.raw.get(name, (b"", 0))
        return hashlib.blake2b(data[r0 * row:r1 * row], digest_size=16).hexdigest()


def _row_bytes(t: RawTensor) -> int:
    return (math.prod(t.shape[1:]) if len(t.shape) >= 2 else 1) * ITEMSIZE[t.dtype]


def load_expert(kind: str, uri: str, eid: str, base: dict[str, np.ndarray]) -> Expert:
    deltas, err, raw = {}, {}, {}
    if kind in ("full", "delta"):
        tensors = read_dir(Path(uri))
        for name, b in base.items():
            x = tensors[name].values()
            deltas[name] = x - b if kind == "full" else x
            raw[name] = (tensors[name].data, _row_bytes(tensors[name]))
    elif kind == "lora":
        root = Path(uri)
        cfg = json.loads((root / "adapter_config.json").read_text())
        halves: dict[str, dict[str, np.ndarray]] = {}
        for key, t in read_file(root / "adapter_model.safetensors").items():
            m = LORA_KEY.match(key)
            assert m, key
            halves.setdefault(m["module"], {})[m["ab"]] = t.values()
            if m["ab"] == "B":
                raw[m["module"] + ".weight"] = (t.data, _row_bytes(t))
        for module, ab in halves.items():
            a, bm = ab["A"], ab["B"]
            r = a.shape[0]
            alpha = _pattern(cfg.get("alpha_pattern"), module, cfg["lora_alpha"])
            scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            target = module + ".weight"
            deltas[target] = scale * (bm @ a)
            # float32 matmul: |fl(B@A) - B@A| <= r u |B|@|A| (u = 2^-24), then times scale (+ u)
            err[target] = (r + 2) * 2.0 ** -24 * scale * (np.abs(bm) @ np.abs(a))
        for name, b in base.items():
            deltas.setdefault(name, np.zeros_like(b))
    else:
        raise ValueError(kind)
    return Expert(eid, kind, deltas, err, raw)


# --- the grid and the access set ------------------------------------------------------------------------
def rows_per_block(shape: tuple, dtype: str, block_bytes: int) -> int:
    row_bytes = (math.prod(shape[1:]) if len(shape) >= 2 else 1) * ITEMSIZE[dtype]
    return max(1, block_bytes // row_bytes)


def block_rows(shape: tuple, dtype: str, block_bytes: int) -> list[tuple[int, int]]:
    rows = shape[0] if len(shape) else 1
    per = rows_per_block(shape, dtype, block_bytes)
    return [(s, min(rows, s + per)) for s in range(0, rows, per)]


def expand(ranges) -> list[int]:
    return [i for a, b in ranges for i in range(a, b)]


# --- compact records ----------------------------------------------------------------------------------------
def _bits(buf: bytes, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(buf, dtype=np.uint8), count=n, bitorder="little").astype(np.int64)


def _bf16(buf: bytes) -> np.ndarray:
    return (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)


def decode_compact(record: bytes, n: int, group: int, level: int) -> np.ndarray:
    """A compact record decoded at ``level`` bits per entry (float64; the values are exact in float32)."""
    ng, p = -(-n // group), -(-n // 8)
    sign = 1.0 - 2.0 * _bits(record[2 * ng:2 * ng + p], n)
    if level == 1:
        return sign * np.repeat(_bf16(record[:2 * ng]), group)[:n]
    at = 2 * ng + p
    a = np.repeat(_bf16(record[at:at + 2 * ng]), group)[:n]
    hi = _bits(record[at + 2 * ng:at + 2 * ng + p], n)
    if level == 2:
        return sign * np.where(hi == 1, 0.75 * a, 0.0)
    at += 2 * ng + p
    q = 4 * hi + 2 * _bits(record[at:at + p], n) + _bits(record[at + p:at + 2 * p], n)
    return sign * (q + 0.5) * a / 8


def compact_level_bytes(n: int, group: int, level: int) -> int:
    ng, p = -(-n // group), -(-n // 8)
    return {1: 2 * ng + p, 2: 4 * ng + 2 * p, 4: 4 * ng + 4 * p}[level]


def compact_blocks(plan: dict, eid: str, name: str) -> dict[int, tuple[bytes, int]]:
    """block -> (record read, level) of one expert's tensor, from the plan's compact files."""
    entry = (plan.get("compact") or {}).get("experts", {}).get(eid)
    if not entry:
        return {}
    where = {b: (off, n) for b, off, n in plan["compact_files"][eid]["blocks"].get(name, [])}
    out = {}
    with open(plan["compact_files"][eid]["path"], "rb") as fh:
        for level, tensors in entry["bits"].items():
            for b in expand(tensors.get(name, [])):
                off, n = where[b]
                fh.seek(off)
                rec = fh.read(compact_level_bytes(n, entry["group"], int(level)))
                out[b] = (decode_compact(rec, n, entry["group"], int(level)),
                          hashlib.blake2b(rec, digest_size=16).hexdigest())
    return out


def top_mask(a: np.ndarray, thr: float, cut_block: int, cut_rank: int, block: int) -> np.ndarray:
    """|d| > thr, or |d| == thr and within the exact-k cut (by block, then by the first tied in C order)."""
    if block < cut_block:
        return a >= thr
    if block > cut_block:
        return a > thr
    tied = (a == thr).ravel()
    first = tied & (np.cumsum(tied) <= cut_rank)
    return (a > thr) | first.reshape(a.shape)


NO_CUT_BLOCK = 2 ** 62


def compact_sparsify(kind, d: np.ndarray, dens: float, params: dict, thr: list, block: int, seed: int,
                     rescale: bool) -> np.ndarray:
    """A compact block's decoded delta sparsified with the plan's per-tensor thresholds."""
    a = f32_abs(d)
    if kind is None or dens >= 1:
        return d
    if kind == "magnitude":
        cut = (int(thr[2]), int(thr[3])) if len(thr) > 3 else (NO_CUT_BLOCK, 0)
        ratio = thr[1] if len(thr) > 1 else 1.0
        return np.where(top_mask(a, thr[0], *cut, block), d * ratio, 0.0)
    if kind == "outliers":
        cuts = [int(x) for x in thr[2:6]] if len(thr) > 5 else [NO_CUT_BLOCK, 0, NO_CUT_BLOCK, 0]
        keep = top_mask(a, thr[1], cuts[2], cuts[3], block) & ~top_mask(a, thr[0], cuts[0], cuts[1], block)
        return outliers(d, keep, rescale)
    if kind == "random":
        return random_drop(d, dens, rescale, seed)
    return della(d, dens, float(params["epsilon"]), rescale, seed)


# --- the random stream ------------------------------------------------------------------------------------
M32 = np.uint64(0xFFFFFFFF)


def block_seed(seed: int, content: str, tensor: str, block: int) -> int:
    h = hashlib.blake2b(f"{seed}|{content}|{tensor}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _mix32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x21F0AAAD)) & M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x735A2D97)) & M32
    x ^= x >> np.uint64(15)
    return x


def uniform(seed: int, n: int) -> np.ndarray:
    """The first n values of a block's stream, float64 (exact multiples of 2**-24 in [0, 1))."""
    k1 = np.uint64((seed & 0xFFFFFFFF) | 1)
    k2 = np.uint64(seed >> 32)
    i = np.arange(n, dtype=np.uint64)
    x = ((i & M32) * k1 + k2 + (i >> np.uint64(32)) * np.uint64(0x9E3779B9)) & M32
    return (_mix32(x) >> np.uint64(8)).astype(np.float64) / float(1 << 24)


# --- sparsification -----------------------------------------------------------------------------------------
def f32_abs(d: np.ndarray) -> np.ndarray:
    """|delta| of the float32 delta MergePipe computes in."""
    return np.abs(d.astype(np.float32)).astype(np.float64)


def kth_largest(a: np.ndarray, fraction: float, at_least_one: bool = False) -> float:
    """Top-``fraction`` magnitude threshold of a whole tensor: the k-th largest, k = int(fraction·numel)
    (``at_least_one``: k = max(1, ...), TIES as mergekit's magnitude)."""
    if fraction >= 1:
        return 0.0  # keep everything (the smallest |delta| would do as well)
    k = int(fraction * a.size)
    if at_least_one:
        k = max(1, k)
    if k <= 0:
        return math.inf
    return float(np.sort(a.ravel())[::-1][k - 1])


def l1_rescale(d: np.ndarray, kept: np.ndarray) -> np.ndarray:
    org, new = float(np.abs(d).sum()), float(np.abs(kept).sum())
    return kept * (org / new) if org >= 1e-8 and new >= 1e-8 else kept


def exact_mask(full: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The entries ranked [start, stop) when the whole tensor is ordered by float32 |δ| descending, then
    flat index (C order) ascending: MergePipe's exact-k tie-break (mergekit keeps exactly as many, its
    choice among magnitudes tied at a cut-off being arbitrary)."""
    a = f32_abs(full).ravel()
    order = np.lexsort((np.arange(a.size), -a))
    mask = np.zeros(a.size, dtype=bool)
    mask[order[start:stop]] = True
    return mask.reshape(full.shape)


def outlier_ranks(n: int, density: float, gamma: float) -> tuple[int, int]:
    """mergekit's magnitude_outliers: drop the top min(int(gamma·n), n − int(d·n)), keep the next int(d·n)."""
    target = int(density * n)
    k_hi = min(int(gamma * n), n - target)
    return k_hi, k_hi + target


def topk_l1_ratio(full: np.ndarray, density: float) -> float:
    """TIES' rescale (mergekit, per tensor): ||δ||₁ / ||top-k δ||₁ over exactly k = max(1, int(d·n)) top
    magnitudes; 1 when either is below 1e-7."""
    a = np.sort(f32_abs(full).ravel())[::-1]
    k = max(1, int(density * a.size))
    org, new = float(a.sum()), float(a[:k].sum())
    return org / new if org >= 1e-7 and new >= 1e-7 else 1.0


def outliers(d: np.ndarray, keep: np.ndarray, rescale: bool) -> np.ndarray:
    """Breadcrumbs on one block: the block's part ``keep`` of the tensor's exact mask; per block rescale."""
    kept = np.where(keep, d, 0.0)
    return l1_rescale(d, kept) if rescale else kept


def random_drop(d: np.ndarray, density: float, rescale: bool, seed: int) -> np.ndarray:
    """DARE: Bernoulli(density) keep mask from the block's stream, L1 rescale per block."""
    u = uniform(seed, d.size).reshape(d.shape)
    kept = np.where(u < float(np.float32(density)), d, 0.0)
    return l1_rescale(d, kept) if rescale else kept


def della(d: np.ndarray, density: float, eps: float, rescale: bool, seed: int) -> np.ndarray:
    """DELLA MAGPRUNE (mergekit's della_magprune): keep probability linear in the magnitude rank within each
    row of the block, p = (d − eps) + (r/(n − 1))·2·eps; per-block L1 restoration when ``rescale``."""
    rows = d.reshape(d.shape[0], -1) if d.ndim >= 2 else d.reshape(1, -1)
    n = rows.shape[1]
    if n > 1:
        ranks = np.argsort(np.argsort(f32_abs(rows), axis=1, kind="stable"), axis=1, kind="stable")
        p = (density - eps) + np.clip(ranks / (n - 1), 0, 1) * 2 * eps
    else:
        p = np.full(rows.shape, density)
    u = uniform(seed, rows.size).reshape(rows.shape)
    kept = np.where(u < p, rows, 0.0).reshape(d.shape)
    return l1_rescale(d, kept) if rescale else kept


# --- the merge ----------------------------------------------------------------------------------------------
SPARSIFY = {"linear": None, "task_arithmetic": None, "ties": "magnitude", "dare_linear": "random",
            "dare_ties": "random", "breadcrumbs": "outliers", "breadcrumbs_ties": "outliers",
            "della": "della", "della_linear": "della"}
CONSENSUS = {"ties", "dare_ties", "breadcrumbs_ties", "della"}
WHOLE_MODELS = {"linear"}


def setting(expert: dict, key: str, tensor: str):
    """An expert's weight or density on one tensor, as the plan records it (per-tensor table or single)."""
    per = expert.get("tensors")
    if per and tensor in per:
        return per[tensor][0 if key == "weight" else 1]
    return expert[key]


def thresholds(op: str, delta: np.ndarray, density: float, params: dict) -> list[float]:
    """The per-tensor magnitude thresholds an operator needs, from the full delta."""
    kind = SPARSIFY[op]
    a = f32_abs(delta)
    if kind == "magnitude":
        return [kth_largest(a, density, at_least_one=True)] if density < 1 else [0.0]
    if kind == "outliers":
        if density >= 1:
            return [0.0, 0.0]  # the delta is kept as it is: no threshold
        k_hi, k_lo = outlier_ranks(a.size, density, params["gamma"])
        srt = np.sort(a.ravel())[::-1]
        return [srt[k_hi - 1] if k_hi else math.inf, (srt[k_lo - 1] if k_lo else math.inf) if k_lo < a.size else 0.0]
    return []


@dataclass
class Result:
    """Per tensor: the merged value (float64), a bound on the float32 arithmetic error of a correct
    float32 implementation (before rounding to the output dtype), and the thresholds used."""

    values: dict[str, np.ndarray]
    err: dict[str, np.ndarray]
    thresholds: dict[str, dict[str, list[float]]]  # expert -> tensor -> thresholds


def merge(plan: dict, base_dir: Path) -> Result:
    """Merge ``plan`` (a stored plan's dict) from the files, reading its access set only."""
    op = plan["operator"]
    params = plan["params"]
    lam = float(params["lambda"])
    normalize = bool(params["normalize"])
    rescale = bool(params["rescale"])
    block_bytes = plan["grid"]["block_bytes"]
    seed = int(plan["seed"])
    base_raw = read_dir(base_dir)
    base = {n: t.values() for n, t in base_raw.items() if t.dtype in FLOATS}
    experts = [load_expert(e["kind"], e["uri"], e["id"], base) for e in plan["experts"]]
    kind = SPARSIFY[op]
    u = 2.0 ** -24
    values, errs, thr_all = {}, {}, {e.id: {} for e in experts}
    for name, b in base.items():
        info = base_raw[name]
        spans = block_rows(info.shape, info.dtype, block_bytes)
        ws = [float(setting(pe, "weight", name)) for pe in plan["experts"]]
        W = sum(ws)
        contribs = []  # (w, sparsified delta restricted to the access set, delta error bound)
        for e, pe, w in zip(experts, plan["experts"], ws):
            full = e.deltas[name]
            dens = setting(pe, "density", name)
            dens = 1.0 if dens is None else float(dens)
            thr = thresholds(op, full, dens, params)
            if thr and full.any():  # an all-zero delta contributes nothing and needs no threshold
                thr_all[e.id][name] = thr
            out = np.zeros_like(full)
            keep = None  # the exact-k mask over the whole tensor (magnitude, outliers)
            if kind == "magnitude" and dens < 1:
                keep = exact_mask(full, 0, max(1, int(dens * full.size)))
                ratio = topk_l1_ratio(full, dens) if rescale else 1.0
            elif kind == "outliers" and dens < 1:
                keep = exact_mask(full, *outlier_ranks(full.size, dens, float(params["gamma"])))
            for bi, (dc, content) in compact_blocks(plan, pe["id"], name).items():
                r0, r1 = spans[bi]
                dc = dc.reshape(full[r0:r1].shape)
                out[r0:r1] = compact_sparsify(kind, dc, dens, params, plan["thresholds"].get(pe["id"], {}).get(name, []),
                                              bi, block_seed(seed, content, name, bi), rescale)
            for bi in expand(plan["access"][pe["id"]].get(name, [])):
                r0, r1 = spans[bi]
                d = full[r0:r1]
                bseed = block_seed(seed, e.content_id(name, r0, r1), name, bi)
                if kind is None or dens >= 1:
                    s = d
                elif kind == "magnitude":
                    s = np.where(keep[r0:r1], d * ratio, 0.0)
                elif kind == "outliers":
                    s = outliers(d, keep[r0:r1], rescale)
                elif kind == "random":
                    s = random_drop(d, dens, rescale, bseed)
                else:
                    s = della(d, dens, float(params["epsilon"]), rescale, bseed)
                out[r0:r1] = s
            derr = e.err.get(name)
            contribs.append((w, out, np.zeros_like(b) if derr is None else derr * (out != 0)))
        wd = [w * s for w, s, _ in contribs]
        if op in CONSENSUS:
            total = sum(wd) if wd else np.zeros_like(b)
            sign = np.where(total >= 0, 1.0, -1.0)
            agree = [x * sign > 0 for x in wd]
            mixed = sum(np.where(a, x, 0.0) for a, x in zip(agree, wd))
            divisor = np.ones_like(b)
            if normalize:
                divisor = sum(np.where(a, w, 0.0) for a, (w, _, _) in zip(agree, contribs))
                divisor = np.where(divisor == 0, 1.0, divisor)
            base_term = b
        else:
            mixed = sum(wd)
            divisor = np.full_like(b, W if (normalize and abs(W) >= 1e-8) else 1.0)
            base_term = b * W if (op in WHOLE_MODELS and not normalize) else b
        merged = base_term + lam * mixed / divisor
        # float32 arithmetic error of an implementation that computes δ, w·δ, the sum over K experts, the
        # the rescale, the division, λ and the final addition in float32: each step at most u relative
        # to the magnitudes it combines (K + 6 steps), plus the error of the float32 delta itself (LoRA).
        K = len(contribs)
        mags = sum(np.abs(x) for x in wd) if wd else np.zeros_like(b)
        derrs = sum(abs(w) * de for w, _, de in contribs) if contribs else np.zeros_like(b)
        scale = abs(lam) / np.abs(divisor)
        errs[name] = (K + 6) * u * (scale * mags + np.abs(base_term) + np.abs(merged)) + scale * derrs * 1.01
        values[name] = merged
    return Result(values, errs, thr_all)
