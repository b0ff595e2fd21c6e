"""What the dashboard shows, computed without Streamlit: DataFrames, Plotly figures, DOT source, path
checks and the formatting of estimates. The pages in ``pages/`` only render what these functions
return; every function is unit-tested without a browser (tests/dashboard/test_views.py).

Big matrices (blocks x experts) are aggregated above ``MAX_CELLS`` cells so that a page stays
responsive on large catalogs; the drill-down views show the detail of one layer or tensor.
"""

# One namespace for the pages (``views.models_df``, ``views.plan_summary``, ...): the functions live in one
# module per page (home, models, runs, catalog, plan, snapshots, lineage) beside the shared formatting, paths and
# figures modules; this module only gathers them.

from __future__ import annotations

import pandas as pd  # noqa: F401  (pages annotate with views.pd.DataFrame)

from mergepipe.dashboard.formatting import (  # noqa: F401
    bound_parts, fmt_bound, fmt_bytes, fmt_cell, fmt_pct, fmt_seconds, MISSING, no_bound_reason, short_fp, table,
)
from mergepipe.dashboard.paths import (  # noqa: F401
    allowed_roots, check_out_path, check_path, db_path, default_out, log_dir, open_catalog,
)
from mergepipe.dashboard.figures import (  # noqa: F401
    aggregate, block_layout, bytes_axis, bytes_ticks, group_of, group_ticks, groups, heatmap_figure, state_figure,
    layer_of, layout_of, MAX_CELLS,
    tensor_sort_key, tensors_in_group,
)
from mergepipe.dashboard.models import (  # noqa: F401
    analyzed_experts, bases, expert_warnings, experts_of, KIND_HELP, model_details, models_df, REGISTER_KINDS,
    registration_base, role_of, stats_version, unanalyzed_experts,
)
from mergepipe.dashboard.home import activity_df, getting_started, merges_without_run, totals  # noqa: F401
from mergepipe.dashboard.runs import (  # noqa: F401
    _parse_ts, ACTIVE, effective_status, latest_run, next_out, run_progress, runs, runs_df,
)
from mergepipe.dashboard.catalog import (  # noqa: F401
    block_stats_df, conflict_heatmap, conflict_matrix, norm_heatmap, norm_matrix, NORM_MODES, NORM_SCALES,
    norm_transform, pairwise, sketch_matrix, tensor_stats_df,
)
from mergepipe.dashboard.plan import (  # noqa: F401
    block_labels, current_point, first_merge_note, frontier_df, frontier_figure, make_plan, mask_heatmap,
    target_default, TARGET_HELP, TARGET_TYPICAL,
    MASK_STATES, mask_matrix, mergekit_plan_settings, omitted_term, op_info, operators, plan_context, plan_experts_df,
    plan_experts_table, plan_view, PlanView,
    check_plan_yaml, PLAN_PAGE_TRI, plan_request, plan_summary, plan_yaml, plans_df, read_config_source, request_key,
    request_key_digest, url_replacements,
    budget_suggestion, candidate_tiers, COMPACT_STATES, compact_mode_help, compact_options, compacts_version,
    mask_levels, mask_state_counts, mask_states, plan_residual, tiers_df, tiers_table, tiers_text,
)
from mergepipe.dashboard.snapshots import (  # noqa: F401
    bytes_bars, bytes_by_expert_df, bytes_by_tensor_df, bytes_figure, bytes_table, load_manifest, manifest_plan,
    budget_quality, delete_preview, evaluation_df, evaluation_inputs, evaluation_models, latest_scores, labels_of, manifest_summary, model_card, parse_tags, signed_bytes, snapshot_recipe, snapshot_view, SnapshotView, snapshots_df, TENSOR_SORTS, top_tensors, with_difference, touched_heatmap, touched_matrix, verify_text,
)
from mergepipe.dashboard.compare import (  # noqa: F401
    access_diff, access_figure, choices, is_full_budget_of, lineage_note, realized_deviation, NOT_MERGED, numbers_df, plan_side, scores_df, settings_diff, side,
)
from mergepipe.dashboard.changes import changes_since  # noqa: F401
from mergepipe.dashboard.lineage import (  # noqa: F401
    lineage_dot, lineage_nodes_df, node_target,
)
