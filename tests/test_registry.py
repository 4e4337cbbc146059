"""Registry: registration, duplicates, lazy plugin discovery, exclusion and allowlists."""

from __future__ import annotations

import logging
import re
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pydantic
import pytest

from attnkit import (
    BackendRegistry,
    DuplicateBackendError,
    FullAttentionSpec,
    InvalidBackendError,
    KVCacheSpecKind,
    PluginError,
    SlidingWindowSpec,
    UnknownBackendError,
    default_registry,
    register_backend,
)
from attnkit.backend_api import ENTRY_POINT_GROUP, AttentionBackend, bind_builder
from attnkit.backends.flash_attn import FlashAttentionOptions
from toy_backends import (
    FullOnlyBackend,
    GenericToyBackend,
    SlidingOnlyBackend,
    ToyAttentionBuilder,
    ToyImpl,
    ToyMambaBackend,
)


class _PlainModel(pydantic.BaseModel):
    """A pydantic model that is not a ``BackendOptions``."""

    version: int = 2


def ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on sys.path for plugin modules written by the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def write_plugin(folder: Path, module: str, backend_name: str) -> None:
    (folder / f"{module}.py").write_text(
        "from toy_backends import GenericToyBackend\n"
        f"class PluginBackend(GenericToyBackend):\n    name = {backend_name!r}\n"
    )


def test_register_and_get() -> None:
    reg = BackendRegistry(discover_plugins=False)
    assert reg.register(GenericToyBackend) is GenericToyBackend
    reg.register(ToyMambaBackend)
    assert reg.names() == ["toy_generic", "toy_mamba"]
    assert reg.get("toy_mamba") is ToyMambaBackend
    entry = reg.entry("toy_generic")
    assert entry.origin == "registered"
    assert entry.source == "toy_backends:GenericToyBackend"


def test_register_as_decorator() -> None:
    reg = BackendRegistry(discover_plugins=False)

    @reg.register
    class Decorated(GenericToyBackend):
        name = "toy_decorated"

    assert reg.get("toy_decorated") is Decorated


def test_duplicate_name_names_both_sources() -> None:
    reg = BackendRegistry(discover_plugins=False)
    reg.register(GenericToyBackend)

    class Impostor(FullOnlyBackend):
        name = "toy_generic"

    with pytest.raises(
        DuplicateBackendError,
        match=r"duplicate backend name 'toy_generic': test_registry:test_duplicate_name_names_both_sources"
        r"\.<locals>\.Impostor clashes with registered toy_backends:GenericToyBackend",
    ):
        reg.register(Impostor)
    assert reg.get("toy_generic") is GenericToyBackend  # unchanged
    reg.register(GenericToyBackend)  # the same class again is a no-op
    reg.register(Impostor, replace=True)
    assert reg.get("toy_generic") is Impostor


def test_invalid_backend_is_rejected() -> None:
    reg = BackendRegistry(discover_plugins=False)

    class Broken(AttentionBackend):
        name = "toy_broken"

    with pytest.raises(
        InvalidBackendError,
        match=r"test_registry:.*Broken is not a valid backend: .*builders must be a non-empty tuple of bind_builder",
    ):
        reg.register(Broken)
    with pytest.raises(InvalidBackendError, match=r"<class 'int'> is not an AttentionBackend subclass"):
        reg.register(int)  # type: ignore[type-var]  # the point of the test
    assert reg.names() == []


def test_declared_supported_kinds_is_rejected_at_registration() -> None:
    # The kinds are derived from the bindings; a declaration could contradict them.
    reg = BackendRegistry(discover_plugins=False)

    class DeclaresKinds(GenericToyBackend):
        name = "toy_declares_kinds"
        supported_kinds = frozenset({KVCacheSpecKind.FULL_ATTENTION})  # type: ignore[assignment]  # declaring it is the mistake under test

    with pytest.raises(
        InvalidBackendError,
        match=r"DeclaresKinds is not a valid backend: supported_kinds must not be declared: "
        r"it is derived from builders \(one kind per bind_builder\)$",
    ):
        reg.register(DeclaresKinds)
    assert reg.names() == []


