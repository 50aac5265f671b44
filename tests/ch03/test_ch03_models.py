"""Chapter 3: ModelConfig, the model registry, weight loading, all architectures equal to HF."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minisgl.core import Context, get_global_ctx, set_global_ctx
from minisgl.layers import BaseOP
from minisgl.models import (
    BaseLLMModel,
    ModelConfig,
    create_model,
    get_model_class,
    load_hf_config,
    load_weight,
)
from minisgl.models.weight import read_safetensors

from conftest import chapter_module
from helpers import Recorder
from reference import assert_aligned, hf_greedy, hf_tokenizer

skeleton = chapter_module("ch03_models", "skeleton")

TINY = ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"]
SMOLLM2 = "SmolLM2-135M-Instruct"
ARCHS = {"tiny-qwen3": "Qwen3ForCausalLM", "tiny-llama": "LlamaForCausalLM",
         "tiny-qwen2": "Qwen2ForCausalLM", "tiny-mistral": "MistralForCausalLM",
         SMOLLM2: "LlamaForCausalLM"}
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def hf_json(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, read by the safetensors library."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.fixture
def ctx() -> Iterator[Context]:
    """A global Context with the skeleton's naive cache and backend; removed afterwards."""
    set_global_ctx(Context(page_size=1))
    try:
        skeleton.install_naive_attention()
        yield get_global_ctx()
    finally:
        set_global_ctx(None)


