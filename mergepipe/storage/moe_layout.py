"""The fused MoE layout of transformers v5, which mergekit 0.1.5 writes (issue 32, part 4).

Mixtral and Qwen3-MoE checkpoints on the Hub mostly hold one matrix per expert
(``model.layers.L.block_sparse_moe.experts.E.w1.weight``, ``...mlp.experts.E.gate_proj.weight``).
transformers v5 loads them into fused tensors, and mergekit 0.1.5 merges and writes those:

* ``<layer>.mlp.experts.gate_up_proj`` ``[E, 2I, H]``: per expert its gate matrix (Mixtral's w1) then its up
  matrix (w3), stacked over the experts;
* ``<layer>.mlp.experts.down_proj`` ``[E, H, I]``: the experts' down matrices (w2), stacked;
* Mixtral's ``block_sparse_moe.`` is renamed ``mlp.`` (its router: ``mlp.gate.weight``).

A fused tensor is, byte for byte, its members one after the other in that order (row-major stacking and
concatenation along the rows). So MergePipe merges the per-expert matrices as it always does (same grid,
same blocks, same reads) and only writes them under the fused names: the members of one fused tensor are
written consecutively, at their offsets inside it (storage/writers.py ``plan_shards``).

This module is pure naming: which output tensors a fused layout writes, from the names and shapes."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from mergepipe.errors import MergePipeError

LAYOUTS = ("auto", "fused", "per-expert")  # auto: mergekit's (fused for the families below)


@dataclass(frozen=True)
class MoeRule:
    rename: tuple[str, str] | None  # a module renamed in every tensor name (Mixtral's block_sparse_moe -> mlp)
    gate_up: tuple[str, str]  # the per-expert matrices concatenated into gate_up_proj, in order
    down: str  # the per-expert matrix stacked into down_proj


# config.json's architecture -> how transformers v5 (and mergekit 0.1.5's architecture files) fuse it
FAMILIES = {
    "MixtralForCausalLM": MoeRule((".block_sparse_moe.", ".mlp."), ("w1", "w3"), "w2"),
    "Qwen3MoeForCausalLM": MoeRule(None, ("gate_proj", "up_proj"), "down_proj"),
}
_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<w>[A-Za-z0-9_]+)\.weight$")


def rule_of(architecture: str | None) -> MoeRule | None:
    """The fusing rule of a catalog architecture string (``MixtralForCausalLM``; None: not a fused family)."""
    for name in (architecture or "").split(","):
        if name in FAMILIES:
            return FAMILIES[name]
    return None


def has_per_expert(architecture: str | None, names) -> bool:
    """Whether a checkpoint of a fused family holds per-expert matrices (then a fused layout changes the output)."""
    rule = rule_of(architecture)
    return rule is not None and any((m := _EXPERT.match(n)) and m["w"] in (*rule.gate_up, rule.down) for n in names)


def _renamed(rule: MoeRule, name: str) -> str:
    return name.replace(*rule.rename) if rule.rename else name


def fused_order(architecture: str, infos: list) -> tuple[list, dict[str, tuple[str, tuple]]]:
    """(the output tensors with each fused tensor's members consecutive, at the place of its first member;
    ``heads``: member or renamed tensor name -> (the name written, the fused shape)). Refused (MergePipeError)
    when the experts of a layer do not fuse (missing experts, other shapes or dtypes)."""
    rule = rule_of(architecture)
    groups: dict[str, list] = {}  # fused name -> [(expert, position, info)]
    heads: dict[str, tuple[str, tuple]] = {}
    slot: dict[str, str] = {}  # member name -> fused name
    for info in infos:
        m = _EXPERT.match(info.name)
        if m and m["w"] in (*rule.gate_up, rule.down):
            pre = _renamed(rule, m["pre"])
            fused = f"{pre}.down_proj" if m["w"] == rule.down else f"{pre}.gate_up_proj"
            pos = 0 if m["w"] == rule.down else rule.gate_up.index(m["w"])
            groups.setdefault(fused, []).append((int(m["e"]), pos, info))
            slot[info.name] = fused
        elif _renamed(rule, info.name) != info.name:
            heads[info.name] = (_renamed(rule, info.name), tuple(info.shape))
    for fused, members in groups.items():
        members.sort(key=lambda x: x[:2])
        heads.update({i.name: (fused, _fused_shape(fused, members, len(rule.gate_up))) for _, _, i in members})
    order, done = [], set()
    for info in infos:
        fused = slot.get(info.name)
        if fused is None:
            order.append(info)
        elif fused not in done:
            done.add(fused)
            order.extend(i for _, _, i in groups[fused])
    return order, heads


def _fused_shape(fused: str, members: list, n_parts: int) -> tuple:
    """The shape of a fused tensor, after checking its members: every expert 0..E-1 with each part, one
    shape and one dtype."""
    experts = sorted({e for e, _, _ in members})
    parts = 1 if fused.endswith(".down_proj") else n_parts
    shapes = {tuple(i.shape) for _, _, i in members}
    dtypes = {i.dtype for _, _, i in members}
    if experts != list(range(len(experts))) or len(members) != len(experts) * parts or len(shapes) != 1 \
            or len(dtypes) != 1 or len(next(iter(shapes))) != 2:
        raise MergePipeError(f"the experts of {fused} do not fuse (experts {experts[:8]}, shapes "
                             f"{sorted(shapes)[:3]}, dtypes {sorted(dtypes)}): write them per expert "
                             f"(--moe-layout per-expert, or `moe_layout: per-expert` under `mergepipe:`)")
    rows, cols = next(iter(shapes))
    return (len(experts), rows * parts, cols)


def member_info(info, heads: dict):
    """A written tensor as a header entry: its name and shape in the fused layout (itself when not fused)."""
    head = heads.get(info.name)
    return info if head is None else replace(info, name=head[0], shape=head[1])