def test_kind_bound_twice_is_rejected_at_registration() -> None:
    reg = BackendRegistry(discover_plugins=False)

    class Other(ToyAttentionBuilder):
        backend_name = "other"

    class BoundTwice(AttentionBackend):
        name = "toy_bound_twice"
        builders = (
            bind_builder(FullAttentionSpec, ToyAttentionBuilder, ToyImpl),
            bind_builder(SlidingWindowSpec, ToyAttentionBuilder, ToyImpl),
            bind_builder(FullAttentionSpec, Other, ToyImpl),
        )

    with pytest.raises(
        InvalidBackendError,
        match=r"BoundTwice is not a valid backend: kind full_attention is bound twice "
        r"\(FullAttentionSpec and FullAttentionSpec\)$",
    ):
        reg.register(BoundTwice)
    assert reg.names() == []


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        pytest.param(int, r"<class 'int'>", id="not-a-model"),
        pytest.param(_PlainModel, r"<class 'test_registry\._PlainModel'>", id="model-not-backend-options"),
        pytest.param(FlashAttentionOptions(), r"FlashAttentionOptions\(version=None\)", id="an-instance"),
    ],
)
def test_options_type_must_be_a_backend_options_class(options: object, shown: str) -> None:
    reg = BackendRegistry(discover_plugins=False)

    class BadOptions(GenericToyBackend):
        name = "toy_bad_options"

    BadOptions.options_type = options  # type: ignore[assignment]  # a wrong declaration is the test
    with pytest.raises(
        InvalidBackendError,
        match=r"BadOptions is not a valid backend: options_type must be None or a BackendOptions "
        r"subclass, got " + shown + "$",
    ):
        reg.register(BadOptions)

    class GoodOptions(GenericToyBackend):
        name = "toy_good_options"
        options_type = FlashAttentionOptions

    assert reg.register(GoodOptions) is GoodOptions
    assert reg.names() == ["toy_good_options"]


def test_unknown_backend_lists_registered() -> None:
    reg = BackendRegistry(discover_plugins=False)
    reg.register(GenericToyBackend)
    reg.register(SlidingOnlyBackend)
    with pytest.raises(
        UnknownBackendError, match=r"^unknown backend 'nope'; registered backends: toy_generic, toy_sliding_only$"
    ):
        reg.get("nope")


def test_unknown_backend_suggests_close_names() -> None:
    reg = BackendRegistry(discover_plugins=False)
    reg.register(GenericToyBackend)
    reg.register(SlidingOnlyBackend)
    with pytest.raises(
        UnknownBackendError,
        match=r"^unknown backend 'toy_generik'; registered backends: toy_generic, "
        r"toy_sliding_only\. Did you mean 'toy_generic'\?$",
    ):
        reg.get("toy_generik")
    assert reg.names() == ["toy_generic", "toy_sliding_only"]


def test_unregister() -> None:
    reg = BackendRegistry(discover_plugins=False)
    reg.register(GenericToyBackend)
    reg.unregister("toy_generic")
    assert reg.names() == []
    with pytest.raises(UnknownBackendError, match=r"unknown backend 'toy_generic'; registered backends: none"):
        reg.unregister("toy_generic")


