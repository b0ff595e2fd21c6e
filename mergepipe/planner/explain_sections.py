"""EXPLAIN's sections: each a list of lines of a :class:`~mergepipe.planner.plan.Plan`, read through its
accessors. This module imports no plan module, so that ``Plan.explain`` composes the sections
(:func:`explain_text`) while planner/explain.py, which also takes a plan's data, imports the Plan."""

from __future__ import annotations

import json

from mergepipe.planner.explain_experts import ExpertView, experts_heading, more_line, split_experts


def transfer_line(transfer: dict) -> str:
    """``~1.2 s: s3 105 MiB in 40 requests (30 ms, 100 MB/s); local ...`` (storage/tiers.py's model)."""
    from mergepipe.planner.budget import human_bytes

    parts = [f"{name} {human_bytes(t['bytes'])} in {t['requests']} requests ({t['latency_ms']:g} ms, "
             f"{t['mb_per_s']:g} MB/s) ~{t['seconds']:.2f} s" for name, t in transfer["tiers"].items()]
    return f"~{transfer['seconds']:.2f} s estimated: " + "; ".join(parts)


def coalesce_line(c: dict) -> str:
    """``coalesce   412 -> 96 requests, ~2.10 s -> ~1.52 s; ...`` (planner/coalesce.py)."""
    from mergepipe.planner.budget import human_bytes

    def requests(t: dict) -> int:
        return sum(row["requests"] for row in t["tiers"].values())

    before, after = c["before"], c["after"]
    return (f"  coalesce   {requests(before)} -> {requests(after)} requests, ~{before['seconds']:.2f} s -> "
            f"~{after['seconds']:.2f} s estimated; expert read {human_bytes(c['expert_read_before'])} -> "
            f"{human_bytes(c['expert_read_after'])}, {c['blocks_swapped']} blocks swapped for neighbours "
            f"(within {c['tolerance']:.0%} of the cut-off score per byte)")

# what a re-ordered vocabulary's embedding coefficients are computed from at merge time (engine/vocab.py)
_COMPOSED_STATS = {
    "sce": "their Gram statistics and, with select_topk < 1, the top k of the variance across the experts",
    "ramplus_tl": "each expert's counts of shared and unique changed entries",
    "arcee_fusion": "the importance threshold, median + 1.5 IQR",
}


def explain_text(plan, view: ExpertView | None = None) -> str:
    """EXPLAIN-style text of a Plan: inputs, budget, estimates, then selection per expert and per tensor,
    one section after another; ``view`` (planner/explain_experts.py): which experts are listed (default: the
    top 16 by bytes read, the rest on one line)."""
    view = ExpertView() if view is None else view
    lines = header_lines(plan) + [budget_line(plan.data), estimate_line(plan)]
    lines += tier_lines(plan) + transfer_lines(plan) + bound_section(plan) + shape_lines(plan)
    lines += expert_lines(plan, view) + tensor_lines(plan, view)
    return "\n".join(lines)


def header_lines(plan) -> list[str]:
    """The plan's id and digest, operator, parameters, seed, strategy, base and grid."""
    from mergepipe.planner.budget import human_bytes
    return [f"PLAN {plan.id}  ({plan.digest})",
            f"  operator   {plan.operator}  params {json.dumps(_short(plan.params), sort_keys=True)}  "
            f"seed {plan.seed}  "
            f"strategy {plan.strategy}",
            f"  base       {plan.base_id}  {plan.base['fingerprint'][:19]}",
            f"  grid       {human_bytes(plan.block_bytes)} blocks, {plan.blocks_total} per model"]


def estimate_line(plan) -> str:
    """The estimated reads and write."""
    from mergepipe.planner.budget import human_bytes
    e = plan.estimated
    return (f"  estimate   base read {human_bytes(e['base_read'])}, expert read {human_bytes(e['expert_read'])}"
            + (f", compact read {human_bytes(e['compact_read'])}" if e.get('compact_read') else "")
            + f", write {human_bytes(e['output_write'])}")


def tier_lines(plan) -> list[str]:
    """The exact / compact / omitted split and the compact tier's note."""
    lines = []
    if plan.tiers and (plan.compact or plan.tiers["compact"]["by_bits"]):
        lines.append(tiers_line(plan.tiers))
    if plan.compact_note:
        lines.append(f"  compact    {plan.compact_note}")
    return lines


def transfer_lines(plan) -> list[str]:
    """The transfer-time estimate (plans saved before the tier cost model lack it) and coalescing."""
    p = plan.data
    lines = []
    if p.get("transfer"):
        lines.append("  transfer   " + transfer_line(p["transfer"]))
    if p.get("coalesce"):
        lines.append(coalesce_line(p["coalesce"]))
    return lines


