"""Fixtures for scheduler and KV-cache tests without a model: every scheduler built in a test is leak-checked."""
from __future__ import annotations

import pytest

from tests.core.helpers import assert_no_leaks, created_schedulers


@pytest.fixture(autouse=True)
def leak_check():
    created_schedulers.clear()
    yield
    for scheduler in created_schedulers:
        assert_no_leaks(scheduler)
    created_schedulers.clear()
