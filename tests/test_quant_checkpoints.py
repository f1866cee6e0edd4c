"""Quantized safetensors checkpoints (AWQ, GPTQ, compressed-tensors) load into pdserve's
quantized linears without loss: every weight dequantizes exactly to the integers the test
packed (in each library's on-disk layout, packed by ``quant_checkpoints.py`` from the
spec, or by compressed-tensors' own ``pack_to_int32``, whose decompressor also checks
the same values: a dev dependency), and greedy generation gives the tokens and
logprobs transformers gives on the same dequantized weights stored as floats. What
pdserve does not read is refused, naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_matches_transformers, random_prompts, write_tiny_checkpoint
from quant_checkpoints import quantize, write_quantized
from safetensors.torch import load_file, save_file
from test_engine_correctness import hf_greedy

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ModelConfig, UnsupportedModelError
from pdserve.engine.model_source import open_model
from pdserve.engine.models.quantization import QuantizedLinear, check_quantization
from pdserve.engine.quant_checkpoint import from_unsigned
from pdserve.engine.quant_config import parse_quantization_config
from pdserve.kernels.quant_linear import dequantize

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def ct_group(bits: int, strategy: str, group: int | None, symmetric: bool,
             targets=("Linear",), fmt: str | None = None) -> dict:
    """One of compressed-tensors' ``config_groups`` (as llm-compressor saves it)."""
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"}
    scheme = {"targets": list(targets), "weights": weights, "input_activations": None}
    return scheme if fmt is None else {**scheme, "format": fmt}


def ct_config(fmt: str, bits: int, strategy: str, group: int | None, symmetric: bool,
              ignore=("lm_head",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": list(ignore),
            "config_groups": {"group_0": ct_group(bits, strategy, group, symmetric)}}


# name -> (architecture, write_quantized arguments)
CASES = {
    "awq-g32": ("llama", {
        "layout": "awq", "bits": 4, "group": 32, "symmetric": False,
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                "zero_point": True, "version": "gemm"}}),
    # Qwen2: biases on q/k/v, tied embeddings; the LM head quantized (lm_head: true)
    "gptq-v1-4bit-head": ("qwen2", {
        "layout": "gptq", "bits": 4, "group": 32, "symmetric": False, "quantize_head": True,
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                "desc_act": False, "sym": False, "lm_head": True,
                                "checkpoint_format": "gptq"}}),
    # desc_act with groups in order (g_idx = k // group_size) is read
    "gptq-v2-8bit-channel": ("llama", {
        "layout": "gptq_v2", "bits": 8, "group": -1, "symmetric": True,
        "quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                                "desc_act": True, "sym": True,
                                "checkpoint_format": "gptq_v2"}}),
    # down_proj ignored by a regex: stays float
    "ct-pack-4bit-asym": ("llama", {
        "layout": "pack-quantized", "bits": 4, "group": 32, "symmetric": False,
        "scale_dtype": torch.bfloat16, "keep_float": lambda module: module.endswith("down_proj"),
        "quantization_config": ct_config("pack-quantized", 4, "group", 32, False,
                                         ignore=("lm_head", "re:.*down_proj$"))}),
    "ct-pack-8bit-channel": ("qwen3", {
        "layout": "pack-quantized", "bits": 8, "group": -1, "symmetric": True,
        "scale_dtype": torch.bfloat16,
        "quantization_config": ct_config("pack-quantized", 8, "channel", None, True)}),
    "ct-int8-group-asym": ("llama", {
        "layout": "int-quantized", "bits": 8, "group": 32, "symmetric": False,
        "quantization_config": ct_config("int-quantized", 8, "group", 32, False)}),
    # two config groups (a regex and module names as targets) of two formats; o_proj in
    # neither stays float
    "ct-two-groups": ("llama", {
        "layout": "pack-quantized", "bits": 4, "group": 64, "symmetric": True,
        "keep_float": lambda module: module.endswith("o_proj"),
        "overrides": lambda module: {"layout": "int-quantized", "bits": 8, "group": -1,
                                     "symmetric": False} if ".mlp." in module else {},
        "quantization_config": {**ct_config("mixed-precision", 4, "group", 64, True),
                                "config_groups": {
            "attention": ct_group(4, "group", 64, True, ["re:.*self_attn\\.[qkv]_proj$"],
                                  "pack-quantized"),
            "mlp": ct_group(8, "channel", None, False, [
                f"model.layers.{i}.mlp.{name}" for i in range(2)
                for name in ("gate_proj", "up_proj", "down_proj")], "int-quantized")}}}),
}


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def fused_name(module: str) -> str:
    """pdserve's name of the linear a checkpoint's ``module`` is a shard of."""
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{FUSED.get(leaf, leaf)}" if parent else leaf


