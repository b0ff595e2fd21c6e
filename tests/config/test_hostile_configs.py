"""Hostile configs (issue 28): YAML alias bombs, unbounded reprs in messages, sweep grids of 10^12 points,
5,000-digit numbers, sweep files outside the allowed roots, recipe output patterns with format specs
and attribute access. Each is refused before anything big is built: one `error:` line, exit 2, in a
second or two, at a bounded peak RSS, the catalog file byte-identical."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mergepipe.catalog.db import Catalog
from mergepipe.config.model import ConfigError
from mergepipe.config.parse import MAX_NODES, parse_config
from mergepipe.config.recipe import Recipe
from mergepipe.config.sweep import load_sweep, parse_sweep
from mergepipe.dashboard import views
from mergepipe.errors import MergePipeError, PlanError, brief
from mergepipe.ops.core import get_op
from mergepipe.planner.settings import check_setting
from rss_helpers import cli, measured, one_error_line

PEAK_MIB = 200  # the CLI refusing a config peaks at ~45 MiB; the bombs reached 4-5 GiB before


def laughs(levels: int = 9, width: int = 10, indent: str = "  ") -> str:
    """A YAML block list whose last item expands to width**levels values (1 KB of text for 10^9)."""
    names = "abcdefghijklmnop"
    lines = [f"{indent}- &{names[0]} [{','.join(['x'] * width)}]"]
    lines += [f"{indent}- &{names[i]} [{','.join(['*' + names[i - 1]] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


BOMBS = {
    "base_model": "merge_method: linear\nmodels: [{model: a}]\nbase_model:\n" + laughs(),
    "dtype": "merge_method: linear\nbase_model: b\nmodels: [{model: a}]\ndtype:\n" + laughs(),
    "budget": "merge_method: linear\nbase_model: b\nmodels: [{model: a}]\nmergepipe:\n  budget:\n" + laughs(indent="    "),
}


def shared_bomb(levels: int = 9):
    """10^levels leaves in memory as PyYAML builds an alias bomb: one list object shared at each level."""
    value = ["x"] * 10
    for _ in range(levels - 1):
        value = [value] * 10
    return value


@pytest.fixture
def db(tmp_path) -> Path:
    Catalog(tmp_path / "catalog.sqlite").close()
    return tmp_path / "catalog.sqlite"


# --- item 1: alias bombs and bounded reprs -----------------------------------------------------------
@pytest.mark.parametrize("key", sorted(BOMBS))
def test_yaml_alias_bomb_through_merge_cli(key, db, tmp_path):
    assert len(BOMBS[key]) < 1024
    cfg = tmp_path / "bomb.yml"
    cfg.write_text(BOMBS[key])
    before = db.read_bytes()
    m = measured(cli("--db", str(db), "merge", "--config", str(cfg), "--out", str(tmp_path / "out")), timeout=30)
    one_error_line(m, "bomb.yml", f"more than {MAX_NODES:,} values", "aliases")
    assert m.seconds < 10 and m.peak_mib < PEAK_MIB, (m.seconds, m.peak_mib)
    assert db.read_bytes() == before and not (tmp_path / "out").exists()


def test_yaml_alias_bomb_in_the_dashboard_yaml_check(catalog, tmp_path):
    """The Plan page validates its YAML editor on every edit through views.check_plan_yaml."""
    for text in BOMBS.values():
        t0 = time.perf_counter()
        with pytest.raises(MergePipeError, match="aliases") as ei:
            views.check_plan_yaml(catalog, text, [tmp_path])
        assert time.perf_counter() - t0 < 3 and len(str(ei.value)) < 300


def test_aliases_below_the_limit_still_work():
    text = ("merge_method: linear\nbase_model: b\nparameters: &p {weight: 0.5}\n"
            "models:\n  - {model: e1, parameters: *p}\n  - {model: e2, parameters: *p}\n")
    cfg = parse_config(text)
    assert [m.weight for m in cfg.models] == [0.5, 0.5]
    with pytest.raises(ConfigError, match="more than 200,000 values"):
        parse_config("merge_method: linear\nbase_model: b\nmodels: [{model: e}]\ndtype:\n" + laughs(levels=6))


def test_brief_is_bounded_on_shared_and_huge_values():
    t0 = time.perf_counter()
    for value in (shared_bomb(), {"k" * 10**6: shared_bomb()}, 10**5000, b"x" * 10**6, "y" * 10**6, (shared_bomb(),)):
        text = brief(value)
        assert len(text) <= 85, text
    assert brief(10**5000) == "<an integer of about 5001 digits>"
    assert brief("a\nb") == "'a\\nb'" and brief(None) == "None" and brief(0.5) == "0.5"
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("check", [
    lambda v: check_setting(v, "weight", ConfigError),
    lambda v: check_setting([{"filter": v, "value": 1}], "weight", ConfigError),
    lambda v: get_op(v),
    lambda v: parse_sweep({"base": "b", "experts": ["e"], "out": "o", "points": [{}], "executor": v}),
    lambda v: parse_sweep({"base": "b", "experts": ["e"], "out": "o", "points": [{}], "concurrency": v}),
])
def test_messages_quote_a_bounded_repr(check):
    """A value of 10^9 leaves (as PyYAML shares an alias bomb's lists) is quoted in microseconds."""
    t0 = time.perf_counter()
    with pytest.raises(MergePipeError) as ei:
        check(shared_bomb())
    assert time.perf_counter() - t0 < 1 and len(str(ei.value)) < 400, str(ei.value)[:500]


# --- item 2: sweeps ----------------------------------------------------------------------------------------
SWEEP = "base: b\nexperts: [e]\nout: o\n"


def test_sweep_grid_of_a_trillion_points_is_refused_before_it_is_built(db, tmp_path):
    grid = "".join(f"  k{i}: [1,2,3,4,5,6,7,8,9,10]\n" for i in range(12))
    cfg = tmp_path / "grid.yml"
    cfg.write_text(SWEEP + "grid:\n" + grid)
    before = db.read_bytes()
    m = measured(cli("--db", str(db), "sweep", "--config", str(cfg)), timeout=30)
    assert one_error_line(m) == "error: 1,000,000,000,000 points is more than a sweep takes (1000)"
    assert m.seconds < 10 and m.peak_mib < PEAK_MIB, (m.seconds, m.peak_mib)
    assert db.read_bytes() == before
    with pytest.raises(ConfigError, match=r"^about 10\^\d+ points is more than a sweep takes"):
        parse_sweep({**{"base": "b", "experts": ["e"], "out": "o"}, "grid": {f"k{i}": [1, 2] * 5 for i in range(60)}})
    with pytest.raises(ConfigError, match="^1,001 points"):  # listed points count with the grid's
        parse_sweep({"base": "b", "experts": ["e"], "out": "o", "points": [{}], "grid": {"a": list(range(1000))}})


def test_sweep_with_a_5000_digit_number(db, tmp_path):
    cfg = tmp_path / "num.yml"
    cfg.write_text(SWEEP + "concurrency: " + "9" * 5000 + "\npoints: [{}]\n")
    before = db.read_bytes()
    m = measured(cli("--db", str(db), "sweep", "--config", str(cfg)), timeout=30)
    assert one_error_line(m) == f"error: {cfg}: not valid YAML: holds a number too large to read"
    assert db.read_bytes() == before


def test_sweep_alias_bomb(tmp_path):
    cfg = tmp_path / "bomb.yml"
    cfg.write_text(SWEEP + "points: [{}]\nname:\n" + laughs())
    with pytest.raises(ConfigError, match=f"^{cfg}: refused: the document holds more than"):
        load_sweep(cfg)


def test_sweep_config_goes_through_the_allowed_roots(db, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (outside / "s.yml").write_text(SWEEP + "points: [{}]\n")
    (root / "link.yml").symlink_to(outside / "s.yml")
    (root / "ok.yml").write_text(SWEEP + "points: [{}]\nevaluate: {text: ../outside/secret.txt}\n")
    env = {"MERGEPIPE_ALLOWED_ROOTS": str(root)}
    before = db.read_bytes()
    for name in ("link.yml", "../outside/s.yml", str(outside / "s.yml")):
        m = measured(cli("--db", str(db), "sweep", "--config", str(root / name)), timeout=30, env=env)
        one_error_line(m, "is outside the allowed folders", "MERGEPIPE_ALLOWED_ROOTS")
    m = measured(cli("--db", str(db), "sweep", "--config", str(root / "ok.yml")), timeout=30, env=env)
    one_error_line(m, "evaluate.text:", "is outside the allowed folders")
    assert db.read_bytes() == before


# --- item 3: recipe output patterns --------------------------------------------------------------------
@pytest.mark.parametrize("pattern, needle", [
    ("{name:>1000000000}", "(not '{name:>1000000000}')"),
    ("{name.__class__}", "(not '{name.__class__}')"),
    ("{name!r}-{n}", "(not '{name!r}')"),
    ("{name[0]}", "(not '{name[0]}')"),
    ("{}", "(not '{}')"),
    ("{name", "expected '}' before end of string"),
])
def test_recipe_out_pattern_allows_plain_fields_only(db, tmp_path, pattern, needle):
    before = db.read_bytes()
    m = measured(cli("--db", str(db), "recipe", "save", "r", "--base", "base", "--experts", "e1", "--out", pattern),
                 timeout=30)
    line = one_error_line(m, needle)
    assert line.startswith("error: output pattern ") and len(line) < 300
    assert m.seconds < 10 and m.peak_mib < PEAK_MIB, (m.seconds, m.peak_mib)
    assert db.read_bytes() == before


def test_recipe_out_length_is_bounded_before_it_is_built():
    with pytest.raises(PlanError, match="a folder pattern of at most 4096 characters"):
        Recipe.build("r", "base", ["e1"], out="x" * 5000)
    with pytest.raises(PlanError, match=r"makes a folder name of 6,\d{3} characters \(at most 4096\)"):
        Recipe.build("a" * 3000, "base", ["e1"], out="{name}/{name}")
    from mergepipe.config.recipe import out_path
    assert out_path("runs/{name}-{n}-v{version}-{date}-{{x}}", name="r", n=3, version=2, date="20260101") == \
        "runs/r-3-v2-20260101-{x}"
