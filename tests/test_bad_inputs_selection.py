"""Bad inputs to selection, the registry and plugins: each is rejected at the boundary
with the attnkit error type, a message naming the value and what is allowed, and
nothing changed.

Plugins here are real distributions written to a temporary folder (a package plus a
``<name>-0.1.dist-info`` with ``METADATA`` and ``entry_points.txt``), found through
``importlib.metadata`` the way ``pip install`` would make them visible.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from typing_extensions import override

from attnkit import (
    ArgumentTypeError,
    AttentionConfig,
    AttentionFeature,
    BackendNotSupportedError,
    BackendRegistry,
    DuplicateBackendError,
    FullAttentionSpec,
    InvalidArgumentError,
    InvalidBackendError,
    MambaSpec,
    NoBackendError,
    PluginError,
    Rejection,
    UnknownBackendError,
    default_registry,
    select_backend,
)
from attnkit.backend_api import ENTRY_POINT_GROUP, AttentionBackend
from toy_backends import (
    FastCudaBackend,
    GenericToyBackend,
    ToyMambaBackend,
)

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
MAMBA = MambaSpec(block_size=1, shapes=((4, 3),), dtypes=(torch.float32,))
FEATURE_NAMES = (
    "logits_soft_cap, attention_sinks, alibi, return_lse, context_parallel, mla_projection, "
    "sparse_attention, per_head_quant_scales, mm_prefix"
)
NEVER_LOADED = "attnkit_catalogue_never_loaded_module"

Snapshot = tuple[list[str], dict[str, str], dict[str, str], dict[str, object]]


def snapshot(reg: BackendRegistry) -> Snapshot:
    """What a rejected call must leave as it was: names, exclusions, failures, classes."""
    return (
        reg.names(),
        reg.excluded(),
        reg.failures(),
        {name: reg.entry(name).backend for name in reg.names()},
    )


def toy_registry() -> BackendRegistry:
    """Two toy backends, plus a plugin entry point that selection would load (and
    exclude, as its module does not exist) if it ever reached the candidates."""
    eps = [EntryPoint(name="lazy_plugin", value=f"{NEVER_LOADED}:X", group=ENTRY_POINT_GROUP)]
    reg = BackendRegistry(entry_points=eps, allowlist=None)
    reg.register(GenericToyBackend)
    reg.register(ToyMambaBackend)
    return reg


# ---------------------------------------------------------------------------
# select_backend's arguments: checked first, before any backend is asked

ARGUMENT_CASES = [
    # spec
    pytest.param(
        {"spec": {}},
        ArgumentTypeError,
        r"^spec must be a KVCacheSpec .*got \{\} \(dict\)$",
        id="spec-dict",
    ),
    pytest.param(
        {"spec": None},
        ArgumentTypeError,
        r"^spec must be a KVCacheSpec .*got None \(NoneType\)$",
        id="spec-none",
    ),
    pytest.param(
        {"spec": FullAttentionSpec},
        ArgumentTypeError,
        r"^spec must be a KVCacheSpec .*got <class 'attnkit\.spec\.FullAttentionSpec'> \(type\)$",
        id="spec-class-not-instance",
    ),
    # config
    pytest.param(
        {"config": {"backend": "reference"}},
        ArgumentTypeError,
        r"^config must be an AttentionConfig, got \{'backend': 'reference'\} \(dict\); build one "
        r"with",
        id="config-dict",
    ),
    pytest.param(
        {"config": None},
        ArgumentTypeError,
        r"^config must be an AttentionConfig, got None \(NoneType\)",
        id="config-none",
    ),
    pytest.param(
        {"config": "reference"},
        ArgumentTypeError,
        r"^config must be an AttentionConfig, got 'reference' \(str\)",
        id="config-str",
    ),
    # device
    pytest.param(
        {"device": 0},
        ArgumentTypeError,
        r"^device must be a torch\.device or a string .*got 0 \(int\)$",
        id="device-int",
    ),
    pytest.param(
        {"device": None},
        ArgumentTypeError,
        r"^device must be a torch\.device or a string .*got None \(NoneType\)$",
        id="device-none",
    ),
    pytest.param(
        {"device": "tpu"},
        InvalidArgumentError,
        r"^device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'",
        id="device-tpu",
    ),
    pytest.param(
        {"device": "gpu:0"},
        InvalidArgumentError,
        r"^device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu:0'$",
        id="device-gpu",
    ),
    pytest.param(
        {"device": "meta"},
        InvalidArgumentError,
        r"^device must be 'cpu', 'cuda' or 'cuda:N', got 'meta' \(attnkit runs on cpu, cuda\)$",
        id="device-meta",
    ),
    pytest.param(
        {"device": "cuda:-1"},
        InvalidArgumentError,
        r"^device must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:-1'$",
        id="device-negative-index",
    ),
    # capability
    pytest.param(
        {"capability": (9,)},
        InvalidArgumentError,
        r"^capability must be None or a \(major, minor\) tuple of two ints >= 0, e\.g\. \(9, 0\); "
        r"got \(9,\) \(1 item\(s\)\)$",
        id="capability-one-item",
    ),
    pytest.param(
        {"capability": (9, 0, 1)},
        InvalidArgumentError,
        r"^capability must be .*\(major, minor\).*; got \(9, 0, 1\) \(3 item\(s\)\)$",
        id="capability-three-items",
    ),
    pytest.param(
        {"capability": ("9", "0")},
        ArgumentTypeError,
        r"^capability must be .*\(major, minor\).*; got \('9', '0'\) \(items of type str, str\)$",
        id="capability-strings",
    ),
    pytest.param(
        {"capability": (True, 0)},
        ArgumentTypeError,
        r"^capability must be .*\(major, minor\).*; got \(True, 0\) \(items of type bool, int\)$",
        id="capability-bool",
    ),
    pytest.param(
        {"capability": (9.0, 0)},
        ArgumentTypeError,
        r"^capability must be .*; got \(9\.0, 0\) \(items of type float, int\)$",
        id="capability-float-item",
    ),
    pytest.param(
        {"capability": (-1, 0)},
        InvalidArgumentError,
        r"^capability must be .*ints >= 0.*; got \(-1, 0\)$",
        id="capability-negative",
    ),
    pytest.param(
        {"capability": [9, 0]},
        ArgumentTypeError,
        r"^capability must be .*\(major, minor\) tuple.*; got \[9, 0\] \(list\)$",
        id="capability-list",
    ),
    pytest.param(
        {"capability": "9.0"},
        ArgumentTypeError,
        r"^capability must be .*; got '9\.0' \(str\)$",
        id="capability-str",
    ),
    pytest.param(
        {"capability": 9.0},
        ArgumentTypeError,
        r"^capability must be .*; got 9\.0 \(float\)$",
        id="capability-float",
    ),
    # features
    pytest.param(
        {"features": "bogus"},
        ArgumentTypeError,
        rf"^features must be an iterable of AttentionFeature \(or their names: {FEATURE_NAMES}\), "
        rf".*got 'bogus' \(str\)$",
        id="features-bare-string",
    ),
    pytest.param(
        {"features": {"bogus"}},
        InvalidArgumentError,
        rf"^features: unknown feature 'bogus'; valid features: {FEATURE_NAMES}$",
        id="features-unknown-name",
    ),
    pytest.param(
        {"features": [AttentionFeature.ALIBI, "softcap"]},
        InvalidArgumentError,
        rf"^features: unknown feature 'softcap'; valid features: {FEATURE_NAMES}$",
        id="features-one-unknown-name",
    ),
    pytest.param(
        {"features": AttentionFeature.ALIBI},
        ArgumentTypeError,
        r"^features must be an iterable of AttentionFeature .*e\.g\. "
        r"frozenset\(\{AttentionFeature\.ALIBI\}\); "
        r"got <AttentionFeature\.ALIBI: 'alibi'> \(AttentionFeature\)$",
        id="features-one-feature-unwrapped",
    ),
    pytest.param(
        {"features": [1]},
        ArgumentTypeError,
        r"^features must be an iterable of AttentionFeature .*; got an item 1 \(int\)$",
        id="features-int-item",
    ),
    pytest.param(
        {"features": 5},
        ArgumentTypeError,
        r"^features must be an iterable of AttentionFeature .*got 5 \(int\)$",
        id="features-int",
    ),
    pytest.param(
        {"features": None},
        ArgumentTypeError,
        r"^features must be an iterable of AttentionFeature .*got None \(NoneType\)$",
        id="features-none",
    ),
    # num_heads
    pytest.param(
        {"num_heads": 0},
        InvalidArgumentError,
        r"^num_heads must be None or a positive int, got 0$",
        id="num-heads-zero",
    ),
    pytest.param(
        {"num_heads": -4},
        InvalidArgumentError,
        r"^num_heads must be None or a positive int, got -4$",
        id="num-heads-negative",
    ),
    pytest.param(
        {"num_heads": True},
        ArgumentTypeError,
        r"^num_heads must be None or a positive int, got True \(bool\)$",
        id="num-heads-bool",
    ),
    pytest.param(
        {"num_heads": 8.0},
        ArgumentTypeError,
        r"^num_heads must be None or a positive int, got 8\.0 \(float\)$",
        id="num-heads-float",
    ),
    pytest.param(
        {"num_heads": "8"},
        ArgumentTypeError,
        r"^num_heads must be None or a positive int, got '8' \(str\)$",
        id="num-heads-str",
    ),
    # registry
    pytest.param(
        {"registry": {}},
        ArgumentTypeError,
        r"^registry must be None or a BackendRegistry, got \{\} \(dict\)$",
        id="registry-dict",
    ),
    pytest.param(
        {"registry": default_registry},
        ArgumentTypeError,
        r"^registry must be None or a BackendRegistry, got <function default_registry .*> "
        r"\(function\)$",
        id="registry-factory-not-called",
    ),
    # priority
    pytest.param(
        {"priority": ["reference"]},
        ArgumentTypeError,
        r"^priority must be None or a mapping of device type \('cpu', 'cuda'\) -> sequence of "
        r"backend names; got \['reference'\] \(list\)$",
        id="priority-list",
    ),
    pytest.param(
        {"priority": {"cpu": "reference"}},
        ArgumentTypeError,
        r"^priority\['cpu'\] must be a sequence of backend names, e\.g\. \('reference',\); got "
        r"'reference' \(str\)$",
        id="priority-bare-name",
    ),
    pytest.param(
        {"priority": {"tpu": ("reference",)}},
        InvalidArgumentError,
        r"^priority must be None or a mapping of device type \('cpu', 'cuda'\) .*; got a key "
        r"'tpu'$",
        id="priority-unknown-device-type",
    ),
    pytest.param(
        {"priority": {"cpu": ("toy_generic", 3)}},
        ArgumentTypeError,
        r"^priority\['cpu'\] must be a sequence of backend names \(str\); got an item 3 \(int\)$",
        id="priority-int-name",
    ),
    pytest.param(
        {"priority": {0: ()}},
        ArgumentTypeError,
        r"^priority must be None or a mapping of device type .*; got a key 0 \(int\)$",
        id="priority-int-key",
    ),
]


@pytest.mark.parametrize(("overrides", "error", "message"), ARGUMENT_CASES)
def test_select_backend_rejects_bad_argument(
    overrides: dict[str, Any], error: type[Exception], message: str
) -> None:
    reg = toy_registry()
    before = snapshot(reg)
    arguments: dict[str, Any] = {
        "spec": FULL,
        "config": AttentionConfig(),
        "device": "cpu",
        "registry": reg,
        **overrides,
    }
    with pytest.raises(error, match=message):
        select_backend(**arguments)
    # Checked before anything else: no candidate was asked (the lazy plugin, which
    # selection would try and exclude, was never loaded).
    assert snapshot(reg) == before
    assert reg.entry("lazy_plugin").backend is None
    assert NEVER_LOADED not in sys.modules


def test_the_same_call_with_good_arguments_selects() -> None:
    # The baseline of the cases above, and the conversions the boundary allows.
    class WithAlibi(GenericToyBackend):
        name = "toy_with_alibi"
        supported_features = frozenset({AttentionFeature.ALIBI})

    reg = toy_registry()
    reg.register(WithAlibi)
    selection = select_backend(
        FULL,
        AttentionConfig(),
        device=torch.device("cpu"),
        registry=reg,
        priority={"cpu": ["toy_with_alibi"]},
        features=["alibi"],  # type: ignore[list-item]  # a feature's name, converted at run time
        num_heads=4,
        capability=(9, 0),
    )
    assert selection.backend is WithAlibi
    assert selection.rejected == ()
    assert selection.request.features == frozenset({AttentionFeature.ALIBI})
    assert selection.request.num_heads == 4


# ---------------------------------------------------------------------------
# Backend names reaching selection through AttentionConfig


NAME_CASES = [
    pytest.param(
        FULL,
        {"backend": "nope"},
        BackendNotSupportedError,
        r"backend 'nope' was requested by AttentionConfig\.backend but cannot serve .*\n"
        r"  - unknown backend 'nope'; registered backends: lazy_plugin, toy_fast_cuda, toy_generic,"
        r" toy_mamba\n",
        id="backend-unknown",
    ),
    pytest.param(
        FULL,
        {"backend": "toy_generik"},
        BackendNotSupportedError,
        r"  - unknown backend 'toy_generik'; registered backends: .*\. Did you mean "
        r"'toy_generic'\?\n",
        id="backend-misspelt",
    ),
    pytest.param(
        MAMBA,
        {"backend_per_kind": {"mamba": "toy_mambo"}},
        BackendNotSupportedError,
        r"AttentionConfig\.backend_per_kind\['mamba'\] .*\n  - unknown backend 'toy_mambo'; .*Did "
        r"you mean 'toy_mamba'\?",
        id="per-kind-misspelt",
    ),
    pytest.param(
        FULL,
        {"backend_per_kind": {"full_attention": "toy_mamba"}},
        BackendNotSupportedError,
        r"  - kind=full_attention not supported \(supported: mamba\)\n",
        id="per-kind-wrong-kind",
    ),
    pytest.param(
        FULL,
        {"backend_per_kind": {"full_attention": "toy_fast_cuda"}},
        BackendNotSupportedError,
        r"  - device=cpu not supported \(supported: cuda\)\n",
        id="per-kind-wrong-device",
    ),
    pytest.param(
        FULL,
        {"backend_per_kind": {"full_attention": "lazy_plugin"}, "plugins": ["other"]},
        BackendNotSupportedError,
        r"  - plugin 'lazy_plugin' is not in AttentionConfig\.plugins=\['other'\]\n",
        id="per-kind-plugin-not-allowed",
    ),
    pytest.param(
        FULL,
        {"backend": "lazy_plugin", "plugins": []},
        BackendNotSupportedError,
        r"  - plugin 'lazy_plugin' is not in AttentionConfig\.plugins=\[\]\n",
        id="backend-plugin-not-allowed",
    ),
]


@pytest.mark.parametrize(("spec", "settings", "error", "message"), NAME_CASES)
def test_named_backend_that_cannot_serve(
    spec: FullAttentionSpec | MambaSpec,
    settings: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    reg = toy_registry()
    reg.register(FastCudaBackend)
    config = AttentionConfig(**settings)
    before = snapshot(reg)
    with pytest.raises(error, match=message):
        select_backend(spec, config, device="cpu", registry=reg)
    assert snapshot(reg) == before
    assert NEVER_LOADED not in sys.modules  # a blocked plugin is not even imported


# ---------------------------------------------------------------------------
# Registry API misuse


class _Impostor(GenericToyBackend):
    name = "toy_mamba"  # taken by ToyMambaBackend


class _BadDevices(GenericToyBackend):
    name = "toy_bad_devices"
    supported_devices = frozenset({"tpu"})


class _BadCapability(GenericToyBackend):
    name = "toy_bad_capability"
    min_compute_capability = (8,)  # type: ignore[assignment]  # a wrong declaration is the test


class _BadDescription(GenericToyBackend):
    name = "toy_bad_description"
    description = None  # type: ignore[assignment]  # a wrong declaration is the test


class _KindsRaise(GenericToyBackend):
    name = "toy_kinds_raise"

    @classmethod
    @override
    def supported_kinds(cls) -> Any:
        raise RuntimeError("kinds table missing")


class _NoBuilders(AttentionBackend):
    name = "toy_no_builders"


class _EnvironmentRaises(GenericToyBackend):
    name = "toy_env_raises"

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        raise OSError("probe failed")


def _call(method: str, *args: Any, **kwargs: Any) -> Callable[[BackendRegistry], object]:
    return lambda reg: getattr(reg, method)(*args, **kwargs)


REGISTRY_CASES = [
    pytest.param(
        _call("register", int),
        InvalidBackendError,
        r"^<class 'int'> is not an AttentionBackend subclass$",
        id="register-int",
    ),
    pytest.param(
        _call("register", GenericToyBackend()),
        InvalidBackendError,
        r"^<toy_backends\.GenericToyBackend object at .*> is not an AttentionBackend subclass$",
        id="register-instance",
    ),
    pytest.param(
        _call("register", "toy_generic"),
        InvalidBackendError,
        r"^'toy_generic' is not an AttentionBackend subclass$",
        id="register-name",
    ),
    pytest.param(
        _call("register", AttentionBackend),
        InvalidBackendError,
        r"^attnkit\.backend:AttentionBackend is not a valid backend: name must be an identifier "
        r"string, got None; "
        r"builders must be a non-empty tuple",
        id="register-the-abc",
    ),
    pytest.param(
        _call("register", _NoBuilders),
        InvalidBackendError,
        r"_NoBuilders is not a valid backend: builders must be a non-empty tuple of "
        r"bind_builder\(\.\.\.\) results, got None$",
        id="register-no-builders",
    ),
    pytest.param(
        _call("register", _Impostor),
        DuplicateBackendError,
        r"^duplicate backend name 'toy_mamba': test_bad_inputs_selection:_Impostor clashes with "
        r"registered "
        r"toy_backends:ToyMambaBackend$",
        id="register-duplicate",
    ),
    pytest.param(
        _call("register", GenericToyBackend, replace="yes"),
        ArgumentTypeError,
        r"^replace must be a bool, got 'yes' \(str\)$",
        id="register-replace-not-bool",
    ),
    pytest.param(
        _call("register", _BadDevices),
        InvalidBackendError,
        r"_BadDevices is not a valid backend: supported_devices must be a non-empty frozenset of "
        r"'cpu', 'cuda', "
        r"got frozenset\(\{'tpu'\}\)$",
        id="register-bad-devices",
    ),
    pytest.param(
        _call("register", _BadCapability),
        InvalidBackendError,
        r"_BadCapability is not a valid backend: min_compute_capability must be None or a \(major, "
        r"minor\) "
        r"tuple of ints >= 0, got \(8,\)$",
        id="register-bad-capability",
    ),
    pytest.param(
        _call("register", _BadDescription),
        InvalidBackendError,
        r"_BadDescription is not a valid backend: description must be a str, got None$",
        id="register-bad-description",
    ),
    pytest.param(
        _call("register", _KindsRaise),
        InvalidBackendError,
        r"^test_bad_inputs_selection:_KindsRaise raised RuntimeError: kinds table missing in "
        r"supported_kinds\(\)$",
        id="register-kinds-raise",
    ),
    pytest.param(
        _call("register", _EnvironmentRaises),
        InvalidBackendError,
        r"^test_bad_inputs_selection:_EnvironmentRaises raised OSError: probe failed in "
        r"environment_reasons\(torch\.device\('cpu'\)\)$",
        id="register-environment-raises",
    ),
    pytest.param(
        _call("unregister", "nope"),
        UnknownBackendError,
        r"^unknown backend 'nope'; registered backends: lazy_plugin, reference, toy_generic, "
        r"toy_mamba$",
        id="unregister-unknown",
    ),
    pytest.param(
        _call("unregister", "reference"),
        InvalidArgumentError,
        r"^backend 'reference' is a builtin and cannot be unregistered \(only backends added with "
        r"register\(\) can be\)$",
        id="unregister-builtin",
    ),
    pytest.param(
        _call("unregister", "lazy_plugin"),
        InvalidArgumentError,
        r"^backend 'lazy_plugin' is a plugin and cannot be unregistered",
        id="unregister-plugin",
    ),
    pytest.param(
        _call("unregister", None),
        ArgumentTypeError,
        r"^name must be a backend name \(a str\), got None \(NoneType\)$",
        id="unregister-none",
    ),
    pytest.param(
        _call("get", "nope"),
        UnknownBackendError,
        r"^unknown backend 'nope'; registered backends: lazy_plugin, reference, toy_generic, "
        r"toy_mamba$",
        id="get-unknown",
    ),
    pytest.param(
        _call("get", "toy_mamab"),
        UnknownBackendError,
        r"^unknown backend 'toy_mamab'; registered backends: .*\. Did you mean 'toy_mamba'\?$",
        id="get-misspelt",
    ),
    pytest.param(
        _call("get", "blocked"),
        UnknownBackendError,
        r"^unknown backend 'blocked'; .*\. A plugin named 'blocked' was excluded: plugin 'blocked' "
        r"is not in "
        r"the allowlist ATTNKIT_PLUGINS='lazy_plugin'$",
        id="get-allowlist-excluded",
    ),
    pytest.param(
        _call("get", None),
        ArgumentTypeError,
        r"^name must be a backend name \(a str\), got None \(NoneType\)$",
        id="get-none",
    ),
    pytest.param(
        _call("get", ["toy_generic"]),
        ArgumentTypeError,
        r"^name must be a backend name \(a str\), got \['toy_generic'\] \(list\)$",
        id="get-list",
    ),
    pytest.param(
        _call("entry", 3),
        ArgumentTypeError,
        r"^name must be a backend name \(a str\), got 3 \(int\)$",
        id="entry-int",
    ),
    pytest.param(
        _call("entry", "Reference"),
        UnknownBackendError,
        r"^unknown backend 'Reference'; .*\. Did you mean 'reference'\?$",
        id="entry-wrong-case",
    ),
]


@pytest.mark.parametrize(("call", "error", "message"), REGISTRY_CASES)
def test_registry_rejects_misuse(
    call: Callable[[BackendRegistry], object], error: type[Exception], message: str
) -> None:
    eps = [
        EntryPoint(name="lazy_plugin", value=f"{NEVER_LOADED}:X", group=ENTRY_POINT_GROUP),
        EntryPoint(name="blocked", value=f"{NEVER_LOADED}:Y", group=ENTRY_POINT_GROUP),
    ]
    reg = BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"},
        entry_points=eps,
        allowlist=["lazy_plugin"],
    )
    reg.register(GenericToyBackend)
    reg.register(ToyMambaBackend)
    before = snapshot(reg)
    with pytest.raises(error, match=message):
        call(reg)
    assert snapshot(reg) == before
    assert NEVER_LOADED not in sys.modules


CONSTRUCTOR_CASES = [
    pytest.param(
        {"allowlist": "my_backend"},
        r"^allowlist must be None or an iterable of plugin names \(e\.g\. \['my_backend'\]\), got "
        r"'my_backend' \(str\)$",
        id="allowlist-str",
    ),
    pytest.param(
        {"allowlist": [1]},
        r"^allowlist must hold plugin names \(str\), got 1$",
        id="allowlist-int-item",
    ),
    pytest.param(
        {"discover_plugins": "yes"},
        r"^discover_plugins must be a bool, got 'yes' \(str\)$",
        id="discover-not-bool",
    ),
    pytest.param(
        {"builtins": ["reference"]},
        r"^builtins must be None or a mapping of name -> 'module:Class' strings, got "
        r"\['reference'\]$",
        id="builtins-list",
    ),
    pytest.param(
        {"entry_points": 3},
        r"^entry_points must be None or an iterable of importlib\.metadata\.EntryPoint, got 3 "
        r"\(int\)$",
        id="entry-points-int",
    ),
]


@pytest.mark.parametrize(("arguments", "message"), CONSTRUCTOR_CASES)
def test_registry_constructor_rejects_bad_arguments(
    arguments: dict[str, Any], message: str
) -> None:
    shared = default_registry()
    before = snapshot(shared)
    with pytest.raises(ArgumentTypeError, match=message):
        BackendRegistry(**arguments)
    assert snapshot(shared) == before  # nothing global was touched


# ---------------------------------------------------------------------------
# Plugins: real distributions in a temporary folder

PLUGIN_HEADER = """\
from abc import ABCMeta

