"""The state types (``attnkit.state_types``): one object per ``mamba_type``, asked for
every per-type fact, and a new type added through the files docs/architecture.md names.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from typing_extensions import override

from attnkit import (
    BackendRegistry,
    Mamba1LayerParams,
    Mamba2LayerParams,
    MambaSpec,
    MambaType,
    StateLayerParams,
)
from attnkit.backend import AttentionBackend, BackendRequest
from attnkit.backends.reference import (
    ReferenceBackend,
    ReferenceStateBuilder,
    ReferenceStateImpl,
)
from attnkit.binding import bind_builder
from attnkit.errors import InvalidArgumentError
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.state_inputs import StateInputs
from attnkit.state_types import STATE_TYPES, state_type_of

CPU = torch.device("cpu")
SRC = Path(__file__).resolve().parent.parent / "src"
KNOWN = "mamba1, mamba2, gdn, linear, short_conv"


# --------------------------------------------------------------------------- registry


def test_every_mamba_type_has_one_state_type() -> None:
    assert list(STATE_TYPES) == list(get_args(MambaType))
    for name, state_type in STATE_TYPES.items():
        assert state_type.name == name
        assert state_type_of(name) is state_type
        assert state_type.params_type in get_args(StateLayerParams)
        assert state_type.inputs_type in get_args(StateInputs)
        assert state_type.params_type.inputs_type is state_type.inputs_type
    # The reference backend serves every type, declared from the registry.
    assert ReferenceBackend.supported_mamba_types == frozenset(get_args(MambaType))
    # The demo's names (the CLI's too) are the types' short names.
    assert [t.short_name for t in STATE_TYPES.values()] == [
        "mamba1",
        "mamba",
        "gdn",
        "linear",
        "short_conv",
    ]


def test_an_unknown_type_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        state_type_of("mamba3")
    assert str(info.value) == f"unknown mamba_type 'mamba3'; known: {KNOWN}"
    with pytest.raises(InvalidArgumentError, match="expected a MambaSpec or a mamba_type name"):
        state_type_of(3)  # type: ignore[arg-type]  # an untyped caller's value
    # A spec whose type was forced past its own check: the reference impl refuses it
    # instead of running another type's path.
    params = _example("mamba2")
    spec = MambaSpec(block_size=16, shapes=params.state_shapes, dtypes=(torch.float32,) * 2)
    object.__setattr__(spec, "mamba_type", "mamba3")
    with pytest.raises(InvalidArgumentError, match=rf"unknown mamba_type 'mamba3'; known: {KNOWN}"):
        ReferenceStateImpl(spec, params)


def _example(name: str) -> Any:
    return state_type_of(name).example(torch.Generator().manual_seed(0), CPU)


# ----------------------------------------------------------------------- spec problems


@pytest.mark.parametrize(
    ("name", "shapes", "dtypes", "problems"),
    [
        pytest.param("mamba2", ((8, 3), (2, 4, 5)), None, [], id="mamba2-fits"),
        pytest.param(
            "mamba2",
            ((8, 3), (5,)),
            None,
            ["mamba2 shapes must be ((C, W-1), (H, P, N)), got ((8, 3), (5,))"],
            id="mamba2-rank",
        ),
        pytest.param(
            "mamba1",
            ((8, 3), (9, 4)),
            None,
            ["mamba1 shapes must be ((D, W-1), (D, N)), got ((8, 3), (9, 4))"],
            id="mamba1-two-d",
        ),
        pytest.param(
            "mamba1",
            ((8, 3), (8, 4)),
            (torch.float32, torch.bfloat16),
            ["mamba1 ssm state dtype (dtypes[1]) must be float32, got bfloat16"],
            id="mamba1-bf16-ssm",
        ),
        pytest.param(
            "gdn",
            ((8, 3), (2, 4, 4)),
            (torch.float16, torch.float16),
            ["gdn delta-rule state dtype (dtypes[1]) must be float32, got float16"],
            id="gdn-fp16-state",
        ),
        pytest.param(
            "linear",
            ((12, 3),),
            None,
            ["linear shapes must be ((H, K, V),), got ((12, 3),)"],
            id="linear-rank",
        ),
        pytest.param("short_conv", ((8, 3),), (torch.bfloat16,), [], id="short-conv-bf16"),
    ],
)
def test_spec_problems(
    name: str,
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...] | None,
    problems: list[str],
) -> None:
    spec = MambaSpec(
        block_size=16,
        shapes=shapes,
        dtypes=dtypes or (torch.float32,) * len(shapes),
        mamba_type=name,  # type: ignore[arg-type]  # a literal from the parameters
    )
    assert state_type_of(spec).spec_problems(spec) == problems


@pytest.mark.parametrize("name", list(STATE_TYPES))
def test_state_dtypes_keep_recurrent_states_in_the_state_dtype(name: str) -> None:
    """Conv states take the model dtype, recurrent states the state dtype (what
    attnkit.models builds): a spec so built has no problems when that is float32."""
    state_type = state_type_of(name)
    params = _example(name)
    dtypes = state_type.state_dtypes(torch.bfloat16)
    recurrent = {"mamba1": [1], "mamba2": [1], "gdn": [1], "linear": [0], "short_conv": []}[name]
    assert [i for i, d in enumerate(dtypes) if d == torch.float32] == recurrent
    assert all(d == torch.bfloat16 for i, d in enumerate(dtypes) if i not in recurrent)
    spec = MambaSpec(
        block_size=16, shapes=params.state_shapes, dtypes=dtypes, mamba_type=state_type.name
    )
    assert state_type.spec_problems(spec) == []


# -------------------------------------------------------------- tensor-parallel splits


@pytest.mark.parametrize(
    ("whole", "rank", "tp", "detail"),
    [
        pytest.param(
            Mamba1LayerParams.state_shapes_for(d_inner=64, d_state=16, conv_kernel=4),
            Mamba1LayerParams.state_shapes_for(d_inner=16, d_state=16, conv_kernel=4),
            4,
            "mamba1 channels 64 -> 16 per rank",
            id="mamba1",
        ),
        pytest.param(
            Mamba2LayerParams.state_shapes_for(
                num_heads=8, head_dim=4, n_groups=2, d_state=16, conv_kernel=4
            ),
            Mamba2LayerParams.state_shapes_for(
                num_heads=2, head_dim=4, n_groups=1, d_state=16, conv_kernel=4
            ),
            4,
            "mamba2 heads 8 -> 2 per rank, B/C groups 2 -> 1 per rank (each on 2 ranks)",
            id="mamba2-groups-replicated",
        ),
    ],
)
def test_a_split_is_the_shapes_of_the_ranks_sizes(
    whole: tuple[tuple[int, ...], ...], rank: tuple[tuple[int, ...], ...], tp: int, detail: str
) -> None:
    """The split rule reads the sizes back from the shapes that the parameter class's
    one formula (``state_shapes_for``) makes, and gives that formula's shapes for a
    rank's sizes."""
    name = "mamba1" if len(whole[1]) == 2 else "mamba2"
    assert state_type_of(name).split_shapes(whole, tp, where="layer 'x'") == (rank, detail)


