"""Shared fixtures for the catalog-foundation tests: small generated families, fresh catalogs, and
helpers to hand-craft safetensors files, load reference tensors and dump a catalog for comparison; and the
test markers (slow, e2e, parity, remote, ray, quick), applied by path in `pytest_collection_modifyitems`."""

from __future__ import annotations

import fnmatch
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.research.family import make_family
from mergepipe.catalog.models import register
from mergepipe.storage.safetensors import INDEX_NAME
from mergepipe.storage.local import proc_io


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """Compile (or load from numba's on-disk cache) the fused merge kernels once, before any test: a
    first compile imports numba's compiler modules, which a cold-read test would count as disk reads."""
    from mergepipe.ops import kernels
    kernels.warm_up()


@dataclass(frozen=True)
class Family:
    root: Path
    base: Path
    experts: tuple[Path, ...]
    dtype: str
    sharded: bool

    def all_dirs(self) -> list[Path]:
        return [self.base, *self.experts]


# name -> (size, dtype, shard_bytes, experts). Tiny models (~107k params) cut into small shards.
FAMILY_SPECS = {
    "fp32-sharded": ("tiny", "fp32", 64 << 10, 2),
    "bf16-sharded": ("tiny", "bf16", 32 << 10, 2),
    "fp16-single": ("tiny", "fp16", 1 << 30, 2),
    "fp32-single": ("tiny", "fp32", 1 << 30, 1),
}


def build_family(root: Path, name: str, seed: int = 0) -> Family:
    size, dtype, shard_bytes, experts = FAMILY_SPECS[name]
    paths = make_family(root, experts=experts, size=size, dtype=dtype, shard_bytes=shard_bytes, seed=seed)
    fam = Family(Path(root), Path(paths["base"]), tuple(Path(p) for p in paths["experts"]), dtype,
                 sharded=(Path(paths["base"]) / INDEX_NAME).exists())
    return fam


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> dict[str, Family]:
    """Every family in FAMILY_SPECS, built once per session; tests must only read them."""
    out = {}
    for name in FAMILY_SPECS:
        out[name] = build_family(tmp_path_factory.mktemp(name), name)
    assert out["fp32-sharded"].sharded and out["bf16-sharded"].sharded
    assert not out["fp16-single"].sharded and not out["fp32-single"].sharded
    return out


@pytest.fixture(params=list(FAMILY_SPECS))
def family(request, families) -> Family:
    return families[request.param]


@pytest.fixture(scope="session")
def fam_fp32(families) -> Family:
    return families["fp32-sharded"]


@pytest.fixture(scope="session")
def fam_bf16(families) -> Family:
    return families["bf16-sharded"]


@pytest.fixture
def fresh_family(tmp_path) -> Family:
    """A private tiny fp32 sharded family that a test may modify."""
    return build_family(tmp_path / "fam", "fp32-sharded")


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog(tmp_path / "catalog.sqlite")
    yield cat
    cat.close()


def register_family(cat: Catalog, fam: Family, prefix: str = "") -> list[str]:
    register(cat, prefix + "base", str(fam.base))
    ids = []
    for i, e in enumerate(fam.experts, start=1):
        register(cat, f"{prefix}expert_{i}", str(e), base_id=prefix + "base")
        ids.append(f"{prefix}expert_{i}")
    return ids


# Small blocks so that the larger matrices of the tiny families are cut into several blocks.
ANALYZE_BLOCK_BYTES = 8192


@pytest.fixture(scope="session")
def analyzed(tmp_path_factory, families):
    """name -> Catalog holding that family registered and analyzed on an 8 KiB grid (read-only)."""
    out = {}
    cats = []
    for name in ("fp32-sharded", "bf16-sharded"):
        cat = Catalog(tmp_path_factory.mktemp("cat-" + name) / "catalog.sqlite")
        cats.append(cat)
        register_family(cat, families[name])
        analyze(cat, block_bytes=ANALYZE_BLOCK_BYTES)
        out[name] = cat
    yield out
    for cat in cats:
        cat.close()


