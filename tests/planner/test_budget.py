"""Budget strings: fractions, percentages and sizes; the API's budget_mb= and the CLI's --io-budget-mb
mean MiB; everything is capped at the full expert read; malformed budgets are PlanErrors."""

from __future__ import annotations

import pytest

from mergepipe.planner.budget import mib, parse_budget
from mergepipe.errors import MergePipeError, PlanError
from mergepipe.planner.context import Planner

from merge_helpers import run_cli, shared_family, copy_catalog, open_copy

FULL = 100 << 30  # larger than every size below, so nothing is capped unless a test wants it


@pytest.mark.parametrize("spec, expected", [
    ("10%", int(0.10 * FULL)),
    ("100%", FULL),
    ("0.5%", int(0.005 * FULL)),
    ("0.1", int(0.1 * FULL)),
    ("1", FULL),
    ("1.0", FULL),
    (".25", FULL // 4),
    (0.25, FULL // 4),
    ("512MiB", 512 * 2**20),
    ("512mib", 512 * 2**20),
    ("8GB", 8 * 10**9),
    ("8 GB", 8 * 10**9),
    ("1.5GiB", int(1.5 * 2**30)),
    ("4096B", 4096),
    ("3KB", 3000),
    ("3KiB", 3072),
    ("2k", 2048),
    ("1e6B", 10**6),
    ("  20%  ", int(0.2 * FULL)),
])
def test_parse_budget_values(spec, expected):
    assert parse_budget(spec, FULL) == expected


@pytest.mark.parametrize("spec", ["8GB", "1.5GiB", "100%", "1", "999TB"])
def test_parse_budget_caps_at_full(spec):
    assert parse_budget(spec, 12345) == 12345


def test_parse_budget_small_values_round_down():
    assert parse_budget("10%", 1005) == 100
    assert parse_budget("0.001", 999) == 0  # rounds down to zero bytes: the plan then reads nothing
    assert parse_budget("1B", 10) == 1


@pytest.mark.parametrize("spec, words", [
    ("abc", "bad budget"),
    ("", "bad budget"),
    ("-5%", "bad budget"),
    ("-0.1", "bad budget"),
    ("-1MiB", "bad budget"),
    ("0", "positive"),
    ("0%", "positive"),
    ("0MiB", "positive"),
    ("150%", "at most 100%"),
    ("100.5%", "at most 100%"),
    ("2", "bare number"),
    ("1.01", "bare number"),
    ("5XB", "unknown unit"),
    ("5 parsecs", "unknown unit"),
    ("10 %%", "bad budget"),
    ("1,5GB", "bad budget"),
])
def test_parse_budget_errors(spec, words):
    with pytest.raises(PlanError) as exc:
        parse_budget(spec, FULL)
    assert words in str(exc.value)
    assert isinstance(exc.value, MergePipeError) and exc.value.exit_code == 2


@pytest.mark.parametrize("spec", [None, [1], True])
def test_parse_budget_rejects_non_strings(spec):
    with pytest.raises(PlanError):
        parse_budget(spec, FULL)


def test_mib_helper():
    assert parse_budget(mib(1), FULL) == 2**20
    assert parse_budget(mib(0.5), FULL) == 2**19
    for bad in (0, -3):
        with pytest.raises(PlanError):
            mib(bad)


# --- the planner's budget_mb= and the CLI's --io-budget-mb ----------------------------------------------
@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return shared_family(tmp_path_factory, "tiny-fp32")


def test_planner_budget_mb_means_mib(fam, tmp_path):
    cat = open_copy(fam, tmp_path / "c.sqlite")
    planner = Planner(cat)
    full = planner.plan("base", fam.expert_ids, "linear", save=False)["full_expert_bytes"]
    assert full > 2**19  # the family is large enough for 0.5 MiB to be a real budget
    p = planner.plan("base", fam.expert_ids, "linear", budget_mb=0.5, save=False)
    assert p["budget"]["bytes"] == 2**19 != 500_000
    assert p["estimate"]["expert_read"] <= 2**19
    assert p["estimate"]["expert_read"] > 2**19 - 4 * 4096  # greedy fills the budget up to a block or so
    # Larger than the full read: capped.
    p = planner.plan("base", fam.expert_ids, "linear", budget_mb=1024, save=False)
    assert p["budget"]["bytes"] == full and p["estimate"]["expert_read"] == full
    # The same budget spelled as a string gives the same access set.
    q = planner.plan("base", fam.expert_ids, "linear", budget="512KiB", save=False)
    r = planner.plan("base", fam.expert_ids, "linear", budget_mb=0.5, save=False)
    assert q["access"] == r["access"] and q["budget"]["bytes"] == r["budget"]["bytes"]
    with pytest.raises(PlanError):
        planner.plan("base", fam.expert_ids, "linear", budget_mb=-1, save=False)
    cat.close()


def test_cli_io_budget_mb_means_mib(fam, tmp_path):
    import json
    db = copy_catalog(fam, tmp_path / "c.sqlite")
    res = run_cli(["--db", db, "plan", "--json", "--base", "base", "--experts", *fam.expert_ids,
                   "--io-budget-mb", "0.25"])
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["budget_bytes"] == 2**18
    assert sum(data["expert_read_by_expert"].values()) == data["estimated"]["expert_read"] <= 2**18
    res = run_cli(["--db", db, "plan", "--base", "base", "--experts", *fam.expert_ids,
                   "--io-budget-mb", "0.25", "--budget", "10%"])
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "not both" in res.stderr


# --- overflow, signs, huge and non-numbers (issue 14): one PlanError naming the budget, never a crash ---------
@pytest.mark.parametrize("spec, words", [
    ("1e309B", "bad budget '1e309B': the number is too large"),  # float('1e309') is inf
    ("1e308TB", "the number is too large"),
    ("9" * 400 + "MiB", "the number is too large"),
    ("-5%", "bad budget '-5%': the budget must be positive"),
    ("-0.1", "the budget must be positive"),
    ("-512MiB", "the budget must be positive"),
    ("x" * 5000, "bad budget 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...'"),
    (10**5000, "bad budget: the number is too large"),  # repr() of it would raise ValueError
    (float("inf"), "bad budget 'inf'"),
    (float("nan"), "bad budget 'nan'"),
], ids=["1e309B", "1e308TB", "400-digits", "-5%", "-0.1", "-512MiB", "5000-chars", "int-5000-digits", "inf", "nan"])
def test_budget_overflow_and_sign(spec, words):
    from mergepipe.planner.budget import Budget
    with pytest.raises(PlanError) as ei:
        Budget.parse(spec)
    assert words in str(ei.value) and len(str(ei.value)) < 300


@pytest.mark.parametrize("call, words", [
    (lambda B: B.target("abc"), "--target-bound must be a number"),
    (lambda B: B.target(None), "--target-bound must be a number, not NoneType"),
    (lambda B: B.target(float("inf")), "--target-bound must be a finite number"),
    (lambda B: B.target(10**5000), "--target-bound must be a finite number"),
    (lambda B: B.percent("x"), "the budget percentage must be a number"),
    (lambda B: B.percent(float("nan")), "the budget percentage must be a finite number"),
    (lambda B: B.of(None, mb=[1]), "the budget in MiB must be a number, not list"),
    (lambda B: B.of(None, mb=10**5000), "the budget in MiB must be a finite number"),
    (lambda B: B.of(None, mb=float("inf")), "the budget in MiB must be a finite number"),
])
def test_budget_constructors_refuse_non_numbers(call, words):
    from mergepipe.planner.budget import Budget
    with pytest.raises(PlanError, match=words.replace("(", r"\(")):
        call(Budget)


def test_large_finite_byte_budgets_are_capped():
    assert parse_budget("1e29B", FULL) == FULL
    assert parse_budget("+5%", FULL) == int(0.05 * FULL)
