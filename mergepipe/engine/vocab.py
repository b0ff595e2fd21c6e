"""The pipeline's hook for a merge over different vocabularies (a plan's ``tokenizer["vocab"]``,
config/vocab.py): every model's embed_tokens/lm_head re-ordered to the output vocabulary, served to the
block loop as if they were the models' tensors, and the output tokenizer written with the merge.

Each re-ordered tensor is read in full once per model (the base through the base's reader, each expert
through its own: the plan reserves exactly those bytes), composed with storage/vocab_union.py's
``compose_tensor`` (mergekit 0.1.5's PermutedVocabulary: own rows, another model's row, a mean, zero,
padding), and dropped when the next one starts. The merge then runs block by block on the composed
rows like on any tensor; other tensors never come here. Statistics the plan cannot hold for composed rows
are taken from them here, in memory: TIES's exact top k (``_thresholds``) and an interpolation method's
Gram statistics and scalars (``_coefficients``; also sce's top k of the variance across the experts,
ramplus_tl's shared/unique counts and arcee_fusion's importance threshold, by ANALYZE's own code).
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np

from mergepipe.errors import ExecutionError
from mergepipe.ops.spec import Sparsify
from mergepipe.ops.topk import NO_CUT
from mergepipe.planner.methods import method_scalars
from mergepipe.planner.settings import expert_params, tensor_density
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import TensorInfo
from mergepipe.storage.tokenizer_files import is_tokenizer_file, write_chat_template
from mergepipe.storage.vocab_union import (TokenSetting, build_vocabulary, compose_tensor, decode_sources,
                                           vocab_sha)

# tokenizer files a written vocabulary replaces (processor, generation and chat template files stay)
_KEPT = ("preprocessor_config.json", "processor_config.json", "feature_extractor_config.json",
         "generation_config.json", "chat_template")


def vocab_setting(plan) -> dict | None:
    return plan.vocab


class VocabRows:
    """Composed embedding tensors of the base and every expert, one tensor at a time."""

    def __init__(self, pipeline, vocab: dict):
        self.p, self.vocab = pipeline, vocab
        self.names = set(vocab["tensors"])
        n, rows = vocab["tokens_n"], vocab["rows"]
        self.sources = {m: decode_sources(es, n, rows) for m, es in vocab["sources"].items()}
        self.copies = vocab.get("copies") or {}  # passthrough: each embedding tensor's copied model
        self.lock = threading.Lock()
        self.current: tuple[str, dict[str, bytes]] | None = None
        self.dtypes: dict[str, str] = {}

    def covers(self, name: str) -> bool:
        return name in self.names

    def output_info(self, info: TensorInfo) -> TensorInfo:
        rows, width = self.vocab["tensors"][info.name]
        itemsize = info.nbytes // max(1, info.shape[0] * info.shape[1])
        return replace(info, shape=(rows, width), nbytes=rows * width * itemsize)

    def span_cost(self, span) -> int:
        return span.nbytes * (1 + len(self.p.experts))

    def fetch(self, info: TensorInfo, group):
        """The base's composed bytes of a group and every expert's blocks (as a full checkpoint's)."""
        composed, nread = self._composed(info.name)
        # passthrough: the copied model's own tensor, re-ordered alone (``copies``); else the base's
        base_id = self.copies.get(info.name, self.p.plan.base_id)
        start, end = group[0], group[-1]
        g0 = start.rel_offset
        base_buf = memoryview(composed[base_id])[g0:end.rel_offset + end.nbytes]
        if self.copies:
            return base_buf, [{} for _ in self.p.experts], nread
        exp_bufs = []
        for e in self.p.experts:
            data = memoryview(composed[e["id"]])
            exp_bufs.append({s.index: ([data[s.rel_offset:s.rel_offset + s.nbytes]], []) for s in group})
        return base_buf, exp_bufs, nread

    def _composed(self, name: str) -> tuple[dict[str, bytes], int]:
        with self.lock:
            if self.current is not None and self.current[0] == name:
                return self.current[1], 0
            self.current = None  # the previous tensor's rows are no longer needed
            arrays, nread = self._read_all(name)
            rows_n = self.vocab["tokens_n"]
            out = {}
            for m in arrays:
                width = arrays[m].shape[1]
                body = compose_tensor(m, self.sources, lambda mm, r: arrays[mm][r], rows_n, (width,),
                                      arrays[m].dtype)
                out[m] = _to_bytes(body, self.dtypes[name])
            self.current = (name, out)
            self._thresholds(name, out)
            self._coefficients(name, out)
            return out, nread

    def _coefficients(self, name: str, composed: dict[str, bytes]) -> None:
        """An interpolation method's scalars of a re-ordered tensor: its Gram statistics taken from the
        composed rows of every model (as ANALYZE takes them for other tensors), turned into scalars by the
        planner's own function with the settings the plan recorded (``composed_coefficients``)."""
        p = self.p
        settings = p.plan.composed_coefficients.get(name)
        if settings is None:
            return
        # ANALYZE's kernels (numba), imported only by a merge over re-ordered vocabularies
        from mergepipe.analyze.gram import composed_arcee, composed_counts, composed_gram, composed_sce
        info = next(t for t in p.order if t.name == name)
        itemsize = info.nbytes // max(1, info.shape[0] * info.shape[1])
        blocks = [(s.rel_offset // itemsize, (s.rel_offset + s.nbytes) // itemsize)
                  for s in tensor_grid(info, p.plan.block_bytes)]
        flat = {m: _floats(data, info).numpy().reshape(-1) for m, data in composed.items()}
        base, xs = flat[p.plan.base_id], [flat[e["id"]] for e in p.experts]
        settings = dict(settings)
        # the whole-tensor statistics ANALYZE stores for other tensors, taken from the composed rows
        if p.op.name == "ramplus_tl":
            settings["ram_counts"] = composed_counts(base, xs, blocks)
        elif p.op.name == "arcee_fusion":
            settings["arcee_threshold"] = composed_arcee(base, xs[0], tuple(info.shape), blocks)
        elif p.op.name == "sce" and 0.0 < p.params.get("select_topk", 1.0) < 1.0:
            settings["sce"] = composed_sce(base, xs, tensor_grid(info, p.plan.block_bytes), itemsize,
                                           p.params["select_topk"])
        gram = composed_gram(base, xs, blocks) if p.op.gram else None
        p.coefficients[name] = method_scalars(p.op, gram, settings, p.params, len(info.shape))

    def _thresholds(self, name: str, composed: dict[str, bytes]) -> None:
        """TIES and breadcrumbs below density 1: each expert's exact top-k statistics over its re-ordered
        delta (what ANALYZE stores for other tensors; mergekit takes the top k of the same rows)."""
        p = self.p
        if p.op.sparsify not in (Sparsify.MAGNITUDE, Sparsify.OUTLIERS):
            return
        info = next(t for t in p.order if t.name == name)
        spans = tensor_grid(info, p.plan.block_bytes)
        base = _floats(composed[p.plan.base_id], info)
        for e in p.experts:
            density = tensor_density(e, name) or 1.0
            if density >= 1.0:
                continue
            delta = _floats(composed[e["id"]], info) - base
            params = expert_params(p.params_for(name), e)
            if p.op.sparsify == Sparsify.OUTLIERS:
                stats = exact_outliers(delta, density, params["gamma"], spans, info)
            else:
                stats = exact_topk(delta, density, params.get("rescale", False), spans, info)
            # in place: an expert analyzed on the way shares its dict with the analysis (engine/inflight.py),
            # which adds the other tensors' thresholds to it as they come
            p.thresholds.setdefault(e["id"], {})[name] = stats

    def _read_all(self, name: str) -> tuple[dict[str, np.ndarray], int]:
        """Every model's whole tensor (float32 for bf16/fp16: the mean rows are averaged in float32)."""
        p = self.p
        base_id = p.plan.base_id
        arrays, nread = {}, 0
        if self.copies:  # passthrough: only the copied model's tensor, a read of an input it copies from
            m = self.copies[name]
            info = p.inputs[m].tensors[name]
            self.dtypes[name] = info.dtype
            reader = p.input_readers[m]
            return {m: _decode(reader.read(info.file, info.offset, info.nbytes), info)}, 0
        for m in self.sources:
            if m == base_id:
                ck, reader = p.base_ck, p.input_readers[base_id]
            else:
                ei = next(i for i, e in enumerate(p.experts) if e["id"] == m)
                ck, reader = p.sources[ei].checkpoint, p.readers[ei]
                nread += ck.tensors[name].nbytes
            info = ck.tensors[name]
            self.dtypes[name] = info.dtype
            arrays[m] = _decode(reader.read(info.file, info.offset, info.nbytes), info)
        return arrays, nread


def _floats(data: bytes, info: TensorInfo):
    import torch
    from mergepipe.storage.safetensors import bytes_to_tensor
    return bytes_to_tensor(bytearray(data), info.dtype, tuple(info.shape)).float()


def exact_topk(delta, density: float, rescale: bool, spans, info: TensorInfo) -> list[float]:
    """``[thr, ratio, cut_block, cut_rank]`` of ops.core.tensor_statistics for a whole float32 delta:
    the top k = int(density * n) entries by |delta| descending, then flat index ascending (k = 0:
    mergekit keeps the largest entry, and every entry tied with it); ``ratio`` mergekit's L1 rescale."""
    import torch
    a = delta.abs().reshape(-1)
    n = a.numel()
    k = int(density * n)
    if k == 0:
        thr, cut = float(a.max()), list(NO_CUT)
        kept_l1 = float(a[a >= thr].double().sum())
    else:
        thr = float(torch.topk(a, k, sorted=True).values[-1])
        above = int((a > thr).sum())
        if thr == 0.0:
            cut = list(NO_CUT)
        else:
            tied = torch.nonzero(a == thr).reshape(-1)
            last = int(tied[k - above - 1])
            row = last // info.shape[1]
            span = next(s for s in spans if s.row_start <= row < s.row_end)
            first = span.row_start * info.shape[1]
            cut = [span.index, int(((tied >= first) & (tied <= last)).sum())]
        kept_l1 = float(a[a > thr].double().sum()) + thr * (k - above)
    ratio = 1.0
    if rescale:
        total = float(a.double().sum())
        ratio = total / kept_l1 if total >= 1e-7 and kept_l1 >= 1e-7 else 1.0
    return [thr, ratio, *cut]


def _top(a, k: int, spans, info: TensorInfo) -> list[float]:
    """``[thr, cut_block, cut_rank]`` of the top ``k`` entries of flat magnitudes ``a`` (|delta| descending,
    then flat index ascending; ops/topk.top_mask): k = 0 keeps nothing."""
    import torch
    n = a.numel()
    if k <= 0:
        return [float("inf"), *NO_CUT]
    if k >= n:
        return [0.0, *NO_CUT]
    thr = float(torch.topk(a, k, sorted=True).values[-1])
    if thr == 0.0:  # every non-zero entry (and zeros, which change nothing)
        return [0.0, *NO_CUT]
    above = int((a > thr).sum())
    tied = torch.nonzero(a == thr).reshape(-1)
    last = int(tied[k - above - 1])
    row = last // info.shape[1]
    span = next(s for s in spans if s.row_start <= row < s.row_end)
    first = span.row_start * info.shape[1]
    return [thr, span.index, int(((tied >= first) & (tied <= last)).sum())]


def exact_outliers(delta, density: float, gamma: float, spans, info: TensorInfo) -> list[float]:
    """breadcrumbs' ``[thr_hi, thr_lo, cut_block_hi, cut_rank_hi, cut_block_lo, cut_rank_lo]`` for a whole
    float32 delta, as mergekit 0.1.5's magnitude_outliers: of the n entries sorted by |delta| ascending it
    keeps positions [n_bot, n_bot + target) with target = int(density n), n_bot = max(0, n - target -
    int(gamma n)): in descending order the entries ranked [n - n_bot - target, n - n_bot), the top k_lo
    less the top k_hi (ties by flat index, the rule of ops/topk.py; torch.sort's order among ties is
    unspecified)."""
    a = delta.abs().reshape(-1).float()
    n = a.numel()
    target = int(density * n)
    n_bot = max(0, n - target - int(gamma * n))
    hi = _top(a, n - n_bot - target, spans, info)
    lo = _top(a, n - n_bot, spans, info)
    return [hi[0], lo[0], hi[1], hi[2], lo[1], lo[2]]


def _decode(buf, info: TensorInfo) -> np.ndarray:
    import torch
    from mergepipe.storage.safetensors import bytes_to_tensor
    t = bytes_to_tensor(buf, info.dtype, tuple(info.shape))
    return (t if t.dtype in (torch.float32, torch.float64) else t.float()).numpy().copy()


def _to_bytes(arr: np.ndarray, dtype: str) -> bytes:
    import torch
    from mergepipe.storage.safetensors import DTYPES
    return torch.from_numpy(np.ascontiguousarray(arr)).to(DTYPES[dtype][0]).contiguous().view(torch.uint8).numpy().tobytes()


def write_vocab_files(plan, staging: Path) -> None:
    """The output tokenizer (mergekit's: the vocabulary rebuilt from the same tokenizers, checked against
    the plan's hash) in place of the copied tokenizer files, config.json's ``vocab_size`` set to the rows,
    and the plan's chat template (if any) set on it."""
    vocab = vocab_setting(plan)
    tokens = {t: TokenSetting(source=tuple(s) if isinstance(s, list) else s, force=f)
              for t, f, s in vocab["tokens"]}
    base_id = plan.base_id
    roots = {m: Path(uri) for m, uri in vocab["models"]}
    source = vocab["source"]
    built = build_vocabulary(base_id, roots, source, tuple(tokens), vocab.get("pad_to_multiple_of"))
    if vocab_sha(built.vocab) != vocab["sha256"] or built.rows != vocab["rows"]:
        raise ExecutionError("the tokenizers of the merged models changed since the plan was made (their "
                             "vocabulary hash differs); plan the merge again; nothing was published")
    for f in list(staging.iterdir()):
        if f.is_file() and is_tokenizer_file(f.name) and not f.name.startswith(_KEPT):
            f.unlink()
    built.save(staging)
    cfg = staging / "config.json"
    if cfg.is_file():
        doc = json.loads(cfg.read_text(encoding="utf-8"))
        target = doc["text_config"] if "vocab_size" not in doc and isinstance(doc.get("text_config"), dict) else doc
        target["vocab_size"] = vocab["rows"]
        cfg.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    template = plan.chat_template
    if template:
        write_chat_template(staging, template)
