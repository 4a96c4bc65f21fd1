"""The Prometheus binaries (`prometheus`, `promtool`) for the tests that run the real thing.

No pip package provides them, so on a machine with Python and pip only those tests skip,
with a one-line reason that says how to enable them. Where they must run (CI: .ci/run
installs the Debian package and sets EPLB_REQUIRE_PROMETHEUS=1) a missing binary is a
failure, never a skip, so CI cannot lose these tests silently.

EPLB_REQUIRE_PROMETHEUS: unset, empty or "0" means optional; any other value ("1")
means required.
"""
from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "EPLB_REQUIRE_PROMETHEUS"


def prometheus_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0")


def prometheus_tool(name: str) -> str:
    """The path of `name` ("prometheus" or "promtool") on PATH. Missing: pytest.fail when
    EPLB_REQUIRE_PROMETHEUS is set, else pytest.skip with how to enable the test."""
    path = shutil.which(name)
    if path is not None:
        return path
    if prometheus_required():
        pytest.fail(f"{REQUIRE_ENV}={os.environ[REQUIRE_ENV]} but `{name}` is not on PATH: this "
                    f"test needs the real Prometheus. Install it (Debian/Ubuntu: apt-get install "
                    f"prometheus; .ci/run does) or unset {REQUIRE_ENV} to skip it.", pytrace=False)
    pytest.skip(f"`{name}` not on PATH: apt-get install prometheus, or set "
                f"{REQUIRE_ENV}=1 to make this a failure")
