"""One host-to-device copy per step: ``hosts_to_device`` packs the step's host tensors
into one buffer and sends it once; ``begin_step`` off the CPU makes every group's
device tensors that way.

No GPU here: the packing is checked with a copy that clones the buffer (a stand-in
for the device transfer), and a CPU runtime is given that copy, so its device fields
come out of one buffer while everything else runs as on a device.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

import pytest
import torch

import attnkit.runtime._step as step_module
from attnkit.demo import DemoModel
from attnkit.metadata import CommonAttentionMetadata, hosts_to_device, pack_and_copy
from attnkit.runtime import AttentionRuntime, ScheduledRequest
from test_runtime import make_runtime

LAYOUT = ("full", "mamba", "window", "full")


def host_tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.arange(5, dtype=torch.int32),
        torch.randint(0, 1 << 40, (2, 3), generator=gen, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int32),  # an empty one
        torch.tensor([True, False, True]),  # 3 bytes: the next one must realign
        torch.randn(3, generator=gen).to(torch.bfloat16),  # no numpy dtype
        torch.arange(12, dtype=torch.int32).view(3, 4)[:, 1:3],  # not contiguous
        torch.randn(4, 2, generator=gen),
    ]


def test_packed_tensors_come_back_equal_from_one_buffer() -> None:
    tensors = host_tensors()
    sends: list[torch.Tensor] = []

    def send(buffer: torch.Tensor) -> torch.Tensor:
        sends.append(buffer)
        return buffer.clone()

    out = pack_and_copy(tensors, send)
    assert len(sends) == 1
    storage = sends[0].untyped_storage().data_ptr()
    for i, (want, got) in enumerate(zip(tensors, out, strict=True)):
        assert got.dtype == want.dtype, i
        assert got.shape == want.shape, i
        assert torch.equal(got, want), i
        # A view of the one sent buffer, at an 8-byte boundary of it.
        assert got.untyped_storage().data_ptr() != storage  # (the clone: a copy was sent)
        offset = got.data_ptr() - out[0].data_ptr()
        assert offset % 8 == 0, (i, offset)
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1


def test_hosts_to_device_on_the_cpu_is_the_tensors_themselves() -> None:
    tensors = host_tensors()
    assert all(
        a is b for a, b in zip(tensors, hosts_to_device(tensors, torch.device("cpu")), strict=True)
    )


def _drops_the_last(
    tensors: Sequence[torch.Tensor],
    copy: Callable[[torch.Tensor], torch.Tensor],
    *,
    pin: bool = False,
) -> list[torch.Tensor]:
    """A packing that forgets to write the last tensor into the buffer."""
    return _pack_and_copy([*tensors[:-1], torch.zeros_like(tensors[-1])], copy, pin=pin)


_pack_and_copy = pack_and_copy


def test_a_packing_that_loses_a_tensor_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "pack_and_copy", _drops_the_last)
    with pytest.raises(AssertionError):
        test_packed_tensors_come_back_equal_from_one_buffer()


# ---------------------------------------------------------------------------- begin_step

DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")
HOST_FIELDS = ("query_start_loc_cpu", "seq_lens_cpu", "num_computed_tokens_cpu")


class CountingSend:
    """``AttentionRuntime._send_to_device`` for a CPU runtime: packs as on a device,
    the buffer's transfer a clone; counts the sends and remembers each buffer."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        def send(buffer: torch.Tensor) -> torch.Tensor:
            sent = buffer.clone()
            self.buffers.append(sent)
            return sent

        return pack_and_copy(tensors, send)


STEPS: list[list[tuple[str, int]]] = [
    [("a", 9), ("b", 3)],
    [("a", 1), ("b", 1), ("c", 6)],  # a mixed step: decodes and a new prompt
    [("a", 1), ("b", 1), ("c", 1)],
    [("c", 2), ("a", 1)],  # a verify-sized run and a decode, rows out of order
]


def commons_of(runtime: AttentionRuntime) -> list[CommonAttentionMetadata]:
    out = []
    for entry in runtime._groups:
        assert entry.common is not None
        out.append(entry.common)
    return out


Pairs = list[list[tuple[CommonAttentionMetadata, CommonAttentionMetadata]]]


def run_both(
    model: DemoModel,
) -> tuple[list[torch.Tensor], list[torch.Tensor], CountingSend, Pairs]:
    """The steps on a plain CPU runtime and on one whose device tensors are sent packed:
    each step's outputs (rows by request id) and both runtimes' metadata per group."""
    plain, packed = make_runtime(model, shuffle=3), make_runtime(model, shuffle=3)
    send = CountingSend()
    packed._send_to_device = send
    outs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    pairs: Pairs = []
    gen = torch.Generator().manual_seed(1)
    for step in STEPS:
        sched = [ScheduledRequest(rid, n) for rid, n in step]
        chunks = {rid: torch.randint(0, 64, (n,), generator=gen) for rid, n in step}
        for runtime, out in zip((plain, packed), outs, strict=True):
            batch = runtime.begin_step(sched)
            hidden = model.forward_step(runtime, torch.cat([chunks[r] for r in batch.order]))
            rows = batch.token_slices()
            out.append(torch.cat([hidden[rows[rid]] for rid, _ in step]))
        pairs.append(list(zip(commons_of(plain), commons_of(packed), strict=True)))
    return outs[0], outs[1], send, pairs


def test_a_step_sends_its_tensors_in_one_copy_and_changes_nothing() -> None:
    model = DemoModel(layout=LAYOUT, window=5)
    plain, packed, send, pairs = run_both(model)
    assert len(send.buffers) == len(STEPS)  # one copy a step
    for step, (groups, buffer) in enumerate(zip(pairs, send.buffers, strict=True)):
        for g, (want, got) in enumerate(groups):
            for name in DEVICE_FIELDS:
                a, b = getattr(want, name), getattr(got, name)
                assert torch.equal(a, b), (step, g, name)
                # Out of the step's one sent buffer.
                assert b.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), (
                    step,
                    g,
                    name,
                )
            for name in HOST_FIELDS:  # the host copies stay host tensors, not the sent ones
                b = getattr(got, name)
                assert b.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
                assert torch.equal(getattr(want, name), b), (step, g, name)
    for step, (a, b) in enumerate(zip(plain, packed, strict=True)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")


def _forgets_the_slots(
    cm: CommonAttentionMetadata, moved: dict[int, torch.Tensor]
) -> CommonAttentionMetadata:
    """A swap that leaves the slot mapping on the host."""
    got = _on_device(cm, moved)
    return dataclasses.replace(got, slot_mapping=cm.slot_mapping, validate=False)


_on_device = step_module._on_device


def test_a_swap_that_leaves_a_field_behind_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_module, "_on_device", _forgets_the_slots)
    with pytest.raises(AssertionError):
        test_a_step_sends_its_tensors_in_one_copy_and_changes_nothing()
