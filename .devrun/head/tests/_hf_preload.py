"""Imported once by the tests' fork server (tests/_dist.py): transformers and the
modeling modules of moe.hf's tested architectures, when transformers is installed, so
each multi-rank test's ranks start with them imported."""
import importlib

try:
    import transformers  # noqa: F401

    from moe.hf.configs import ARCHITECTURES

    for _arch in ARCHITECTURES:
        importlib.import_module(f"transformers.models.{_arch}.modeling_{_arch}")
        importlib.import_module(f"transformers.models.{_arch}.configuration_{_arch}")
    import transformers.generation  # noqa: F401
except ImportError:
    pass