from attnkit import FullAttentionSpec
from attnkit.backend_api import AttentionBackend, bind_builder
from toy_backends import ToyAttentionBuilder, ToyImpl


class Base(AttentionBackend):
    builders = (bind_builder(FullAttentionSpec, ToyAttentionBuilder, ToyImpl),)
"""


class PluginFolder:
    """Writes plugin distributions into one folder that is on ``sys.path``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def add(self, name: str, body: str, *, attribute: str = "Backend") -> str:
        """A distribution ``attnkit-plug-<name>`` whose package ``attnkit_plug_<name>``
        runs ``body`` and whose entry point ``name`` names ``<package>:<attribute>``.
        Returns the entry point's source as the registry shows it."""
        package = f"attnkit_plug_{name}"
        dist = f"attnkit-plug-{name.replace('_', '-')}"
        (self.root / package).mkdir()
        (self.root / package / "__init__.py").write_text(textwrap.dedent(body))
        info = self.root / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            f"[{ENTRY_POINT_GROUP}]\n{name} = {package}:{attribute}\n"
        )
        self.modules.append(package)
        importlib.invalidate_caches()  # importlib.metadata caches folder listings
        return f"entry point {name} = {package}:{attribute} from distribution '{dist}'"

    def registry(self, *names: str) -> BackendRegistry:
        """A fresh registry discovering the installed entry points, allowing ``names``
        (so other installed plugins stay out), with one registered toy backend."""
        reg = BackendRegistry(allowlist=names)
        reg.register(GenericToyBackend)
        return reg


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginFolder]:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ATTNKIT_PLUGINS", raising=False)
    folder = PluginFolder(tmp_path)
    yield folder
    for module in folder.modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