def ct_library_dequantize(qz, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompressor on one linear's stored tensors (its scales
    widened to fp32 first, so the library's product is exact too)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    channel = qz.group == qz.q.shape[1]
    args = QuantizationArgs(num_bits=qz.bits, type="int", symmetric=qz.symmetric,
                            strategy="channel" if channel else "group",
                            group_size=None if channel else qz.group)
    compressor = BaseCompressor.get_value_from_registry(qz.layout)
    state = {**stored, "weight_scale": stored["weight_scale"].float()}
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return compressor.decompress(state, scheme)["weight"].float()


@pytest.mark.parametrize("name", CASES)
def test_checkpoint_loads_exactly_and_gives_transformers_tokens(name, tmp_path):
    arch, case = CASES[name]
    float_path = write_tiny_checkpoint(tmp_path / "float", arch)
    path, twin, integers = write_quantized(float_path, tmp_path / name, **case)
    stored = load_file(path / "model.safetensors")

    weights = dict(open_model(path).iterate_weights(torch.float32, progress=False))
    for module, qz in integers.items():
        assert torch.equal(dequantize(weights[f"{module}.weight"]), qz.dequantize()), module
        if qz.layout in ("pack-quantized", "int-quantized"):
            parts = {k.rpartition(".")[2]: v for k, v in stored.items()
                     if k.rpartition(".")[0] == module}
            library = ct_library_dequantize(qz, parts)
            assert torch.equal(library, qz.dequantize()), module

    prompts = random_prompts([3, 17, 40], seed=3)
    expected = hf_greedy(twin, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", max_model_len=128, load_progress=False)
    model = llm.engine.model_runner.model
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert quantized == {fused_name(module) for module in integers}
    assert llm.engine.model_config.quantization == case["quantization_config"]["quant_method"]
    assert_matches_transformers(llm.generate(prompts, GREEDY), expected)


def with_quantization(quant: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 320, "quantization_config": quant}


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
CT = ct_config("pack-quantized", 4, "group", 32, True)
CT_GROUP = CT["config_groups"]["group_0"]


def ct_with(**weights) -> dict:
    group = {**CT_GROUP, "weights": {**CT_GROUP["weights"], **weights}}
    return {**CT, "config_groups": {"group_0": group}}


@pytest.mark.parametrize(("quant", "named"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method='fp8'"),
    ({**AWQ, "bits": 8}, "bits=8"),
    ({**AWQ, "version": "gemv"}, "version='gemv'"),
    ({**AWQ, "zero_point": False}, "zero_point=False"),
    ({**GPTQ, "bits": 3}, "bits=3"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**GPTQ, "is_marlin_format": True}, "checkpoint_format='marlin'"),
    ({**GPTQ, "dynamic": {"-:.*down_proj": {}}}, "dynamic="),
    ({**CT, "format": "float-quantized"}, "format='float-quantized'"),
    ({**CT, "format": "marlin-24"}, "format='marlin-24'"),
    ({**CT, "quantization_status": "frozen"}, "quantization_status='frozen'"),
    ({**CT, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config="),
    ({**CT, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme="),
    ({**CT, "config_groups": {"group_0": {**CT_GROUP, "input_activations": {
        "num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}}}},
     "config_groups.group_0.input_activations="),
    (ct_with(type="float", num_bits=8), "config_groups.group_0.weights.type='float'"),
    (ct_with(num_bits=2), "config_groups.group_0.weights.num_bits=2"),
    (ct_with(strategy="tensor", group_size=None),
     "config_groups.group_0.weights.strategy='tensor'"),
    (ct_with(strategy="block"), "config_groups.group_0.weights.strategy='block'"),
    (ct_with(actorder="group"), "config_groups.group_0.weights.actorder='group'"),
    (ct_with(dynamic=True), "config_groups.group_0.weights.dynamic=True"),
])
def test_unsupported_quantization_configs_are_refused_naming_the_field(quant, named):
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_dict(with_quantization(quant), model="tiny")
    message = str(info.value)
    assert f"quantization_config.{named}" in message and "pdserve reads" in message, message


def test_which_linears_each_config_quantizes():
    def formats(quant, modules):
        parsed = parse_quantization_config(quant)
        return [None if parsed.format_of(m) is None else parsed.format_of(m).layout
                for m in modules]

    layer = "model.layers.0"
    modules = [f"{layer}.self_attn.q_proj", f"{layer}.self_attn.o_proj", f"{layer}.mlp.down_proj",
               "lm_head"]
    assert formats({**AWQ, "modules_to_not_convert": ["mlp.down_proj"]}, modules) == [
        "awq", "awq", None, None]
    assert formats({**GPTQ, "modules_in_block_to_quantize": [["self_attn.q_proj"], [
        "mlp.down_proj"]]}, modules) == ["gptq", None, "gptq", None]
    assert formats({**GPTQ, "checkpoint_format": "gptq_v2", "lm_head": True}, modules) == [
        "gptq_v2"] * 4
    ct = {**CT, "ignore": ["re:.*o_proj$"], "config_groups": {
        "g": ct_group(4, "group", 32, True, targets=["re:.*self_attn.*", "lm_head"])}}
    assert formats(ct, modules) == ["pack-quantized", None, None, "pack-quantized"]


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    float_path = write_tiny_checkpoint(root / "float", "llama")
    return write_quantized(float_path, root / "awq", **CASES["awq-g32"][1])[0]


def test_quantization_flag_must_match_the_checkpoint(awq_checkpoint):
    assert check_quantization(None, "awq") == "awq"
    assert check_quantization("compressed-tensors", "compressed-tensors") == "compressed-tensors"
    assert check_quantization("int4", None) == "int4"
    for flag, stored, named in [("gptq", "awq", "--quantization 'gptq'.*quant_method 'awq'"),
                                ("awq", None, "--quantization 'awq'.*no quantization_config"),
                                ("awq", "gguf", "--quantization 'awq'.*a GGUF file"),
                                ("int8", "gptq", "--quantization 'int8'.*stored quantized"),
                                ("gguf", "awq", "--quantization gguf")]:
        with pytest.raises(ValueError, match=named):
            check_quantization(flag, stored)
    with pytest.raises(ValueError, match="--quantization 'gptq'.*quant_method 'awq'"):
        LLM(str(awq_checkpoint), quantization="gptq", load_progress=False)
    llm = LLM(str(awq_checkpoint), quantization="awq", load_progress=False)
    assert llm.engine.model_config.quantization == "awq"


def test_act_order_groups_are_refused_at_load(tmp_path):
    float_path = write_tiny_checkpoint(tmp_path / "float", "llama")
    path = write_quantized(float_path, tmp_path / "gptq", layout="gptq", bits=4, group=32,
                           symmetric=True, quantization_config={**GPTQ, "desc_act": True})[0]
    tensors = load_file(path / "model.safetensors")
    g_idx = tensors["model.layers.1.mlp.down_proj.g_idx"]  # act order: groups permuted
    tensors["model.layers.1.mlp.down_proj.g_idx"] = g_idx[torch.randperm(len(g_idx))]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"down_proj\.g_idx is not k // group_size"):
        LLM(str(path), load_progress=False)


def test_a_module_stored_quantized_that_the_config_ignores_is_refused(tmp_path):
    float_path = write_tiny_checkpoint(tmp_path / "float", "llama")
    case = {**CASES["ct-pack-4bit-asym"][1], "keep_float": lambda module: False}
    path = write_quantized(float_path, tmp_path / "ct", **case)[0]
    with pytest.raises(UnsupportedModelError,
                       match="model.layers.0.mlp.down_proj is stored quantized"):
        LLM(str(path), load_progress=False)


@pytest.mark.parametrize(("k", "group", "kernel_group"), [(2048, 2048, 1024), (96, 48, 16)])
def test_groups_the_kernels_do_not_take_run_as_smaller_groups(k, group, kernel_group):
    """Per channel, K = 2048 exceeds the kernels' 1024 for groups with mins, and 48 is no
    multiple of 32: the scales and mins repeat over smaller groups, the values unchanged."""
    qz = quantize(torch.randn(8, k), 4, group, False)
    weight = from_unsigned("proj", qz.q, qz.zero, qz.scale, 4, group)
    assert weight.group_size == kernel_group and weight.scale.shape == (8, k // kernel_group)
    assert torch.equal(dequantize(weight), qz.dequantize())


def test_a_group_no_kernel_group_divides_is_refused():
    qz = quantize(torch.randn(8, 64), 4, 8, False)
    with pytest.raises(UnsupportedModelError, match="group_size=8 is not supported"):
        from_unsigned("proj", qz.q, qz.zero, qz.scale, 4, 8)


def test_a_linear_split_across_shards_is_read_whole(awq_checkpoint, tmp_path):
    """A sharded checkpoint may put one linear's qweight and scales in different files."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    for file in awq_checkpoint.iterdir():
        if file.suffix != ".safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    tensors = load_file(awq_checkpoint / "model.safetensors")
    first = {n: t for n, t in tensors.items() if not n.endswith((".scales", ".qzeros"))}
    second = {n: t for n, t in tensors.items() if n not in first}
    save_file(first, folder / "model-00001-of-00002.safetensors")
    save_file(second, folder / "model-00002-of-00002.safetensors")
    index = {"weight_map": {**dict.fromkeys(first, "model-00001-of-00002.safetensors"),
                            **dict.fromkeys(second, "model-00002-of-00002.safetensors")}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    whole = dict(open_model(awq_checkpoint).iterate_weights(torch.float32, progress=False))
    split = dict(open_model(folder).iterate_weights(torch.float32, progress=False))
    assert whole.keys() == split.keys()
    for name, weight in whole.items():
        other = split[name]
        assert torch.equal(dequantize(weight), dequantize(other)) if name.endswith(
            "proj.weight") else torch.equal(weight, other), name


def test_the_flag_takes_the_checkpoint_methods():
    import argparse

    from pdserve.engine.args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for method in ("awq", "gptq", "compressed-tensors", "int8", "gguf"):
        assert parser.parse_args(["--quantization", method]).quantization == method