@pytest.mark.parametrize("name", list(STATE_TYPES))
def test_one_rank_keeps_the_whole_state(name: str) -> None:
    shapes = _example(name).state_shapes
    got, _ = state_type_of(name).split_shapes(shapes, 1, where="layer 'x'")
    assert got == shapes


# ------------------------------------------------- every backend asks the state type


def _malformed(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The shapes with the last state cut to its first dimension: not the type's layout."""
    return (*shapes[:-1], shapes[-1][:1])


def malformed_spec_problems(backend: type[AttentionBackend]) -> list[str]:
    """What ``backend`` gets wrong with specs of the types it serves whose shapes are not
    that type's layout (Mamba2's ``((8, 3), (5,))``): selection must reject each with
    the type's reason, and an impl built for one anyway must refuse it with that reason."""
    problems: list[str] = []
    for name in sorted(backend.supported_mamba_types):
        state_type = state_type_of(name)
        params = _example(name)
        shapes = ((8, 3), (5,)) if name == "mamba2" else _malformed(params.state_shapes)
        spec = MambaSpec(
            block_size=16,
            shapes=shapes,
            dtypes=state_type.state_dtypes(torch.float32),
            mamba_type=state_type.name,
        )
        want = f"{name} shapes must be {state_type.layout}, got {shapes}"
        reasons = backend.not_supported_reasons(BackendRequest(spec=spec, device=CPU))
        if want not in reasons:
            problems.append(f"{backend.name}/{name}: selection reasons {reasons} lack {want!r}")
        binding = backend.find_binding(spec)
        assert binding is not None
        try:
            binding.create_impl(spec, params)
        except ValueError as exc:
            if want not in str(exc):
                problems.append(f"{backend.name}/{name}: construction raised {exc!r}")
        else:
            problems.append(f"{backend.name}/{name}: built an impl for shapes {shapes}")
    return problems


def _state_backends() -> list[type[AttentionBackend]]:
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    backends = [registry.get(name) for name in BUILTIN_BACKENDS]
    return [b for b in backends if b.supported_mamba_types]


def test_every_builtin_state_backend_rejects_shapes_of_another_layout() -> None:
    backends = _state_backends()
    served = {t for b in backends for t in b.supported_mamba_types}
    assert served == set(STATE_TYPES)
    assert {b.name for b in backends} >= {"reference", "triton_mamba2"}
    problems = [p for b in backends for p in malformed_spec_problems(b)]
    assert problems == []


class _UncheckedImpl(ReferenceStateImpl):
    """Builds for any spec (no state-type checks): the bug triton_mamba2 had."""

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: StateLayerParams) -> None:
        super(ReferenceStateImpl, self).__init__(kv_cache_spec, layer_params)