def backend_class(name: str, extra: str = "", *, base: str = "Base") -> str:
    return (
        PLUGIN_HEADER
        + f"\n\nclass Backend({base}):\n    name = {name!r}\n"
        + textwrap.indent(textwrap.dedent(extra), "    ")
    )


LOAD_FAULTS = [
    pytest.param(
        "raise ImportError('needs libfoo.so')\n",
        "Backend",
        r"ImportError: needs libfoo\.so",
        id="import-error",
    ),
    pytest.param(
        "raise RuntimeError('plugin init failed')\n",
        "Backend",
        r"RuntimeError: plugin init failed",
        id="import-runtime-error",
    ),
    pytest.param(
        "import sys\nsys.exit(3)\n",
        "Backend",
        r"SystemExit: sys\.exit\(3\) was called",
        id="import-sys-exit",
    ),
    pytest.param(
        "X = 1\n",
        "Missing",
        r"AttributeError: module 'attnkit_plug_{name}' has no attribute 'Missing'",
        id="missing-attribute",
    ),
    pytest.param(
        "Backend = 42\n",
        "Backend",
        r"InvalidBackendError: 42 is not an AttentionBackend subclass",
        id="not-a-class",
    ),
    pytest.param(
        "def Backend():\n    pass\n",
        "Backend",
        r"InvalidBackendError: <function Backend at .*> is not an AttentionBackend subclass",
        id="a-function",
    ),
    pytest.param(
        backend_class(
            "{name}",
            "@classmethod\ndef supported_kinds(cls):\n    raise RuntimeError('kinds table "
            "missing')\n",
        ),
        "Backend",
        r"InvalidBackendError: attnkit_plug_{name}:Backend raised RuntimeError: kinds table "
        r"missing in supported_kinds\(\)",
        id="supported-kinds-raises",
    ),
    pytest.param(
        backend_class(
            "{name}", "@classmethod\ndef supported_kinds(cls):\n    return ['full_attention']\n"
        ),
        "Backend",
        r"InvalidBackendError: attnkit_plug_{name}:Backend\.supported_kinds\(\) must return a "
        r"frozenset of "
        r"KVCacheSpecKind, got \['full_attention'\]",
        id="supported-kinds-wrong-type",
    ),
    pytest.param(
        backend_class(
            "{name}",
            "@classmethod\ndef declaration_problems(cls):\n    raise ValueError('cannot check')\n",
        ),
        "Backend",
        r"InvalidBackendError: attnkit_plug_{name}:Backend raised ValueError: cannot check in "
        r"declaration_problems\(\)",
        id="declaration-problems-raises",
    ),
    pytest.param(
        PLUGIN_HEADER
        + "\n\nclass Meta(ABCMeta):\n    @property\n    def builders(cls):\n        raise "
        "LookupError('no builders table')\n"
        + "\n\nclass Backend(AttentionBackend, metaclass=Meta):\n    name = '{name}'\n",
        "Backend",
        r"InvalidBackendError: attnkit_plug_{name}:Backend raised LookupError: no builders table "
        r"in declaration_problems\(\)",
        id="declaration-attribute-raises",
    ),
    pytest.param(
        backend_class("{name}", "supported_devices = 'cuda'\n"),
        "Backend",
        r"InvalidBackendError: attnkit_plug_{name}:Backend is not a valid backend: "
        r"supported_devices must be a "
        r"non-empty frozenset of 'cpu', 'cuda', got 'cuda'",
        id="bad-declaration",
    ),
    pytest.param(
        backend_class(
            "{name}",
            "@classmethod\ndef extra_environment_reasons(cls, device):\n    raise OSError('probe "
            "failed')\n",
        ),
        "Backend",
        r"InvalidBackendError: attnkit_plug_{name}:Backend raised OSError: probe failed in "
        r"environment_reasons\(torch\.device\('cpu'\)\)",
        id="environment-reasons-raises",
    ),
    pytest.param(
        backend_class("other_name"),
        "Backend",
        r"InvalidBackendError: entry point '{name}' loads a backend named 'other_name'; the two "
        r"names must match",
        id="name-mismatch",
    ),
]