# --- ModelConfig ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*TINY, SMOLLM2])
def test_config_from_hf_reads_config_json(name: str, model_dir) -> None:
    raw = hf_json(model_dir(name))
    config = ModelConfig.from_hf(load_hf_config(model_dir(name)))
    heads = raw["num_attention_heads"]
    assert config.architecture == raw["architectures"][0] == ARCHS[name]
    assert config.num_layers == raw["num_hidden_layers"]
    assert config.hidden_size == raw["hidden_size"]
    assert config.intermediate_size == raw["intermediate_size"]
    assert config.vocab_size == raw["vocab_size"]
    assert config.num_qo_heads == heads
    assert config.num_kv_heads == raw["num_key_value_heads"]
    assert config.head_dim == raw.get("head_dim", raw["hidden_size"] // heads)
    assert config.rope_theta == raw["rope_parameters"]["rope_theta"]
    assert config.tie_word_embeddings == raw["tie_word_embeddings"]
    assert config.rms_norm_eps == raw["rms_norm_eps"]
    assert config.max_position == raw["max_position_embeddings"]
    assert config.attention_bias is False


def test_head_dim_explicit_or_derived(model_dir) -> None:
    """Qwen3's head_dim (32) is not hidden / heads (16); Qwen2's config omits it."""
    qwen3 = ModelConfig.from_hf(load_hf_config(model_dir("tiny-qwen3")))
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_qo_heads
    raw = hf_json(model_dir("tiny-qwen2"))
    assert "head_dim" not in raw
    assert ModelConfig.from_hf(raw).head_dim == raw["hidden_size"] // raw["num_attention_heads"]
    assert ModelConfig.from_hf(raw).rope_theta == 1e6  # from rope_parameters, not the default


@pytest.mark.parametrize("change", [
    {"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}},
    {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"hidden_act": "gelu"},
    {"sliding_window": 4096},
    {"sliding_window": 4096, "use_sliding_window": True},
], ids=["yarn", "linear-legacy", "gelu", "mistral-window", "qwen-window"])
def test_config_refuses_what_it_cannot_run(change: dict[str, Any], model_dir) -> None:
    raw = {**hf_json(model_dir("tiny-mistral")), **change}
    with pytest.raises(NotImplementedError):
        ModelConfig.from_hf(raw)


def test_config_accepts_a_disabled_window(model_dir) -> None:
    raw = {**hf_json(model_dir("tiny-qwen2")), "sliding_window": 4096}
    assert raw["use_sliding_window"] is False
    assert ModelConfig.from_hf(raw).architecture == "Qwen2ForCausalLM"


def test_missing_folder_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tools/models.py"):
        load_hf_config(tmp_path / "nope")


# --- registry and building --------------------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(set(ARCHS.values())))
def test_registry_maps_architecture_to_class(arch: str) -> None:
    cls = get_model_class(arch)
    assert cls.__name__ == arch and issubclass(cls, BaseLLMModel)
    assert cls.__module__ == f"minisgl.models.{arch.removesuffix('ForCausalLM').lower()}"


def test_unknown_architecture_lists_the_supported_ones(model_dir) -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        get_model_class("GPT2LMHeadModel")
    for arch in set(ARCHS.values()):
        assert arch in str(err.value)
    # a real config whose architecture is not ours (Qwen3-MoE was one until chapter 20)
    other = {**load_hf_config(model_dir("tiny-qwen3")), "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ValueError, match="MixtralForCausalLM") as err:
        create_model(ModelConfig.from_hf(other))
    assert "Qwen3ForCausalLM" in str(err.value)


@pytest.mark.parametrize("name", TINY)
def test_meta_build_allocates_nothing_and_names_match(name: str, model_dir) -> None:
    path = model_dir(name)
    config = ModelConfig.from_hf(load_hf_config(path))
    with torch.device("meta"):
        model = create_model(config)
    assert type(model).__name__ == ARCHS[name]
    params = model.state_dict()
    assert params and all(t.device.type == "meta" for t in params.values())
    weights = load_weight(path, torch.device("cpu"), torch.float32, config.tie_word_embeddings)
    assert sorted(params) == sorted(weights)
    for key, tensor in weights.items():
        assert params[key].shape == tensor.shape, key


# --- weights ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY)
def test_load_weight_merges_exactly(name: str, model_dir) -> None:
    path = model_dir(name)
    config = ModelConfig.from_hf(load_hf_config(path))
    ref = checkpoint(path)
    ours = load_weight(path, torch.device("cpu"), torch.float32, config.tie_word_embeddings)
    expected: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        kinds = ["weight", "bias"] if name == "tiny-qwen2" else ["weight"]
        for kind in kinds:
            expected[f"{attn}.qkv_proj.{kind}"] = torch.cat(
                [ref.pop(f"{attn}.{p}.{kind}") for p in ("q_proj", "k_proj", "v_proj")])
        expected[f"{mlp}.gate_up_proj.weight"] = torch.cat(
            [ref.pop(f"{mlp}.gate_proj.weight"), ref.pop(f"{mlp}.up_proj.weight")])
    expected.update(ref)  # everything else passes through under its own name
    assert sorted(ours) == sorted(expected)
    for key, tensor in expected.items():
        assert ours[key].dtype == torch.float32 and torch.equal(ours[key], tensor), key
    assert ("lm_head.weight" in ours) == (not config.tie_word_embeddings)
    q_rows = config.num_qo_heads * config.head_dim
    assert ours["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == \
        q_rows + 2 * config.num_kv_heads * config.head_dim


def test_qwen2_biases_are_merged(model_dir) -> None:
    path = model_dir("tiny-qwen2")
    ours = load_weight(path, torch.device("cpu"), torch.float32)
    with safe_open(path / "model.safetensors", "pt") as f:
        parts = [f.get_tensor(f"model.layers.1.self_attn.{p}_proj.bias") for p in "qkv"]
    assert torch.equal(ours["model.layers.1.self_attn.qkv_proj.bias"], torch.cat(parts))


def test_tied_checkpoint_gives_no_lm_head(model_dir, tmp_path: Path) -> None:
    """Even when a tied checkpoint stores lm_head.weight, the loader drops it."""
    src = model_dir("tiny-qwen3")
    tensors = checkpoint(src)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in load_weight(tmp_path, torch.device("cpu"), torch.float32, True)
    assert "lm_head.weight" in load_weight(tmp_path, torch.device("cpu"), torch.float32, False)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_dtype_and_device_are_honoured(device: str, model_dir) -> None:
    path = model_dir("tiny-llama")
    ours = load_weight(path, torch.device(device), torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and t.device.type == device for t in ours.values())
    if device == "cpu":
        ref = checkpoint(path)
        assert torch.equal(ours["model.norm.weight"], ref["model.norm.weight"].bfloat16())
        assert torch.equal(ours["model.layers.0.mlp.gate_up_proj.weight"], torch.cat(
            [ref["model.layers.0.mlp.gate_proj.weight"],
             ref["model.layers.0.mlp.up_proj.weight"]]).bfloat16())


def without(src: Path, dst: Path, name: str) -> Path:
    """A copy of the model folder `src` whose checkpoint lacks the tensor `name`."""
    tensors = checkpoint(src)
    del tensors[name]
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight",
                                  "model.layers.0.mlp.up_proj.weight",
                                  "model.layers.0.self_attn.q_proj.bias"])
def test_missing_merged_part_is_named(name: str, model_dir, tmp_path: Path) -> None:
    path = without(model_dir("tiny-qwen2"), tmp_path, name)
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        load_weight(path, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("name", ["model.norm.weight", "lm_head.weight"])
def test_missing_plain_tensor_is_named_when_loading(name: str, model_dir, tmp_path: Path) -> None:
    path = without(model_dir("tiny-llama"), tmp_path, name)
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        skeleton.load_model(path)


@pytest.mark.parametrize("name", TINY)
def test_read_safetensors_agrees_with_safe_open(name: str, model_dir) -> None:
    file = model_dir(name) / "model.safetensors"
    ours = dict(read_safetensors(file))
    with safe_open(file, "pt") as f:
        assert sorted(ours) == sorted(f.keys())
        for key in f.keys():
            ref = f.get_tensor(key)
            assert ours[key].dtype == ref.dtype and torch.equal(ours[key], ref), key


def test_read_safetensors_dtypes_and_shapes(tmp_path: Path) -> None:
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5, 2).bfloat16(),
        "f16": torch.randn(7).half(),
        "f64": torch.randn(2, 2, 2, dtype=torch.float64),
        "i64": torch.arange(-5, 5),
        "i32": torch.arange(6, dtype=torch.int32).view(2, 3),
        "u8": torch.arange(9, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    file = tmp_path / "mixed.safetensors"
    save_file(tensors, str(file), metadata={"format": "pt"})
    ours = dict(read_safetensors(file))
    assert sorted(ours) == sorted(tensors)
    with safe_open(file, "pt") as f:
        for key in tensors:
            ref = f.get_tensor(key)
            assert ours[key].dtype == ref.dtype and ours[key].shape == ref.shape, key
            assert torch.equal(ours[key], ref), key


def test_load_state_dict_complains_about_leftovers_and_gaps(model_dir) -> None:
    path = model_dir("tiny-llama")
    config = ModelConfig.from_hf(load_hf_config(path))

    def fresh() -> BaseLLMModel:
        with torch.device("meta"):
            return create_model(config)

    weights = load_weight(path, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="model.layers.9.extra"):
        fresh().load_state_dict({**weights, "model.layers.9.extra": torch.zeros(1)})
    gap = dict(weights)
    del gap["model.layers.1.self_attn.qkv_proj.weight"]
    with pytest.raises(KeyError, match="qkv_proj"):
        fresh().load_state_dict(gap)
    bad = {**weights, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        fresh().load_state_dict(bad)
    model = fresh()
    model.load_state_dict(dict(weights))
    loaded = model.state_dict()
    assert all(t.device.type == "cpu" for t in loaded.values())
    assert all(loaded[k] is weights[k] for k in weights)  # placeholders replaced, no copies
    assert isinstance(model, BaseOP)


# --- end to end -------------------------------------------------------------------------------

def generate(model: BaseLLMModel, prompts: list[list[int]],
             n: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """skeleton.generate, plus every request's logits at every step."""
    recorder = Recorder(model)
    tokens = skeleton.generate(recorder, prompts, n)
    assert [x.shape[0] for x in recorder.logits] == [len(prompts)] * n  # one row per request
    return tokens, [[x[i] for x in recorder.logits] for i in range(len(prompts))]


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_equal_hf(name: str, model_dir, ctx: Context) -> None:
    """Two prompts of different lengths in one batch; each equals HF, logits at every step."""
    path = model_dir(name)
    prompts = [hf_tokenizer(path)(p)["input_ids"] for p in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])
    tokens, logits = generate(skeleton.load_model(path), prompts, 16)
    for ids, ours, seen in zip(prompts, tokens, logits):
        assert_aligned(ours, seen, *hf_greedy(path, ids, 16))


def test_smollm2_equals_hf(model_dir, ctx: Context) -> None:
    path = model_dir(SMOLLM2)
    ids = hf_tokenizer(path)(PROMPTS[0])["input_ids"]
    tokens, logits = generate(skeleton.load_model(path), [ids], 16)
    assert_aligned(tokens[0], logits[0], *hf_greedy(path, ids, 16))


def test_bfloat16_model_runs(model_dir, ctx: Context) -> None:
    """Built with bfloat16 as the default dtype, the model takes load_weight's bfloat16
    tensors as they are and computes in bfloat16 (what chapter 6's Engine does)."""
    path = model_dir("tiny-llama")
    model = skeleton.load_model(path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict().values())
    assert torch.get_default_dtype() == torch.float32  # restored afterwards
    ids = hf_tokenizer(path)(PROMPTS[0])["input_ids"]
    tokens, logits = generate(model, [ids], 4)
    assert logits[0][0].dtype == torch.bfloat16 and len(tokens[0]) == 4
