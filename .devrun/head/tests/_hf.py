"""transformers for the moe.hf tests: skipped where it is not installed, required (an
ImportError fails the tests) when EPLB_REQUIRE_HF=1, as in .ci/run."""
import os

import pytest


def require_transformers():
    """The transformers module, or a pytest skip (a failure under EPLB_REQUIRE_HF=1)."""
    if os.environ.get("EPLB_REQUIRE_HF") == "1":
        import transformers
        return transformers
    return pytest.importorskip("transformers", reason="pip install -e '.[hf]' to run")