@pytest.mark.parametrize(("body", "attribute", "reason"), LOAD_FAULTS)
def test_plugin_that_fails_to_load(
    plugins: PluginFolder, request: pytest.FixtureRequest, body: str, attribute: str, reason: str
) -> None:
    name = "p_" + request.node.callspec.id.replace("-", "_")
    source = plugins.add(name, body.replace("{name}", name), attribute=attribute)
    reason = reason.replace("{name}", name)
    reg = plugins.registry(name)
    assert reg.entry(name).origin == "plugin"  # discovered from its metadata, not imported
    # Listing loads everything and never raises: the plugin is excluded with why.
    entries = {e.name: e for e in reg.load_all()}
    assert entries[name].backend is None
    assert re.fullmatch(reason, entries[name].error or "")
    assert reg.names() == ["toy_generic"]
    before = snapshot(reg)
    assert re.fullmatch(reason, before[1][f"{name} ({source})"])

    failure = rf"plugin '{name}' \({re.escape(source)}\) failed to load and is excluded: {reason}"
    # Named anywhere, it reports its failure, not "unknown backend".
    for lookup in (reg.get, reg.entry):
        with pytest.raises(PluginError, match=rf"^{failure}$"):
            lookup(name)
    with pytest.raises(
        BackendNotSupportedError,
        match=rf"AttentionConfig\.backend but cannot serve .*\n  - {failure}\n",
    ):
        select_backend(FULL, AttentionConfig(backend=name), device="cpu", registry=reg)
    cfg = AttentionConfig(backend_per_kind={"full_attention": name})
    with pytest.raises(BackendNotSupportedError) as info:
        select_backend(FULL, cfg, device="cpu", registry=reg)
    (rejection,) = info.value.rejected
    assert rejection.backend == name
    assert re.fullmatch(failure, rejection.reasons[0])
    # Among the candidates it is a rejection; another backend serves.
    selection = select_backend(
        FULL, AttentionConfig(), device="cpu", registry=reg, priority={"cpu": (name,)}
    )
    assert selection.backend is GenericToyBackend
    assert [r.backend for r in selection.rejected] == [name]
    assert re.fullmatch(failure, selection.rejected[0].reasons[0])
    # A config validated against the registry says the same.
    with pytest.raises(ValidationError, match=rf"backend '{name}' failed to load: {failure}"):
        AttentionConfig.model_validate({"backend": name}, context={"registry": reg})
    assert snapshot(reg) == before