def bound_section(plan) -> list[str]:
    """The error bound and the suggested budget; for an interpolation method what stands for them."""
    if plan.error_bound:
        return error_bound_lines(plan)
    if plan.data.get("coefficients") is not None:  # an interpolation method (planner/methods.py)
        return method_lines(plan)
    return []


def error_bound_lines(plan) -> list[str]:
    p, b = plan.data, plan.error_bound
    lines = []
    norm = "n/a" if b["full_delta_norm"] is None else f"{b['full_delta_norm']:.6g}"
    if b.get("kind") == "sparsified":
        lines.append(f"  bound      ||M_full - M_A|| <= {b['absolute']:.6g}  (relative {b['relative']:.3e} of the bound "
                     f"{b['update_bound']:.6g} on ||M_full - base||; sound for {plan.operator}'s sparsification"
                     f"{' and sign election' if plan.operator in CONSENSUS_OPS else ''}, but loose: at each position "
                     f"not read exactly, the norms of both merges' updates there)")
    elif b.get("kind") == "blockwise":
        lines += bound_lines(b, norm, bool(plan.compact))
    else:  # plans stored before the blockwise headline
        lines.append(f"  bound      ||M_full - M_A|| <= {b['absolute']:.6g}  (relative {b['relative']:.3e} "
                     f"of ||M_full - base|| ~ {norm})")
    if "blockwise" in b and b.get("kind") != "blockwise":  # plans stored before the blockwise bound lack it
        lines.append(f"  tighter    ||M_full - M_A|| <= {b['blockwise']:.6g}  (relative "
                     f"{b['blockwise_relative']:.3e}; blocks at different positions are disjoint)")
    if plan.suggested_budget:
        lines.append(suggestion_line(plan.suggested_budget))
    return lines


def method_lines(plan) -> list[str]:
    from mergepipe.ops.core import get_op
    op = get_op(plan.operator)
    lines = [f"  bound      {op.bound_note or 'n/a'}"]
    omitted = sum(b - a for rs in plan.omitted.values() for a, b in rs)
    lines.append(f"  omitted    {omitted} blocks not read; {op.budget_semantics}")
    if plan.composed_coefficients:  # a re-ordered vocabulary (planner/methods.py, engine/vocab.py)
        what = _COMPOSED_STATS.get(plan.operator, "their Gram statistics")
        lines.append(f"  coefficients of {', '.join(sorted(plan.composed_coefficients))}: from the composed rows "
                     f"at merge time ({what}, computed in memory from the rows read in full for "
                     f"every model; no extra read)")
    return lines


def shape_lines(plan) -> list[str]:
    """What the output is made of besides the merge: a `slices:` layout, a soup's base, the tokenizer."""
    lines = [layout_line(plan.data)] if plan.layout else []
    return lines + soup_lines(plan) + tokenizer_lines(plan) + dtype_lines(plan) + moe_lines(plan)


def moe_lines(plan) -> list[str]:
    """A Mixtral/Qwen3-MoE base's per-expert matrices: fused as mergekit writes them, or per expert."""
    moe = plan.moe_layout
    if not moe:
        return []
    if moe["layout"] == "per-expert":
        return [f"  moe        experts written per expert, under the base's names (mergekit 0.1.5 writes the "
                f"fused layout of transformers v5: moe_layout fused, the default)"]
    return [f"  moe        experts written fused as transformers v5 and mergekit 0.1.5 write {moe['architecture']}: "
            f"per layer mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I], each the "
            f"per-expert matrices one after the other (merged, read and budgeted per expert matrix as always)"]


def dtype_lines(plan) -> list[str]:
    """The output dtype when the plan converts the float tensors (mergekit's out_dtype, else dtype)."""
    from mergepipe.planner.budget import human_bytes
    out = plan.out_dtype
    if not out:  # each tensor in its own dtype (no line)
        return []
    note = plan.data.get("conversion") or {}
    sizes = "" if note.get("bytes") is None else (
        f"; output {human_bytes(note['bytes'])}" + (f" instead of {human_bytes(note['bytes_unconverted'])}"
                                                    if note["bytes"] != note["bytes_unconverted"] else " (as unconverted)"))
    return [f"  dtype      float tensors written in {out} (the base's: {', '.join(note.get('from', ['?']))}): "
            f"merged in float32, each output block rounded once to {out} as it is written; non-float buffers "
            f"copied as they are{sizes}"]


def soup_lines(plan) -> list[str]:
    member = plan.base_member
    if not member:  # not a model soup (config/soup.py)
        return []
    weight = "per tensor" if member.get("weight") is None else f"{member['weight']:g}"
    return [f"  soup       {plan.base_id} is averaged in with weight {weight} (model {member['position'] + 1} "
            "of the soup)" + (
                f"; it is the reference model: the config names no base_model, so MergePipe took the first "
                f"model listed, read it in full and planned the other models as deltas against it (the "
                f"average does not depend on that choice; the budget applies to the others)"
                if member.get("reference") else "; the config lists its base_model among the models")]