def test_plugin_is_discovered_but_imported_lazily(plugin_dir: Path) -> None:
    write_plugin(plugin_dir, "attnkit_lazy_plugin", "lazy")
    reg = BackendRegistry(entry_points=[ep("lazy", "attnkit_lazy_plugin:PluginBackend")], allowlist=None)
    assert reg.names() == ["lazy"]
    assert "attnkit_lazy_plugin" not in sys.modules
    backend = reg.get("lazy")
    assert backend.name == "lazy"
    assert "attnkit_lazy_plugin" in sys.modules
    assert reg.entry("lazy").origin == "plugin"
    assert reg.entry("lazy").source == "entry point lazy = attnkit_lazy_plugin:PluginBackend"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        pytest.param(
            "attnkit_no_such_module:Backend",
            r"ModuleNotFoundError: No module named 'attnkit_no_such_module'",
            id="import-error",
        ),
        pytest.param(
            "os.path:join",
            r"InvalidBackendError: <function join .*> is not an AttentionBackend subclass",
            id="not-a-class",
        ),
        pytest.param(
            "toy_backends:GenericToyBackend",
            r"InvalidBackendError: entry point 'bad' loads a backend named 'toy_generic'; the two names must match",
            id="name-mismatch",
        ),
    ],
)
def test_broken_plugin_is_excluded_with_reason(
    value: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    reg = BackendRegistry(entry_points=[ep("bad", value)], allowlist=None)
    assert reg.names() == ["bad"]  # known by name until it is loaded
    failure = (
        rf"^plugin 'bad' \(entry point bad = {re.escape(value)}\) failed to load and is "
        rf"excluded: {reason}$"
    )
    with (
        caplog.at_level(logging.WARNING, logger="attnkit.registry"),
        pytest.raises(PluginError, match=failure),
    ):
        reg.get("bad")
    assert reg.names() == []
    (key, why), = reg.excluded().items()
    assert key == f"bad (entry point bad = {value})"
    assert re.fullmatch(reason, why)
    assert any("excluded backend plugin bad" in r.getMessage() for r in caplog.records)
    # Named again later, it still reports its failure, not "unknown backend".
    for lookup in (reg.get, reg.entry):
        with pytest.raises(PluginError, match=failure):
            lookup("bad")
    (name, message), = reg.failures().items()
    assert name == "bad"
    assert re.match(failure, message)
    assert reg.excluded() == {key: why}


def test_load_all_lists_good_and_excluded(plugin_dir: Path) -> None:
    write_plugin(plugin_dir, "attnkit_good_plugin", "good")
    reg = BackendRegistry(
        entry_points=[ep("good", "attnkit_good_plugin:PluginBackend"), ep("bad", "attnkit_missing_x:B")],
        allowlist=None,
    )
    entries = reg.load_all()
    assert [(e.name, e.backend is not None, e.error is not None) for e in entries] == [
        ("good", True, False),
        ("bad", False, True),
    ]


def test_plugin_clashing_with_registered_name_is_excluded(plugin_dir: Path) -> None:
    write_plugin(plugin_dir, "attnkit_dup_plugin", "toy_generic")
    reg = BackendRegistry(
        builtins={"toy_generic": "toy_backends:GenericToyBackend"},
        entry_points=[ep("toy_generic", "attnkit_dup_plugin:PluginBackend")],
        allowlist=None,
    )
    assert reg.get("toy_generic") is GenericToyBackend
    assert reg.excluded() == {
        "toy_generic (entry point toy_generic = attnkit_dup_plugin:PluginBackend)": (
            "duplicate backend name 'toy_generic': entry point toy_generic = "
            "attnkit_dup_plugin:PluginBackend clashes with builtin toy_backends:GenericToyBackend"
        )
    }


def test_two_plugins_with_one_name_keep_the_first_and_name_both() -> None:
    reg = BackendRegistry(
        entry_points=[ep("dup", "pkg_b:Backend"), ep("dup", "pkg_a:Backend")], allowlist=None
    )
    assert reg.entry("dup").source == "entry point dup = pkg_a:Backend"
    (why,) = reg.excluded().values()
    assert why == (
        "duplicate backend name 'dup': entry point dup = pkg_b:Backend clashes with "
        "plugin entry point dup = pkg_a:Backend"
    )


def test_allowlist_argument_filters_plugins() -> None:
    reg = BackendRegistry(
        entry_points=[ep("allowed", "m:A"), ep("blocked", "m:B")], allowlist=["allowed"]
    )
    assert reg.names() == ["allowed"]
    assert reg.excluded() == {
        "blocked (entry point blocked = m:B)": "plugin 'blocked' is not in the allowlist ATTNKIT_PLUGINS='allowed'"
    }
    with pytest.raises(UnknownBackendError, match=r"not in the allowlist"):
        reg.get("blocked")


@pytest.mark.parametrize(
    ("env", "names"),
    [
        pytest.param("one, two", ["one", "two"], id="two-allowed"),
        pytest.param("two", ["two"], id="one-allowed"),
        pytest.param("", [], id="none-allowed"),
    ],
)
def test_env_allowlist(monkeypatch: pytest.MonkeyPatch, env: str, names: list[str]) -> None:
    monkeypatch.setenv("ATTNKIT_PLUGINS", env)
    reg = BackendRegistry(entry_points=[ep("one", "m:A"), ep("two", "m:B")])
    assert reg.names() == names


def test_env_allowlist_unset_allows_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNKIT_PLUGINS", raising=False)
    reg = BackendRegistry(entry_points=[ep("one", "m:A"), ep("two", "m:B")])
    assert reg.names() == ["one", "two"]


def test_builtins_load_lazily_and_fail_loudly() -> None:
    reg = BackendRegistry(
        builtins={"toy_generic": "toy_backends:GenericToyBackend", "broken": "attnkit_missing_builtin:X"},
        discover_plugins=False,
    )
    assert reg.names() == ["broken", "toy_generic"]
    assert reg.get("toy_generic") is GenericToyBackend
    # A broken built-in is a bug in attnkit, not a plugin to skip quietly.
    with pytest.raises(ModuleNotFoundError):
        reg.get("broken")
    with pytest.raises(ValueError, match=r"backend 'toy_generic' is a builtin and cannot be unregistered"):
        reg.unregister("toy_generic")


def test_default_registry_is_shared_and_register_backend_uses_it() -> None:
    assert default_registry() is default_registry()

    class Temporary(GenericToyBackend):
        name = "toy_temporary_default"

    register_backend(Temporary)
    try:
        assert default_registry().get("toy_temporary_default") is Temporary
    finally:
        default_registry().unregister("toy_temporary_default")
    assert "toy_temporary_default" not in default_registry().names()