def test_plugin_that_fails_on_first_use_in_selection(plugins: PluginFolder) -> None:
    # Not loaded before: selection imports it, it calls sys.exit, selection carries on.
    plugins.add("first_use_exit", "import sys\nsys.exit(3)\n")
    reg = plugins.registry("first_use_exit")
    assert reg.names() == ["first_use_exit", "toy_generic"]
    selection = select_backend(FULL, AttentionConfig(), device="cpu", registry=reg)
    assert selection.backend is GenericToyBackend
    assert selection.rejected == (
        Rejection(
            "first_use_exit",
            (
                "plugin 'first_use_exit' (entry point first_use_exit = "
                "attnkit_plug_first_use_exit:Backend "
                "from distribution 'attnkit-plug-first-use-exit') failed to load and is excluded: "
                "SystemExit: sys.exit(3) was called",
            ),
        ),
    )
    # The failure is kept: the same selection again reads the same.
    assert reg.names() == ["toy_generic"]
    assert select_backend(FULL, AttentionConfig(), device="cpu", registry=reg) == selection


HOOK_FAULTS = [
    pytest.param(
        "@classmethod\ndef not_supported_reasons(cls, request):\n    raise ValueError('bad spec "
        "table')\n",
        r"failed in not_supported_reasons\(\): ValueError: bad spec table",
        id="reasons-raise-value-error",
    ),
    pytest.param(
        "@classmethod\ndef not_supported_reasons(cls, request):\n    raise SystemExit(4)\n",
        r"failed in not_supported_reasons\(\): SystemExit: sys\.exit\(4\) was called",
        id="reasons-raise-system-exit",
    ),
    pytest.param(
        "@classmethod\ndef extra_not_supported_reasons(cls, request):\n    raise "
        "KeyError('head_size')\n",
        r"failed in not_supported_reasons\(\): KeyError: 'head_size'",
        id="extra-reasons-raise",
    ),
    pytest.param(
        "@classmethod\ndef not_supported_reasons(cls, request):\n    return [42]\n",
        r"returned \[42\] \(list\) from not_supported_reasons\(\); expected a list of str",
        id="reasons-not-strings",
    ),
    pytest.param(
        "@classmethod\ndef not_supported_reasons(cls, request):\n    return 'too slow'\n",
        r"returned 'too slow' \(str\) from not_supported_reasons\(\); expected a list of str",
        id="reasons-a-string",
    ),
    pytest.param(
        "@classmethod\ndef not_supported_reasons(cls, request):\n    return None\n",
        r"returned None \(NoneType\) from not_supported_reasons\(\); expected a list of str",
        id="reasons-none",
    ),
    pytest.param(
        "@classmethod\ndef device_reasons(cls, device):\n    return 1 / 0\n",
        r"failed in device_reasons\(\): ZeroDivisionError: division by zero",
        id="device-reasons-raise",
    ),
]


