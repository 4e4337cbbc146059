"""``attnkit demo --hf-family NAME`` and ``examples/transformers_generate.py``: a tiny
transformers model through the engine loop, checked against eager attention."""

from __future__ import annotations

import importlib.util
import io
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from attnkit.cli import EXIT_USAGE, main

ROOT = Path(__file__).resolve().parent.parent.parent


def _demo(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(["demo", *argv], out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_demo_runs_a_family_through_the_loop_and_checks_it() -> None:
    pytest.importorskip("transformers")
    status, out, err = _demo("--hf-family", "gemma2", "--steps", "3")
    assert (status, err) == (0, ""), out
    assert "model.layers.0.self_attn: sliding_window window=6 scale=0.2041 softcap=5" in out
    # Three requests, arriving one step apart, all finished; some step mixes a decode
    # with another request's prompt chunk.
    assert re.search(r"step \d+: .*\((?:[1-9]\d*) prefill, (?:[1-9]\d*) decode\)", out)
    finished = {
        rid for ids in re.findall(r"finished (req\d(?:, req\d)*)", out) for rid in ids.split(", ")
    }
    assert finished == {"req0", "req1", "req2"}, out
    found = re.search(
        r"matches transformers eager attention at every step: max \|dlogit\| (\S+)", out
    )
    assert found is not None
    assert float(found.group(1)) < 1e-4


def test_demo_without_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    status, _, err = _demo("--hf-family", "llama")
    assert status == EXIT_USAGE
    assert "pip install 'attnkit[transformers]'" in err
    assert "Traceback" not in err


def test_demo_refuses_an_unknown_family() -> None:
    with pytest.raises(SystemExit) as raised:
        _demo("--hf-family", "bert")
    assert raised.value.code == EXIT_USAGE


def test_the_example_generates_and_checks(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    path = ROOT / "examples" / "transformers_generate.py"
    spec = importlib.util.spec_from_file_location("transformers_generate_example", path)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--family", "mistral", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^req2: \[(\d+, ){2}\d+\]$", out, flags=re.M)
    assert out.rstrip().endswith("-> ok")


def test_the_example_checks_the_device_before_downloading(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tf = pytest.importorskip("transformers")
    path = ROOT / "examples" / "transformers_generate.py"
    spec = importlib.util.spec_from_file_location("transformers_generate_example", path)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("from_pretrained was called before the device check")

    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", no_download)
    monkeypatch.setattr(tf.AutoTokenizer, "from_pretrained", no_download)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(SystemExit) as raised:
        example.main(["--model", "Qwen/Qwen2.5-0.5B", "--device", f"cuda:{count}"])
    assert raised.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: argument --device: 'cuda:{count}' is not available here ({count} CUDA "
        "device(s) visible); --device cpu runs anywhere"
    )


class _Tokenizer:
    """Stands in for a downloaded tokenizer: bytes -> ids, ids -> text."""

    def __call__(self, text: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(input_ids=[3 + b % 60 for b in text.encode()])

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def test_the_documented_example_generates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Python block of docs/integrations.md, "Use attnkit with a transformers
    model", as written (tests/test_docs.py leaves it to this test)."""
    tf = pytest.importorskip("transformers")
    text = (ROOT / "docs" / "integrations.md").read_text()
    section = text[text.index("## Use attnkit with a transformers model") :]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert block is not None
    config = tf.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip

    def tiny(name: str, dtype: torch.dtype) -> torch.nn.Module:
        assert (name, dtype) == ("Qwen/Qwen2.5-0.5B", torch.bfloat16)
        # float32 all the same: bfloat16 matmuls are slow on CPU, and the test is about
        # the snippet's calls, not the dtype.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    # No download: the checkpoint and tokenizer are a tiny random Qwen2 and a byte map.
    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", tiny)
    monkeypatch.setattr(tf.AutoTokenizer, "from_pretrained", lambda name: _Tokenizer())
    exec(compile(block.group(1), "docs/integrations.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    for rid in ("r0", "r1"):
        generated = next(line for line in lines if line.startswith(f"{rid} ")).split()[1:]
        assert len(generated) == 16
    assert lines[-1].startswith("StepStats(step=0, scheduled=(('r0', 24), ('r1', 17))")
