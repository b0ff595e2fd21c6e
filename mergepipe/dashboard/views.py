"""What the dashboard shows, computed without Streamlit: DataFrames, Plotly figures, DOT source, path
checks and the formatting of estimates. The pages in ``pages/`` only render what these functions
return; every function is unit-tested without a browser (tests/dashboard/test_views*.py).

Big matrices (blocks x experts) are aggregated above ``figures.MAX_CELLS`` cells so that a page stays
responsive on large catalogs; the drill-down views show the detail of one layer or tensor.

This module is the pages' surface (``views.models_df``, ``views.plan_summary``, ...): exactly the names
``pages/`` and ``app.py`` call, gathered from the module that defines each. Everything else (helpers,
intermediate matrices, constants the pages do not read) is imported from its defining module
(``mergepipe.dashboard.plan``, ``.snapshots``, ``.figures``, ...). A page that needs a new name adds it
here. The surface, by defining module:

``formatting``
    fmt_bytes, short_fp, table
``paths``
    allowed_roots, check_out_path, check_path, db_path, log_dir, open_catalog
``figures``
    block_layout, groups, heatmap_figure, tensors_in_group
``models``
    analyzed_experts, bases, expert_warnings, experts_of, KIND_HELP, model_details, models_df,
    REGISTER_KINDS, registration_base, stats_version, unanalyzed_experts
``home``
    activity_df, getting_started, totals
``runs``
    latest_run, next_out, run_progress, runs, runs_df
``catalog``
    block_stats_df, conflict_heatmap, conflict_matrix, norm_heatmap, norm_matrix, NORM_MODES, NORM_SCALES,
    norm_transform, tensor_stats_df
``plan``
    op_info, operators, plan_context, plan_experts_table, plan_request, plan_summary, plan_view, plans_df,
    request_key, request_key_digest, target_default, TARGET_HELP, TARGET_TYPICAL, url_replacements, plan_mask,
    MASK_TOP
``plan_tiers``
    compact_mode_help, compact_options, compacts_version
``plan_config``
    check_plan_yaml, mergekit_plan_settings, plan_yaml, read_config_source
``snapshots``
    budget_quality, bytes_bars, bytes_table, delete_preview, evaluation_df, evaluation_inputs,
    evaluation_models, labels_of, model_card, parse_tags, snapshot_view, snapshots_df, TENSOR_SORTS,
    top_tensors, verify_text
``compare``
    access_diff, access_figure, choices, lineage_note, numbers_df, realized_deviation, scores_df,
    settings_diff, side
``changes``
    changes_since
``lineage``
    lineage_dot, lineage_nodes_df, node_target
``search``
    best_recipe, check_search_yaml, example_search_yaml, importance_figure, importance_note, launch_outcome,
    OBJECTIVE_HELP, publish_outcome, published_snapshot, search_labels, search_publish_dir, search_score_figure,
    search_status, search_steps_df, search_trials_df, search_work_dir
"""

from __future__ import annotations

from mergepipe.dashboard.formatting import fmt_bytes, short_fp, table  # noqa: F401
from mergepipe.dashboard.paths import (  # noqa: F401
    allowed_roots, check_out_path, check_path, db_path, log_dir, open_catalog,
)
from mergepipe.dashboard.figures import block_layout, groups, heatmap_figure, tensors_in_group  # noqa: F401
from mergepipe.dashboard.models import (  # noqa: F401
    analyzed_experts, bases, expert_warnings, experts_of, KIND_HELP, model_details, models_df, REGISTER_KINDS,
    registration_base, stats_version, unanalyzed_experts,
)
from mergepipe.dashboard.home import activity_df, getting_started, totals  # noqa: F401
from mergepipe.dashboard.runs import latest_run, next_out, run_progress, runs, runs_df  # noqa: F401
from mergepipe.dashboard.catalog import (  # noqa: F401
    block_stats_df, conflict_heatmap, conflict_matrix, norm_heatmap, norm_matrix, NORM_MODES, NORM_SCALES,
    norm_transform, tensor_stats_df,
)
from mergepipe.dashboard.plan import (  # noqa: F401
    op_info, operators, plan_context, plan_experts_table, plan_request, plan_summary, plan_view, plans_df,
    request_key, request_key_digest, target_default, TARGET_HELP, TARGET_TYPICAL, url_replacements, plan_mask, MASK_TOP,
)
from mergepipe.dashboard.plan_tiers import compact_mode_help, compact_options, compacts_version  # noqa: F401
from mergepipe.dashboard.plan_config import (  # noqa: F401
    check_plan_yaml, mergekit_plan_settings, plan_yaml, read_config_source,
)
from mergepipe.dashboard.snapshots import (  # noqa: F401
    budget_quality, bytes_bars, bytes_table, delete_preview, evaluation_df, evaluation_inputs, evaluation_models,
    labels_of, model_card, parse_tags, snapshot_view, snapshots_df, TENSOR_SORTS, top_tensors, verify_text,
)
from mergepipe.dashboard.compare import (  # noqa: F401
    access_diff, access_figure, choices, lineage_note, numbers_df, realized_deviation, scores_df, settings_diff,
    side,
)
from mergepipe.dashboard.changes import changes_since  # noqa: F401
from mergepipe.dashboard.lineage import lineage_dot, lineage_nodes_df, node_target  # noqa: F401
from mergepipe.dashboard.search import (  # noqa: F401
    best_recipe, check_search_yaml, example_search_yaml, importance_figure, importance_note, launch_outcome,
    OBJECTIVE_HELP, publish_outcome, published_snapshot, search_labels, search_publish_dir, search_score_figure,
    search_status, search_steps_df, search_trials_df, search_work_dir,
)
