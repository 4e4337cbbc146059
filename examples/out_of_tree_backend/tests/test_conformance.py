"""The example backend against attnkit's conformance kit.

Run from the repository root with ``pytest examples/out_of_tree_backend/tests`` (the
package installed, e.g. ``pip install -e examples/out_of_tree_backend``); before a
release, ``--attnkit-max-examples 25``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnkit_example_chunked import ChunkedLocalBackend

from attnkit.testing import check_backend

if TYPE_CHECKING:  # imported by pytest_plugins below, as a plugin, at run time
    from attnkit.testing.pytest_plugin import ConformanceCheck

# The kit's pytest fixture (attnkit_conformance) and its --attnkit-* options.
pytest_plugins = ["attnkit.testing.pytest_plugin"]


def test_conformance(attnkit_conformance: ConformanceCheck) -> None:
    attnkit_conformance(ChunkedLocalBackend).assert_ok()


def test_conformance_without_the_fixture() -> None:
    report = check_backend(ChunkedLocalBackend, kinds=["chunked_local_attention"], max_examples=1)
    report.assert_ok()
    assert report.result("kind=chunked_local_attention").status == "passed"
