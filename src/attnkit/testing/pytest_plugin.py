"""A pytest plugin for backend packages: the ``attnkit_conformance`` fixture.

Enable it in the package's ``conftest.py``::

    pytest_plugins = ["attnkit.testing.pytest_plugin"]

and a conformance test is two lines::

    def test_conformance(attnkit_conformance):
        attnkit_conformance(MyBackend).assert_ok()

``--attnkit-max-examples N`` and ``--attnkit-seed S`` (or the ``ATTNKIT_MAX_EXAMPLES``
environment variable) change the settings without touching the tests: CI keeps the
default, an author runs ``--attnkit-max-examples 25`` before a release.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import pytest
import torch

from ..backend import AttentionBackend
from ..spec import KVCacheSpecKind
from . import DEFAULT_MAX_EXAMPLES, ConformanceReport, check_backend

__all__ = ["ConformanceCheck", "attnkit_conformance", "pytest_addoption"]

ConformanceCheck = Callable[..., ConformanceReport]
"""``attnkit_conformance(backend_cls, *, device=..., kinds=...) -> ConformanceReport``."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnkit", "attnkit conformance kit")
    group.addoption(
        "--attnkit-max-examples",
        type=int,
        default=None,
        help=f"cases per capability (default {DEFAULT_MAX_EXAMPLES}, or ATTNKIT_MAX_EXAMPLES)",
    )
    group.addoption("--attnkit-seed", type=int, default=0, help="the kit's seed (default 0)")


@pytest.fixture
def attnkit_conformance(request: pytest.FixtureRequest) -> ConformanceCheck:
    """``check_backend`` with the session's ``--attnkit-*`` settings."""
    given: int | None = request.config.getoption("--attnkit-max-examples")
    env = os.environ.get("ATTNKIT_MAX_EXAMPLES")
    max_examples = given if given is not None else int(env) if env else DEFAULT_MAX_EXAMPLES
    seed = int(request.config.getoption("--attnkit-seed") or 0)

    def check(
        backend_cls: type[AttentionBackend],
        *,
        device: torch.device | str = "cpu",
        kinds: Iterable[KVCacheSpecKind | str] | None = None,
    ) -> ConformanceReport:
        return check_backend(
            backend_cls, device=device, kinds=kinds, max_examples=max_examples, seed=seed
        )

    return check