@pytest.mark.parametrize(("hook", "reason"), HOOK_FAULTS)
def test_plugin_hook_that_fails_in_selection(
    plugins: PluginFolder, request: pytest.FixtureRequest, hook: str, reason: str
) -> None:
    name = "h_" + request.node.callspec.id.replace("-", "_")
    source = plugins.add(name, backend_class(name, hook))
    reg = plugins.registry(name)
    backend = reg.get(name)  # it loads: its declarations are fine
    before = snapshot(reg)
    failure = rf"plugin '{name}' \({re.escape(source)}\) {reason}"

    selection = select_backend(
        FULL, AttentionConfig(), device="cpu", registry=reg, priority={"cpu": (name,)}
    )
    assert selection.backend is GenericToyBackend
    (rejection,) = selection.rejected
    assert rejection.backend == name
    assert len(rejection.reasons) == 1
    assert re.fullmatch(failure, rejection.reasons[0])
    with pytest.raises(
        BackendNotSupportedError,
        match=rf"AttentionConfig\.backend_per_kind\['full_attention'\] .*\n  - {failure}\n",
    ):
        select_backend(
            FULL,
            AttentionConfig(backend_per_kind={"full_attention": name}),
            device="cpu",
            registry=reg,
        )
    with pytest.raises(
        NoBackendError, match=rf"  `{name}` is not supported because:\n    {failure}\n"
    ):
        select_backend(
            FULL, AttentionConfig(), device="cpu", registry=reg, priority={"cpu": ()}, num_heads=3
        )
    # A hook failure is per call: the plugin stays registered, nothing else changes.
    assert snapshot(reg) == before
    assert reg.get(name) is backend


