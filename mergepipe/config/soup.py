"""Model soups: mergekit's ``linear`` (and ``karcher``) over models without a ``base_model`` (mergekit's
linear and karcher ignore the base; they average the models listed), or linear with the base_model listed
among the models. karcher averages its base in anyway: with a reference it is simply the base (equal
weights; the Gram statistics and the budget work as with any base).

MergePipe stores and plans experts as deltas against a base, so a soup without one is planned against a
**reference model**: the first model listed. It is read in full (as any base); every other model is
registered as an expert against it, analyzed as a delta against it, and budgeted like any additive merge
(an omitted block of a model means its values there are the reference's; the additive error bound holds,
with coefficients w_i / sum of all weights, the reference's included). The reference is averaged in with
its own weight (``MergeRequest.base_member``), and at full budget every block is merged in mergekit's
float32 operation order (ops/linear.soup_block): bit-equal to mergekit's output.

Why the first model: the choice is free for the result (the average is the same whichever model is the
reference), and mergekit takes the output's config.json and tokenizer from one of the models (an
arbitrary one of its referenced-model set when there is no base_model); the first listed is the one a
reader of the config expects, and it keeps the summation order mergekit's (reference first).
"""

from __future__ import annotations

from mergepipe.config.model import ConfigModel

def member(m: ConfigModel, position: int, reference: bool) -> dict:
    """The base's place in the soup: its weight setting (mergekit's default 1), position among the models."""
    return {"weight": 1.0 if m.weight is None else m.weight, "position": position, "reference": reference}