# --- dashboard ----------------------------------------------------------------------------------
# Shared by the dashboard tests. Here and not in tests/dashboard/conftest.py: a second conftest.py (no
# __init__.py) would take the module name `conftest`, and `from conftest import ...` in later test files
# would then find the wrong one. A module that needs another catalog (the Sweeps page: no merge; the
# compact Plan page: compacts) defines its own `built`.
@pytest.fixture(scope="module")
def built(request, tmp_path_factory):
    """dashboard_helpers.build_catalog: the tiny analyzed and merged family, one per test module, read-only."""
    from dashboard_helpers import build_catalog
    return build_catalog(tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_")))


@pytest.fixture
def env(built, tmp_path, monkeypatch):
    """A private copy of `built`'s catalog shown by the app (MERGEPIPE_DB, allowed roots): AppTest page tests."""
    from dashboard_helpers import page_env
    return page_env(built, tmp_path, monkeypatch)


# --- helpers ------------------------------------------------------------------------------------
def load_checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint (file or directory) through the safetensors library."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def to_np32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def write_raw_safetensors(path: Path, header: dict, data: bytes, header_len: int | None = None) -> Path:
    """Write 8-byte LE header length + JSON header + data, exactly as given (no validation)."""
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    Path(path).write_bytes(struct.pack("<Q", n) + raw + data)
    return Path(path)


def dump_catalog(cat: Catalog) -> dict[str, list[tuple]]:
    """Every row of every table, sorted: two equal dumps mean nothing in the catalog changed."""
    tables = [r[0] for r in cat.conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
    out = {}
    for t in tables:
        rows = cat.conn.execute(f"SELECT * FROM {t}").fetchall()
        out[t] = sorted(rows, key=repr)
    return out


def dump_catalog_file(path: Path) -> dict[str, list[tuple]]:
    cat = Catalog(path, create=False)
    try:
        return dump_catalog(cat)
    finally:
        cat.close()


def read_bytes_now() -> int:
    return proc_io()["read_bytes"]


def fsync_tree(*paths: Path) -> None:
    """Flush files to disk so that eviction really drops them from the page cache."""
    for p in paths:
        p = Path(p)
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# --- markers ------------------------------------------------------------------------------------
# The heavy tests, classified by where they live: marker -> node-id patterns (fnmatch, `*` crosses `/`; a
# pattern without "::" names whole files). A new file under tests/parity/ is `parity` with no edit here; an
# explicit `@pytest.mark.slow` (or any of these) on a test or a module works as well. The markers are
# described in pyproject.toml. Every test with none of them also gets `quick`: `pytest -m quick` is the
# quick loop (CONTRIBUTING.md). Nothing is deselected by default: plain `pytest` runs everything.
MARKER_RULES: dict[str, tuple[str, ...]] = {
    # against mergekit 0.1.5 (tests/parity, and the vocabulary merges' parity cases in tests/engine)
    "parity": ("tests/parity/*", "tests/engine/test_vocab_interp.py::test_parity_with_mergekit",
               "tests/engine/test_vocab_stats.py::test_parity_with_mergekit",
               "tests/engine/test_vocab_stats.py::test_breadcrumbs_parity_with_mergekit",
               "tests/engine/test_vocab_shapes.py::test_parity_with_mergekit",
               "tests/engine/test_vocab_merge.py::test_parity_with_mergekit"),
    # Debian's chromium driven by Playwright against a real Streamlit server
    "e2e": ("tests/dashboard/test_e2e*.py", "tests/dashboard/test_a11y.py", "tests/dashboard/test_demo_dashboard.py",
            "tests/dashboard/test_direct_page.py"),
    # a Range HTTP server, `mergepipe serve` or moto's S3 server on loopback
    "remote": ("tests/storage/test_remote_*.py", "tests/storage/test_serve.py",
               "tests/storage/test_hub_publish.py", "tests/cli/test_reproduce.py",
               "tests/dashboard/test_snapshots_publish.py",
               "tests/storage/test_hub_ids.py", "tests/cli/test_preflight.py",
               "tests/planner/test_coalesce.py::test_a_coalescing_plan_*",
               "tests/planner/test_coalesce.py::test_coalesce_flags_on_the_command_line",
               "tests/test_benchmarks.py::test_remote_*"),
    # a local Ray cluster (ray.init or `--executor ray` in a subprocess)
    "ray": ("tests/engine/test_ray_*.py", "tests/*::*_on_ray_*"),
    # the individually slowest of the rest: every test function with a case over 1 s in `--durations` on a loaded
    # 2-core machine (crash and SIGKILL tests, CLI subprocesses, fuzzing, the benchmark profiles)
    "slow": (
        "tests/test_markers.py",  # collects the whole suite in subprocesses
        "tests/search/test_search.py::test_cli_json_names_the_best_parameters",
        "tests/search/test_search.py::test_task_suite_and_perplexity_objectives_with_a_held_out_split",
        "tests/search/test_search.py::test_same_seed_same_trials",
        "tests/search/test_search.py::test_bad_spaces_are_one_error_naming_the_key",
        "tests/storage/test_sources.py::test_analyze_stats_match_twins_and_read_adapter_bytes_only",
        "tests/dashboard/test_compact_plan.py::test_plan_page_compact_note",
        "tests/dashboard/test_pages_daily.py::test_snapshot_deep_link_with_two_snapshots",
        "tests/engine/test_vocab_stats.py::test_budget_keeps_the_embedding_rows",
        "tests/analyze/test_analyze.py::test_block_stats_equal_numpy_reference",
        "tests/analyze/test_analyze.py::test_out_of_memory_path_gives_identical_results",
        "tests/analyze/test_analyze.py::test_thresholds_exact_whatever_share_of_deltas_has_low_bits",
        "tests/analyze/test_analyze_nan_small_blocks.py::test_analyze_nan_small_blocks_counts_and_planner_refuses",
        "tests/analyze/test_compact_store.py::test_cli_analyze_compact_reports_growth",
        "tests/analyze/test_compact_store.py::test_crash_around_the_compact_write_leaves_no_half_compact",
        "tests/catalog/test_kill_register_analyze.py::test_sigkill_during_analyze",
        "tests/catalog/test_kill_register_analyze.py::test_sigkill_during_register",
        "tests/catalog/test_register_fast.py::test_catalog_commands_import_no_torch_numpy_or_pandas",
        "tests/catalog/test_register_race.py::test_same_checkpoint_twice_both_succeed",
        "tests/catalog/test_register_race.py::test_two_checkpoints_one_id_one_wins_other_one_line_error",
        "tests/catalog/test_sketch.py::test_sketch_estimates_match_exact_block_values",
        "tests/cli/test_cli_broken_pipe.py::test_reader_gone_before_any_output",
        "tests/cli/test_cli_catalog.py::test_console_script_subprocess",
        "tests/cli/test_cli_dashboard.py::test_listings_fit_80_columns",
        "tests/cli/test_cli_delete.py::test_evaluate_stores_and_reuses",
        "tests/cli/test_cli_fast.py::test_plan_and_explain_import_no_torch",
        "tests/cli/test_cli_merge.py::test_mergekit_config_through_the_real_executable",
        "tests/cli/test_cli_merge.py::test_original_quick_start_spelling",
        "tests/cli/test_cli_watch.py::test_watch_picks_up_a_new_and_a_changed_expert_and_stops_on_sigterm",
        "tests/cli/test_cli_watch.py::test_watch_survives_sigkill_in_the_middle_of_a_merge",
        "tests/cli/test_cli_watch_stalled.py::test_a_stalled_preallocated_checkpoint_waits_and_is_taken_once_written",
        "tests/config/test_config_malformed.py::test_huge_integers",
        "tests/config/test_hostile_configs.py::test_recipe_out_pattern_allows_plain_fields_only",
        "tests/config/test_hostile_configs.py::test_sweep_config_goes_through_the_allowed_roots",
        "tests/config/test_hostile_configs.py::test_sweep_grid_of_a_trillion_points_is_refused_before_it_is_built",
        "tests/config/test_hostile_configs.py::test_sweep_with_a_5000_digit_number",
        "tests/config/test_hostile_configs.py::test_yaml_alias_bomb_through_merge_cli",
        "tests/config/test_mergekit_config.py::test_config_equals_cli_flags",
        "tests/config/test_mergekit_config.py::test_gradient_densities_are_analyzed_on_the_way",
        "tests/config/test_mergekit_config.py::test_lora_adapter_merges_from_yaml",
        "tests/config/test_mergekit_config.py::test_paths_registered_analyzed_then_reused",
        "tests/config/test_recipe.py::test_versions_change_only_with_the_content",
        "tests/config/test_tokenizers.py::test_chat_template_named_and_auto",
        "tests/config/test_tokenizers.py::test_parity_with_mergekit_tokenizer_source_and_chat_template",
        "tests/config/test_tokenizers.py::test_tokenizer_source_model_copies_its_files",
        "tests/dashboard/test_compact_plan.py::test_mask_has_exactly_the_plans_blocks_in_each_state",
        "tests/dashboard/test_compact_plan.py::test_plan_page_shows_the_compact_tier",
        "tests/dashboard/test_pages.py::test_models_analyze_with_progress",
        "tests/dashboard/test_pages.py::test_models_register_delta_and_lora",
        "tests/dashboard/test_pages.py::test_plan_widgets_come_from_the_operator_declarations",
        "tests/dashboard/test_pages.py::test_run_launch_and_watch",
        "tests/dashboard/test_pages_daily.py::test_compare_page",
        "tests/dashboard/test_pages_daily.py::test_snapshots_evaluate_with_progress",
        "tests/dashboard/test_pages_daily.py::test_snapshots_tags_note_and_delete",
        "tests/dashboard/test_pages_quality.py::test_compare_measures_the_realized_deviation_against_the_bound",
        "tests/dashboard/test_pages_quality.py::test_snapshots_evaluate_a_task_suite",
        "tests/engine/test_engine.py::test_budget_sound_and_error_bound_property",
        "tests/engine/test_engine.py::test_cold_cache_bytes_match_plan",
        "tests/engine/test_extend.py::test_cli_extend_records_an_extends_edge_and_refuses_in_one_line",
        "tests/engine/test_extend.py::test_random_sequences_of_changes_match_the_reference",
        "tests/engine/test_extend.py::test_reads_are_the_snapshot_the_expert_and_the_needed_base_blocks_cold",
        "tests/engine/test_extend_delete_race.py::test_a_delete_that_commits_before_the_extend_wins_and_nothing_is_published",
        "tests/engine/test_extend_delete_race.py::test_an_extend_that_commits_first_makes_the_delete_refuse_and_put_the_folder_back",
        "tests/engine/test_extend_delete_race.py::test_delete_is_refused_while_an_extend_reads_the_snapshot",
        "tests/engine/test_extend_delete_race.py::test_free_races_end_in_one_consistent_outcome",
        "tests/engine/test_extend_parent_integrity.py::test_an_untouched_parent_extends_and_the_child_verifies",
        "tests/engine/test_extend_parent_integrity.py::test_extend_refuses_a_parent_changed_in_place_with_its_mtime_restored",
        "tests/engine/test_extend_refusals.py::test_adding_an_expert_already_in_the_snapshot_says_so",
        "tests/engine/test_extend_refusals.py::test_changing_an_expert_the_snapshot_does_not_hold_is_refused_plainly",
        "tests/engine/test_extend_refusals.py::test_offered_command_for_a_remove_runs",
        "tests/engine/test_extend_refusals.py::test_offered_command_for_an_add_keeps_the_snapshots_settings_and_publishes",
        "tests/engine/test_faults.py::test_catalog_disk_full_during_analyze",
        "tests/engine/test_faults.py::test_catalog_disk_full_during_analyze_run",
        "tests/engine/test_faults.py::test_disk_full_during_merge",
        "tests/engine/test_faults.py::test_io_error_at_fsync",
        "tests/engine/test_faults.py::test_io_faults_during_merge",
        "tests/engine/test_faults.py::test_output_on_read_only_filesystem",
        "tests/engine/test_first_merge.py::test_cancelled_first_merge_cli",
        "tests/engine/test_sweep.py::test_a_local_sweep_from_the_cli_scores_each_output",
        "tests/engine/test_sweep.py::test_a_refused_sweep_config_changes_nothing",
        "tests/engine/test_txn_crash.py::test_crash_at_each_step",
        "tests/engine/test_txn_crash.py::test_sigkill_merge_at_many_points",
        "tests/engine/test_txn_crash.py::test_sigterm_aborts_cleanly",
        "tests/engine/test_vocab_merge.py::test_parity_with_mergekit",
        "tests/engine/test_vocab_stats.py::test_analyzed_on_the_way_over_reordered_rows",
        "tests/engine/test_vocab_stats.py::test_bf16_with_float32_compute",
        "tests/engine/test_vocab_stats.py::test_della_statistically_equal_mergekit",
        "tests/manifest/test_manifest.py::test_output_loads_with_transformers",
        "tests/manifest/test_snapshot_diff.py::test_lineage_page_shows_changes_since",
        "tests/ops/test_kernels.py::test_engine_fused_equals_torch_path",
        "tests/ops/test_ops_reference.py::test_full_budget_equals_naive_fp32",
        "tests/oracle/test_budgeted_outputs.py::test_budgeted_output_equals_oracle",
        "tests/oracle/test_budgeted_outputs.py::test_cold_reads_match_plan_for_every_operator",
        "tests/oracle/test_compact_outputs.py::test_sparsified_bound_is_sound",
        "tests/oracle/test_compact_outputs.py::test_tiered_output_equals_oracle",
        "tests/research/test_encoder_fidelity.py::test_budgeted_merges_scored_with_each_head",
        "tests/research/test_encoder_fidelity.py::test_family_layout_and_update_structure",
        "tests/research/test_encoder_fidelity.py::test_merged_accuracy_matches_one_sentence_at_a_time",
        "tests/research/test_encoder_parallel.py::test_pool_runs_jobs_and_stops_the_rest_at_the_deadline",
        "tests/research/test_evaluate_inputs.py::test_a_deep_suite_line_through_the_real_cli",
        "tests/research/test_evaluate_inputs.py::test_a_new_window_or_token_limit_is_scored_and_stored_apart",
        "tests/research/test_evaluate_roots.py::test_a_union_merge_refuses_a_tokenizer_linked_out_of_the_roots",
        "tests/research/test_evaluate_roots.py::test_evaluate_files_outside_the_roots_are_refused",
        "tests/research/test_evaluate_roots.py::test_evaluate_inside_the_roots_still_scores",
        "tests/research/test_evaluate_roots.py::test_evaluate_refuses_a_tokenizer_linked_out_of_the_roots",
        "tests/research/test_evaluate_roots.py::test_evaluate_without_transformers_says_which_extra_to_install",
        "tests/research/test_fidelity.py::test_accuracy_matches_an_independent_count",
        "tests/research/test_fidelity.py::test_budgeted_additive_merge_stays_within_bound",
        "tests/research/test_fidelity.py::test_evaluate_cli",
        "tests/research/test_fidelity.py::test_training_is_reproducible",
        "tests/storage/test_bin_bombs.py::test_pickle_bomb_is_refused_before_it_is_built",
        "tests/storage/test_bin_bombs.py::test_the_op_count_is_checked_in_process",
        "tests/storage/test_bin_checkpoints.py::test_bin_family_merges_bit_equal_to_safetensors_twin",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_adapter_config",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_config_json",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_header_byte_flips_and_truncations",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_header_fields",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_header_framing",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_manifest",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_shard_index",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_sweep",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_task_suite",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_tokenizer_files",
        "tests/storage/test_fuzz_parsers.py::test_fuzz_yaml_config",
        "tests/storage/test_sources.py::test_adapter_pairs_and_scales_follow_peft",
        "tests/storage/test_sources.py::test_cold_merge_reads_adapter_and_delta_bytes_not_full_experts",
        "tests/storage/test_sources.py::test_extend_with_lora_and_delta_experts_equals_the_reference",
        "tests/storage/test_sources.py::test_full_budget_merges_equal_materialised_twins",
        "tests/storage/test_sources.py::test_lora_delta_equals_peft_merge_and_unload",
        "tests/storage/test_sources.py::test_malformed_adapters_are_refused_and_change_nothing",
        "tests/test_benchmarks.py::test_ci_profile_bytes_are_sane",
        "tests/test_benchmarks.py::test_compact_smoke",
        "tests/test_benchmarks.py::test_first_merge_ci_profile",
        "tests/test_docs.py::test_mkdocs_build_strict",
    ),
}
HEAVY_MARKERS = tuple(MARKER_RULES)


def _rule_matches(nodeid: str, pattern: str) -> bool:
    if "::" not in pattern:
        target = nodeid.split("::", 1)[0]
    else:  # a function name covers all its parametrized cases
        target = nodeid if "[" in pattern else nodeid.split("[", 1)[0]
    return fnmatch.fnmatchcase(target, pattern)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, patterns in MARKER_RULES.items():
            if item.get_closest_marker(marker) is None and any(_rule_matches(item.nodeid, p) for p in patterns):
                item.add_marker(marker)
        if not any(item.get_closest_marker(m) for m in HEAVY_MARKERS):
            item.add_marker("quick")