class _AcceptsAnyState(ReferenceBackend):
    name = "accepts_any_state"
    supported_mamba_types = frozenset({"mamba2"})
    builders = (bind_builder(MambaSpec, ReferenceStateBuilder, _UncheckedImpl),)

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        return []


def test_the_malformed_spec_check_catches_a_backend_that_does_not_ask() -> None:
    assert malformed_spec_problems(_AcceptsAnyState) == [
        "accepts_any_state/mamba2: selection reasons [] lack 'mamba2 shapes must be "
        "((C, W-1), (H, P, N)), got ((8, 3), (5,))'",
        "accepts_any_state/mamba2: built an impl for shapes ((8, 3), (5,))",
    ]


# ------------------------------------------------------------- adding a state type

# A throwaway type, "cumsum": one state [C] per request, the running sum of its inputs;
# a step writes y_t = state + x_1 + ... + x_t (the state before the step, plus the
# step's inputs so far). Each insertion is (file, anchor, text, where): the text goes
# right before or after the anchor, which must occur once. docs/architecture.md lists
# these files ("Adding a state type"); nothing else is edited.
_CUMSUM_INPUTS = '''
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CumsumInputs:
    """A cumsum layer's step: ``x [T, C]``; it writes ``y [T, C]``."""

    x: torch.Tensor

    def __post_init__(self) -> None:
        _check_tensors(type(self).__name__, {"x": self.x})

    @property
    def num_rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype


'''
_CUMSUM_PARAMS = '''
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CumsumLayerParams:
    """A running sum over ``channels`` (C): one state ``[C]`` per request."""

    inputs_type: ClassVar[type[CumsumInputs]] = CumsumInputs

    channels: int

    def __post_init__(self) -> None:
        _check_state_params(type(self).__name__, self, ("channels",))

    @staticmethod
    def state_shapes_for(*, channels: int) -> tuple[tuple[int, ...], ...]:
        return ((channels,),)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.state_shapes_for(channels=self.channels)

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.channels)


'''
_CUMSUM_TYPE = '''
def _cumsum_reference(p, inputs, states, step):
    (totals,) = states
    x = inputs.x.float()
    out = torch.empty_like(x)
    bounds = step.query_start_loc.tolist()
    for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        block = int(step.state_indices[r])
        start = totals[block] if bool(step.has_initial_state[r]) else x.new_zeros(p.channels)
        run = start + torch.cumsum(x[lo:hi], dim=0)
        out[lo:hi] = run
        if hi > lo:
            totals[block] = run[-1]
    return out


def _cumsum_split(shapes, split):
    ((channels,),) = shapes
    local = split.per_rank(channels, "channels")
    return ((local,),), f"cumsum channels {channels} -> {local} per rank"


CUMSUM = StateType(
    name="cumsum",
    short_name="cumsum",
    params_type=CumsumLayerParams,
    inputs_type=CumsumInputs,
    states=(StateTensor("running sum", ("C",), recurrent=True),),
    output=("y", "[T, C]"),
    input_widths=lambda p: {"x": InputWidth("[T, C]", (p.channels,))},
    reference=_cumsum_reference,
    split=_cumsum_split,
    example=lambda gen, device: CumsumLayerParams(channels=4),
    example_inputs=lambda p, n, gen, device: CumsumInputs(x=_randn(gen, n, p.channels).to(device)),
)


'''
_INSERTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("spec.py", '"short_conv"]', ', "cumsum"', "before-end"),
    ("state_inputs.py", "StateInputs = (\n", _CUMSUM_INPUTS, "before"),
    ("state_inputs.py", "| ShortConvInputs", " | CumsumInputs", "after"),
    ("params.py", "from .state_inputs import (\n", "    CumsumInputs,\n", "after"),
    ("params.py", "StateLayerParams = (\n", _CUMSUM_PARAMS, "before"),
    ("params.py", "    | ShortConvLayerParams\n", "    | CumsumLayerParams\n", "after"),
    ("state_types.py", "from .params import (\n", "    CumsumLayerParams,\n", "after"),
    ("state_types.py", "from .state_inputs import (\n", "    CumsumInputs,\n", "after"),
    ("state_types.py", "_ALL: tuple[StateType[Any, Any], ...] = (\n", _CUMSUM_TYPE, "before"),
    ("state_types.py", "    SHORT_CONV,\n)", "    CUMSUM,\n", "before-end"),
)
"""``before-end``: the text goes before the anchor's last character."""