def tokenizer_lines(plan) -> list[str]:
    tok = plan.tokenizer
    if not tok:  # the base's tokenizer files otherwise (no line)
        return []
    template = tok.get("chat_template")
    vocab = tok.get("vocab")
    files = (f"{vocab['source']} vocabulary of {vocab['tokens_n']} tokens ({vocab['sha256'][:19]}), written by "
             f"the merge" if vocab else f"{tok.get('source', plan.base_id)}'s files")
    lines = [f"  tokenizer  {files}"
             + (f", chat template {template[:40]!r}{'...' if len(template) > 40 else ''}" if template else "")]
    if vocab and vocab.get("copies"):  # passthrough: each copied tensor re-ordered alone (config/vocab.py)
        zero = {m: sum(1 for e in es if e[0] != "own") for m, es in vocab["sources"].items()}
        lines.append(f"  vocab rows {', '.join(f'{n} {r} x {w}' for n, (r, w) in sorted(vocab['tensors'].items()))} "
                     f"re-ordered to it, each alone from the model it copies ("
                     f"{', '.join(f'{n} of {m}' for n, m in sorted(vocab['copies'].items()))}; rows of tokens it "
                     f"lacks zero: {', '.join(f'{m} {n}' for m, n in zero.items())})")
    elif vocab:
        moved = {m: sum(1 for e in es if e[0] != "own") for m, es in vocab["sources"].items()}
        lines.append(f"  vocab rows {', '.join(f'{n} {r} x {w}' for n, (r, w) in sorted(vocab['tensors'].items()))} "
                     f"re-ordered to it (rows not a model's own: "
                     f"{', '.join(f'{m} {n}' for m, n in moved.items())}); read in full for every model "
                     f"whatever the budget" + (f"; tokens: {', '.join(t[0] for t in vocab['tokens'])}"
                                               if vocab["tokens"] else ""))
    return lines


def expert_lines(plan, view: ExpertView | None = None) -> list[str]:
    """Per expert: weight, density, blocks selected of the candidates, bytes read (exact and compact), and the
    plan's warnings; with more experts than ``view.top``, the top ones by bytes read and a line for the rest."""
    from mergepipe.planner.budget import human_bytes
    view = ExpertView() if view is None else view
    shown, rest, hidden = split_experts(plan, view)
    lines = [experts_heading(plan, view, shown, rest, hidden)]
    for e in shown:
        eid = e["id"]
        extra = f" density {e['density']:g}" if e.get("density") is not None else ""
        weight = "per tensor" if e.get("weight") is None else f"{e['weight']:g}"
        compact = ((plan.compact or {}).get("experts") or {}).get(eid)
        lines.append(f"    {eid:<20} weight {weight}{extra}  blocks {plan.blocks_selected[eid]}/"
                     f"{plan.blocks_candidate[eid]}  read {human_bytes(plan.estimated_by_expert[eid])}"
                     + (f"  compact {sum(b - a for ts in compact['bits'].values() for rs in ts.values() for a, b in rs)}"
                        f" blocks {human_bytes(plan.compact_read_by_expert[eid])} ({compact['codec']}, groups of "
                        f"{compact['group']})" if compact else ""))
        if e.get("analyze"):
            lines.append(f"    {'':<20} {e['analyze']}: read in full and analyzed on the way")
    if rest:
        lines.append(more_line(plan, rest))
    for w in plan.warnings:  # e.g. an expert identical to its base (planner/context.py)
        lines.append(f"  warning    {w}")
    return lines


def tensor_lines(plan, view: ExpertView | None = None) -> list[str]:
    """Per tensor: the bytes read and each listed expert's block ranges (exact, and ~N from the compact tier);
    ``+N more experts`` where experts not listed (``view``) read some of the tensor too."""
    from mergepipe.planner.budget import human_bytes
    shown, rest, _ = split_experts(plan, ExpertView() if view is None else view)
    lines = ["  tensors (blocks read per expert" + ("; ~N: from the compact tier at N bits)" if plan.compact else ")")]
    compact = (plan.compact or {}).get("experts") or {}
    tensors = sorted({t for ts in plan.access.values() for t in ts}
                     | {t for c in compact.values() for ts in c["bits"].values() for t in ts})
    for t in tensors:
        parts = []
        for e in sorted(shown, key=plan.experts.index):
            rs = plan.access_for(e["id"]).get(t, [])
            if rs:
                parts.append(f"{e['id']}:" + _ranges(rs))
            for level, ts in sorted((compact.get(e["id"]) or {}).get("bits", {}).items()):
                if ts.get(t):
                    parts.append(f"{e['id']}~{level}:" + _ranges(ts[t]))
        more = sum(1 for e in rest if plan.access_for(e["id"]).get(t) or any(
            ts.get(t) for ts in (compact.get(e["id"]) or {}).get("bits", {}).values()))
        if more:
            parts.append(f"(+{more} more experts)")
        lines.append(f"    {t:<48} {human_bytes(plan.estimated_by_tensor.get(t, 0)):>12}  {' '.join(parts)}")
    return lines


