"""Fixtures shared by the dashboard tests: ``built``, the tiny analyzed and merged family of
dashboard_helpers.build_catalog (one per test module, read-only), and ``env``, a private copy of its catalog
shown by the app (MERGEPIPE_DB and the allowed roots set) for AppTest page tests. A module that needs another
catalog (the Sweeps page: no merge; the compact Plan page: compacts) defines its own ``built``."""

from __future__ import annotations

import pytest

from dashboard_helpers import build_catalog, page_env


@pytest.fixture(scope="module")
def built(request, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_")))


@pytest.fixture
def env(built, tmp_path, monkeypatch):
    return page_env(built, tmp_path, monkeypatch)
