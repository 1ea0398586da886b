"""Fixtures for tests/deploy; the helpers live in helpers.py."""

from __future__ import annotations

import pytest

from .helpers import Metric, load_metrics


@pytest.fixture(scope="session")
def metrics() -> dict[str, Metric]:
    return load_metrics()