def _ranges(rs) -> str:
    return ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in rs)


def _short(params: dict) -> dict:
    """Parameters for the operator line: a per-tensor condition list (a `slices:` config's t) as its size."""
    return {k: f"per tensor ({len(v)} tensors)" if isinstance(v, list) and len(v) > 8 else v for k, v in params.items()}


def layout_line(p: dict) -> str:
    """A `slices:` plan's output layers as runs: ``0-2 <- base 0-2, 3-5 <- e1 1-3``."""
    runs: list[list] = []  # [out start, out end, model, in start]
    for j, (model, i) in enumerate(p["layout"]["layers"]):
        last = runs[-1] if runs else None
        if last and last[2] == model and last[3] + (j - last[0]) == i:
            last[1] = j
        else:
            runs.append([j, j, model, i])
    text = ", ".join(f"{a}-{b} <- {m} {i}-{i + b - a}" if b > a else f"{a} <- {m} {i}" for a, b, m, i in runs)
    copies = sum(1 for t in p["layout"]["tensors"] if t[0] != t[2] or t[1] != p["base"]["id"])
    return (f"  layout     {len(p['layout']['tensors'])} output tensors, {len(p['layout']['layers'])} layers: {text}"
            f" ({copies} renumbered or taken from another model)")


CONSENSUS_OPS = ("ties", "dare_ties", "breadcrumbs_ties", "della")


def budget_line(p: dict) -> str:
    """The budget asked for and, for a first merge, the one it actually uses (everything)."""
    from mergepipe.planner.budget import human_bytes
    b = p["budget"]
    if b.get("first_merge"):
        return (f"  budget     100% = {human_bytes(b['bytes'])} of {human_bytes(p['full_expert_bytes'])} full expert "
                f"read (first merge: every expert is read in full and analyzed on the way; the {b['spec']} asked "
                f"for applies from the next merge)")
    return (f"  budget     {b['spec']} = {human_bytes(b['bytes'])} of {human_bytes(p['full_expert_bytes'])} full "
            f"expert read" + (" (exact + compact bytes)" if p.get("compact") else ""))


def tiers_line(t: dict) -> str:
    """``tiers      exact 12 blocks (3.0 MiB), compact 40 (1.2 MiB: 1 bit 4, 4 bits 36), omitted 8``."""
    from mergepipe.planner.budget import human_bytes
    bits = ", ".join(f"{lv} bit{'s' if lv != '1' else ''} {n}" for lv, n in sorted(t["compact"]["by_bits"].items())
                     if n)
    return (f"  tiers      exact {t['exact']['blocks']} blocks ({human_bytes(t['exact']['bytes'])}), compact "
            f"{t['compact']['blocks']} ({human_bytes(t['compact']['bytes'])}{': ' + bits if bits else ''}), "
            f"omitted {t['omitted']['blocks']}")


def bound_lines(b: dict, norm: str, compact: bool) -> list[str]:
    """The headline bound (the tightest the plan can state) and the looser additive one, labelled."""
    terms = ("|c_i| ||delta|| per omitted block, |c_i| x the stored error norm per compact block"
             if compact else "|c_i| ||delta|| per omitted block")
    return [f"  bound      ||M_full - M_A|| <= {b['absolute']:.6g}  (relative {b['relative']:.3e} of "
            f"||M_full - base|| ~ {norm}; per position, {terms}; positions are disjoint)",
            f"  additive   <= {b['additive']:.6g}  (relative {b['additive_relative']:.3e}: the sum of the same terms "
            f"over all blocks, looser)"]


# How the suggested budget's rule did where it was validated (planner/bounds.py, docs/fidelity)
def suggestion_line(s: dict) -> str:
    """The budget the planner suggests (planner/bounds.py: suggested_budget), with what the rule did in the study."""
    from mergepipe.planner.budget import human_bytes
    from mergepipe.planner.bounds import SUGGEST_VALIDATION
    v = s.get("validation") or SUGGEST_VALIDATION
    return (f"  suggest    budget {100 * s['fraction_of_full']:.0f}% ({human_bytes(s['bytes'])}): the smallest whose "
            f"bound <= {s['bound_fraction']:g} x ||M_full - base||; in the study ({v['where']}), {v['within']} of "
            f"{v['of']} held-out configurations at this rule lost at most 1 point against their full merge"
            + (" (three-way plans)" if v.get("plans") == "tiered" else " (exact-or-omitted plans)" if v.get("plans")
               else ""))