def test_keyboard_interrupt_from_a_plugin_passes_through(plugins: PluginFolder) -> None:
    plugins.add("on_import_interrupt", "raise KeyboardInterrupt\n")
    reg = plugins.registry("on_import_interrupt")
    before = snapshot(reg)
    with pytest.raises(KeyboardInterrupt):
        reg.get("on_import_interrupt")
    assert snapshot(reg) == before  # not excluded: the user stopped it, it did not fail

    plugins.add(
        "hook_interrupt",
        backend_class(
            "hook_interrupt",
            "@classmethod\ndef not_supported_reasons(cls, request):\n    raise KeyboardInterrupt\n",
        ),
    )
    reg = plugins.registry("hook_interrupt")
    with pytest.raises(KeyboardInterrupt):
        select_backend(
            FULL,
            AttentionConfig(),
            device="cpu",
            registry=reg,
            priority={"cpu": ("hook_interrupt",)},
        )


def test_a_builtin_that_raises_is_a_bug_and_propagates() -> None:
    reg = BackendRegistry(
        builtins={"broken_builtin": "attnkit_catalogue_missing_builtin:X"}, discover_plugins=False
    )
    with pytest.raises(ModuleNotFoundError, match="attnkit_catalogue_missing_builtin"):
        reg.get("broken_builtin")


