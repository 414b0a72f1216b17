"""The private torch/transformers names of trainers/common/compat.py still resolve and still mean what the trainers rely on.

When a torch or transformers upgrade moves one, this test names it; compat.py's docstring lists each.
"""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gpudeck.trainers.common import compat


@pytest.mark.parametrize(("module", "cls", "meth"), compat.FSDP_STALL_POINTS, ids=lambda x: str(x).rsplit(".", 1)[-1])
def test_every_fsdp2_stall_point_resolves(module: str, cls: str, meth: str) -> None:
    assert callable(getattr(getattr(importlib.import_module(module), cls), meth)), f"{module}.{cls}.{meth} moved"


def test_patching_wraps_each_point_once_and_reports_it(monkeypatch) -> None:
    for module, cls, meth in compat.FSDP_STALL_POINTS:  # put the methods back afterwards (the clocks' tests patch them)
        owner = getattr(importlib.import_module(module), cls)
        monkeypatch.setattr(owner, meth, getattr(owner, meth))
    seen = []

    def wrap(original):
        seen.append(original)

        def wrapped(*a, **k):
            return original(*a, **k)

        return wrapped

    first = compat.patch_fsdp_stalls(wrap)
    assert first == [f"{c}.{m}" for _, c, m in compat.FSDP_STALL_POINTS]
    assert compat.patch_fsdp_stalls(wrap) == first  # a second clock does not wrap the wrappers
    assert len(seen) <= len(first)


def test_checkpoint_wrapper_and_compile_prefixes() -> None:
    wrapped = torch.nn.Sequential(compat.checkpoint_wrapper(torch.nn.Linear(2, 2)))
    names = [n.removeprefix("0.") for n, _ in wrapped.named_parameters()]
    assert names and all(n.startswith(compat.CHECKPOINT_WRAPPER_PREFIX) for n in names), names
    compiled = torch.compile(torch.nn.Linear(2, 2))
    keys = list(compiled.state_dict())
    assert keys and all(k.startswith(compat.COMPILED_PREFIX) for k in keys), keys
    assert compat.clean_fqn("model.layers.0._checkpoint_wrapped_module._orig_mod.mlp.weight") == "model.layers.0.mlp.weight"


def test_dynamo_cache_limit_and_flight_recorder_dumps() -> None:
    import torch._dynamo

    before = torch._dynamo.config.cache_size_limit
    compat.raise_dynamo_cache_limit(before + 1)
    try:
        assert torch._dynamo.config.cache_size_limit == before + 1
    finally:
        torch._dynamo.config.cache_size_limit = before
    assert compat.flight_recorder_dumps(), "torch._C._distributed_c10d._dump_fr_trace_json moved"


def test_set_attn_implementation_reaches_the_built_model() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64, intermediate_size=64)
    compat.set_attn_implementation(config, "eager")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model.config._attn_implementation == "eager"