def _copy_with(tmp: Path, files: set[str]) -> Path:
    """``src/attnkit`` copied under ``tmp``, with the insertions into ``files`` applied."""
    root = tmp / "src"
    shutil.copytree(SRC / "attnkit", root / "attnkit", ignore=shutil.ignore_patterns("__pycache__"))
    for name, anchor, text, where in _INSERTIONS:
        if name not in files:
            continue
        path = root / "attnkit" / name
        source = path.read_text()
        assert source.count(anchor) == 1, f"{name}: anchor {anchor!r} must occur once"
        at = source.index(anchor)
        at += {"before": 0, "after": len(anchor), "before-end": len(anchor) - 1}[where]
        path.write_text(source[:at] + text + source[at:])
    return root


def _changed_files(root: Path) -> set[str]:
    ours = {p.relative_to(SRC / "attnkit") for p in (SRC / "attnkit").rglob("*.py")}
    theirs = {p.relative_to(root / "attnkit") for p in (root / "attnkit").rglob("*.py")}
    assert ours == theirs
    here, there = SRC / "attnkit", root / "attnkit"
    return {str(p) for p in ours if (here / p).read_text() != (there / p).read_text()}


_USE_THE_NEW_TYPE = textwrap.dedent(
    """
    import torch

    from attnkit import AttentionConfig, BackendRegistry, MambaSpec
    from attnkit.backends.reference import ReferenceBackend
    from attnkit.params import CumsumLayerParams
    from attnkit.planner import plan_model
    from attnkit.registry import BUILTIN_BACKENDS
    from attnkit.runtime import AttentionRuntime, ScheduledRequest
    from attnkit.state_inputs import CumsumInputs
    from attnkit.testing import check_backend

    C = 4
    params = CumsumLayerParams(channels=C)
    spec = MambaSpec(
        block_size=1, shapes=params.state_shapes, dtypes=(torch.float32,), mamba_type="cumsum"
    )
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate({}, context={"registry": registry})
    runtime = AttentionRuntime(
        {"mixer": spec},
        config,
        device="cpu",
        memory_budget_bytes=2**12,
        layer_params={"mixer": params},
        registry=registry,
        cache_fill=float("nan"),
    )
    assert runtime.backend_for("mixer").name == "reference", runtime.backend_for("mixer")

    gen = torch.Generator().manual_seed(0)
    xs = {"a": torch.randn(6, C, generator=gen), "b": torch.randn(4, C, generator=gen)}
    schedule = [{"a": 5, "b": 3}, {"b": 1, "a": 1}]  # prefills, then decodes
    done = dict.fromkeys(xs, 0)
    outputs = {r: [] for r in xs}
    for step in schedule:
        batch = runtime.begin_step([ScheduledRequest(r, n) for r, n in step.items()])
        x = torch.cat([xs[r][done[r] : done[r] + step[r]] for r in batch.order])
        y = runtime.forward_state("mixer", CumsumInputs(x=x))
        for r, rows in batch.token_slices().items():
            outputs[r].append(y[rows])
            done[r] += step[r]
    for r, x in xs.items():
        # The running sum, written out one token at a time in float64.
        want, total = [], [0.0] * C
        for row in x.tolist():
            total = [t + v for t, v in zip(total, row)]
            want.append(total)
        torch.testing.assert_close(
            torch.cat(outputs[r]).double(), torch.tensor(want, dtype=torch.float64)
        )

    for tp, shapes in ((1, ((4,),)), (2, ((2,),))):
        plan = plan_model(
            {"mixer": spec}, AttentionConfig(), device="cpu", registry=registry,
            layer_params={"mixer": params}, tensor_parallel=tp,
        )
        assert plan.groups[0].backend_name == "reference", plan.groups[0].error
        (split,) = plan.per_rank.splits
        assert split.spec.shapes == shapes, split
        assert split.detail == f"cumsum channels 4 -> {4 // tp} per rank", split.detail

    report = check_backend(ReferenceBackend, kinds=["mamba"], max_examples=1, registry=registry)
    report.assert_ok()
    result = next(r for r in report.results if r.capability == "kind=mamba mamba_type=cumsum")
    assert result.status == "passed", result
    print("ok")
    """
)


def _run(root: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )


def test_a_new_state_type_needs_only_spec_inputs_params_and_state_types(tmp_path: Path) -> None:
    """A throwaway type registered through spec.py, state_inputs.py, params.py and
    state_types.py alone: the runtime serves it on reference (checked against the
    running sum written out here), the planner splits it, and the kit passes it."""
    root = _copy_with(tmp_path, {"spec.py", "state_inputs.py", "params.py", "state_types.py"})
    assert _changed_files(root) == {"spec.py", "state_inputs.py", "params.py", "state_types.py"}
    result = _run(root, _USE_THE_NEW_TYPE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_new_type_without_its_state_type_fails_at_import(tmp_path: Path) -> None:
    root = _copy_with(tmp_path, {"spec.py", "state_inputs.py", "params.py"})
    result = _run(root, "import attnkit")
    assert result.returncode != 0
    assert (
        "AssertionError: mamba_type 'cumsum' has no StateType: add one to _ALL in "
        "attnkit/state_types.py"
    ) in result.stderr

