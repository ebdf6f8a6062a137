"""A pytest plugin for scripts/sanitize: the runtime built with AddressSanitizer and
UndefinedBehaviorSanitizer (FABRIC_RUNTIME_SO) stands in for the installed one, and so does the
content-key hasher's build where FABRIC_CONTENT_KEYS_SO names one. Loaded with
`-p tests.sanitized_runtime`, before the conftest: it must be in place before anything imports
fabric_gpu, whose device probe loads the runtime."""

from __future__ import annotations

import os
import sys
from importlib.machinery import ExtensionFileLoader
from importlib.util import module_from_spec, spec_from_loader

import pytest


def _load_from(name: str, path: str) -> None:
    loader = ExtensionFileLoader(name, path)
    spec = spec_from_loader(name, loader)
    if spec is None:
        raise ImportError(f"{path}: not an extension module for {name}")
    module = module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)


for _name, _variable in (
    ("fabric_gpu._runtime", "FABRIC_RUNTIME_SO"),
    ("fabric_gpu._content_keys", "FABRIC_CONTENT_KEYS_SO"),
):
    if _name in sys.modules:
        raise RuntimeError(f"the installed {_name} was loaded before tests.sanitized_runtime")
    if _variable in os.environ or _name == "fabric_gpu._runtime":
        _load_from(_name, os.environ[_variable])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The sanitizer's allocator stands in for the runtime's counting operator new, so heap
    counts read 0 under it: those tests run in the plain suite, not here."""
    reason = "heap count: under the sanitizer's allocator the runtime's count reads 0 (the plain suite runs it)"
    for item in items:
        if item.get_closest_marker("heap_count"):
            item.add_marker(pytest.mark.skip(reason=reason))