def test_plugins_get_the_absent_device_reason(plugins: PluginFolder) -> None:
    plugins.add("device_ok", backend_class("device_ok"))
    reg = plugins.registry("device_ok")
    if torch.cuda.device_count() > 7:
        pytest.skip("cuda:7 exists here")
    with pytest.raises(NoBackendError) as info:
        select_backend(FULL, AttentionConfig(), device="cuda:7", capability=(9, 0), registry=reg)
    reasons = {r.backend: r.reasons for r in info.value.rejected}
    assert set(reasons) == {"device_ok", "toy_generic"}
    for name, given in reasons.items():
        assert given[0].startswith("device 'cuda:7' "), name


def test_attnkit_backends_survives_a_plugin_that_exits_on_import(tmp_path: Path) -> None:
    package = tmp_path / "attnkit_plug_cli_exit"
    package.mkdir()
    (package / "__init__.py").write_text("import sys\nsys.exit(3)\n")
    info = tmp_path / "attnkit_plug_cli_exit-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: attnkit-plug-cli-exit\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ncli_exit = attnkit_plug_cli_exit:Backend\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("ATTNKIT_PLUGINS", None)
    result = subprocess.run(
        [sys.executable, "-m", "attnkit", "backends"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for builtin in ("reference", "triton_attn", "flash_attn", "triton_mamba2"):
        assert f"  {builtin} [builtin] " in result.stdout
    assert "  cli_exit [plugin] " in result.stdout
    assert "SystemExit: sys.exit(3) was called" in result.stdout
