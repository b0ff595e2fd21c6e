"""mergekit YAML configs: read one into planner arguments, and write a stored plan back as one.

mergekit users describe a merge in YAML (``models:`` with per-model ``parameters``, ``base_model``,
``merge_method``, global ``parameters``, ``dtype``/``out_dtype``, ``tokenizer_source`` or ``tokenizer:``,
``chat_template``). This module
lets them keep doing so:

* :func:`parse_config` (parse.py) validates the YAML without touching a catalog. ``weight`` and ``density`` may be
  mergekit settings (per-tensor ``filter`` conditions, gradients over the layers), resolved with
  mergekit's precedence (a model's own value, else the global one) by the planner. Everything
  MergePipe cannot do exactly is refused with one message naming the key (filters or
  gradients of the other parameters, unknown merge methods and parameters, tokenizer settings that
  would move embedding rows); nothing is silently approximated. Tokenizer settings are resolved against
  the models' vocabularies by resolve.py. ``dtype`` and ``out_dtype`` may be any float type: MergePipe
  computes in float32 whatever they say and writes ``out_dtype``, else ``dtype``, as mergekit does.
* ``slices:`` and ``modules:`` (slices.py reads them, slice_expand.py expands them, slice_export.py writes them
  back; modules.py for multi-module architectures): layer ranges, frankenmerges and per-slice parameters are
  expanded into the plan's ``layout`` and per-tensor settings (see those modules for what is refused).
* :func:`prepare` (resolve.py) maps each model reference to a catalog model: a registered id is used as is; a path
  is matched to a registered model by uri and fingerprint, or else registered under an id derived
  from its folder name (the merge analyzes it on the way); ``BASE+ADAPTER`` registers a PEFT LoRA adapter against the base.
  It only looks; :func:`plan_from_config` then applies the registrations and plans inside one catalog
  transaction, so a config that fails anywhere before the merge starts leaves the catalog unchanged.
* :func:`export_mergekit` (export.py) writes a stored plan or snapshot as the equivalent YAML; merging from that
  YAML gives the same plan digest (the budget, strategy and seed travel in a ``mergepipe:`` key).

Budgets are not a mergekit concept: they come from ``--budget`` or the ``mergepipe:`` extension key.
"""
