"""Chapter 20: Qwen3-MoE through our stack: the config and HF's layer rule, the stacked expert
weights, HF's tokens and logits with both MoE backends (eager, and in emulated CUDA graphs), a
planted bug that the alignment catches, two tensor-parallel ranks over gloo, and the server."""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing as mp
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine.graph import GraphRunner
from minisgl.llm import LLM
from minisgl.models import ModelConfig, create_model, load_hf_config, load_weight
from minisgl.server.args import parse_args

from helpers import fake_gpu_libraries, run_ranks, shell_session
from reference import LOGIT_TOL, assert_aligned, hf_tokenizer
from reference import hf_greedy as _hf_greedy
from serving import Server

MOE = "tiny-qwen3-moe"
PROMPTS = [[5, 80, 200, 31, 7, 99], list(range(40, 75)), [260, 18, 44]]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@functools.cache
def _hf_cached(path: Path, prompt: tuple[int, ...], n: int) -> tuple[list[int], list]:
    return _hf_greedy(path, list(prompt), n)


def hf_greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens and logits, computed once per (model, prompt, n) in this module."""
    return _hf_cached(path, tuple(prompt), n)


def spy_logits(llm: LLM) -> list[torch.Tensor]:
    """Every logits tensor the sampler sees, in order."""
    seen: list[torch.Tensor] = []
    sample = llm.engine.sampler.sample
    llm.engine.sampler.sample = lambda logits, args: (  # type: ignore[method-assign]
        seen.append(logits.detach().float().cpu().clone()) or sample(logits, args))
    return seen


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY
        ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Tokens per prompt, and per prompt the logits of each of its steps."""
    seen = spy_logits(llm)
    tokens = [o["token_ids"] for o in llm.generate(prompts, params)]
    assert all(x.shape[0] == len(prompts) for x in seen)  # one batch all along
    return tokens, [[x[i] for x in seen] for i in range(len(prompts))]


# --- config, layers, weights ------------------------------------------------------------------

def test_config_reads_the_moe_fields(model_dir: Callable[[str], Path]) -> None:
    hf = load_hf_config(model_dir(MOE))
    assert "num_experts" not in hf and hf["num_local_experts"] == 8  # transformers 5's name
    c = ModelConfig.from_hf(hf)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
            c.decoder_sparse_step, c.mlp_only_layers) == (8, 2, 32, True, 1, ())
    assert c.architecture == "Qwen3MoeForCausalLM"
    dense = ModelConfig.from_hf(load_hf_config(model_dir("tiny-qwen3")))
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)


@pytest.mark.parametrize("step,mlp_only", [(1, []), (2, []), (3, [2]), (1, [0, 4])])
def test_which_layers_have_experts_is_hf_rule(step: int, mlp_only: list[int],
                                              model_dir: Callable[[str], Path]) -> None:
    """Our model's layers against HF's own model built from the same config."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_dict = {**load_hf_config(model_dir(MOE)), "num_hidden_layers": 6,
               "decoder_sparse_step": step, "mlp_only_layers": mlp_only}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**hf_dict))
        ours = create_model(ModelConfig.from_hf(hf_dict))
    want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    got = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in ours.model.layers.op_list]
    assert got == want and any(want)


def test_loader_stacks_the_experts_exactly(model_dir: Callable[[str], Path]) -> None:
    path = model_dir(MOE)
    config = ModelConfig.from_hf(load_hf_config(path))
    ours = load_weight(path, torch.device("cpu"), torch.float32)
    with torch.device("meta"):
        names = create_model(config).state_dict()
    assert sorted(ours) == sorted(names)
    assert all(ours[k].shape == names[k].shape for k in ours)
    with safe_open(path / "model.safetensors", "pt") as f:
        for layer in range(config.num_layers):
            mlp = f"model.layers.{layer}.mlp"
            gate_up, down = ours[f"{mlp}.experts.gate_up_proj"], ours[f"{mlp}.experts.down_proj"]
            assert gate_up.shape == (8, 64, 64) and down.shape == (8, 64, 32)
            for e in range(8):
                hf = {p: f.get_tensor(f"{mlp}.experts.{e}.{p}.weight")
                      for p in ("gate_proj", "up_proj", "down_proj")}
                assert torch.equal(gate_up[e], torch.cat([hf["gate_proj"], hf["up_proj"]]))
                assert torch.equal(down[e], hf["down_proj"])
            assert torch.equal(ours[f"{mlp}.gate.weight"], f.get_tensor(f"{mlp}.gate.weight"))


def test_a_missing_expert_tensor_is_named(model_dir: Callable[[str], Path],
                                          tmp_path: Path) -> None:
    shutil.copytree(model_dir(MOE), tmp_path / "m", symlinks=False)
    file = tmp_path / "m" / "model.safetensors"
    weights = load_file(file)
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, file)
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load_weight(tmp_path / "m", torch.device("cpu"), torch.float32)


# --- HF alignment -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_same_tokens_and_logits_as_hf(backend: str, make_llm: Callable,
                                      model_dir: Callable[[str], Path]) -> None:
    """Three prompts in one batch, 16 greedy tokens each, max |Δlogit| <= 1e-3 at every step."""
    path = model_dir(MOE)
    llm = make_llm(path, moe_backend=backend)
    assert type(llm.engine.moe_backend).__name__.lower().startswith(backend)
    tokens, logits = run(llm, PROMPTS)
    for prompt, got, steps in zip(PROMPTS, tokens, logits):
        assert_aligned(got, steps, *hf_greedy(path, prompt, 16))


@pytest.mark.parametrize("arch,cache_type", [
    ("tiny-qwen3", "radix"), ("tiny-llama", "naive"), ("tiny-qwen2", "radix"),
    ("tiny-mistral", "radix")])
def test_dense_models_are_unchanged(arch: str, cache_type: str, make_llm: Callable,
                                    model_dir: Callable[[str], Path],
                                    caplog: pytest.LogCaptureFixture) -> None:
    """This chapter reworked the loader, the config and the MLP hook every model uses: the dense
    architectures still give HF's tokens and logits, and build no MoE backend."""
    path = model_dir(arch)
    with caplog.at_level("INFO"):
        llm = make_llm(path, cache_type=cache_type)
    assert llm.engine.moe_backend is None and "MoE" not in caplog.text
    tokens, logits = run(llm, PROMPTS[:1])
    assert_aligned(tokens[0], logits[0], *hf_greedy(path, PROMPTS[0], 16))


def test_the_shell_with_triton(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """`python -m minisgl --shell --moe-backend triton`: the scheduler process names the backend
    and answers (Triton interpreted on the CPU: TRITON_INTERPRET=1 is inherited)."""
    stderr = shell_session(model_dir(MOE), tmp_path, "--moe-backend", "triton", timeout=180)
    assert "MoE: 8 experts, top 2, the triton backend" in stderr


@pytest.fixture
def gpu_path_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a GPU runs, stood in for on the CPU: our CUDA kernels on their emulator
    (MINISGL_KERNELS=cuda, chapter 19) and the fake FlashInfer / FlashAttention of chapter 17."""
    from minisgl import kernel

    monkeypatch.setenv("MINISGL_KERNELS", "cuda")
    kernel.mode.cache_clear()
    with fake_gpu_libraries(monkeypatch):
        yield
    monkeypatch.delenv("MINISGL_KERNELS")
    kernel.mode.cache_clear()


def test_the_gpu_path_emulated(gpu_path_on_the_cpu: None, make_llm: Callable,
                               model_dir: Callable[[str], Path]) -> None:
    """The triton MoE between our kernels (emulated) and fa,fi (fakes): HF's tokens and logits,
    so the pieces a GPU combines fit together."""
    path = model_dir(MOE)
    llm = make_llm(path, moe_backend="triton", attention_backend="fa,fi")
    tokens, logits = run(llm, PROMPTS[:1])
    assert_aligned(tokens[0], logits[0], *hf_greedy(path, PROMPTS[0], 16))


@pytest.fixture(scope="module")
def mixed_model(model_dir: Callable[[str], Path],
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-qwen3-moe's shape with 3 layers, layer 1 a dense MLP (mlp_only_layers), random
    weights saved by transformers; the tokenizer copied."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    src, out = model_dir(MOE), tmp_path_factory.mktemp("mixed")
    config = {**load_hf_config(src), "num_hidden_layers": 3, "mlp_only_layers": [1]}
    torch.manual_seed(22)  # one whose 16 greedy tokens are not mostly one id (MIN_DISTINCT)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**config)).save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def test_dense_and_expert_layers_mixed(mixed_model: Path, make_llm: Callable) -> None:
    llm = make_llm(mixed_model, moe_backend="triton")
    assert [type(layer.mlp).__name__ for layer in llm.engine.model.model.layers.op_list] == [
        "SparseMoeBlock", "GatedMLP", "SparseMoeBlock"]
    tokens, logits = run(llm, PROMPTS[:1])
    assert_aligned(tokens[0], logits[0], *hf_greedy(mixed_model, PROMPTS[0], 16))


def test_without_renormalisation_the_logits_leave_hf(make_llm: Callable,
                                                     model_dir: Callable[[str], Path]) -> None:
    """A planted bug (norm_topk_prob ignored: the top-2 weights no longer sum to 1) shows that
    the alignment above can fail: already the prefill's logits are off by far more than 1e-3."""
    path = model_dir(MOE)
    llm = make_llm(path, moe_backend="torch")
    for layer in llm.engine.model.model.layers.op_list:
        layer.mlp.experts.renormalize = False
    _, logits = run(llm, PROMPTS[:1], SamplingParams(max_tokens=1))
    _, ref_logits = hf_greedy(path, PROMPTS[0], 16)
    assert float((logits[0][0] - ref_logits[0]).abs().max()) > 100 * LOGIT_TOL


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    replay = GraphRunner.replay

    def spy(self: GraphRunner, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        seen.append(batch.padded_size)
        return replay(self, batch)

    monkeypatch.setattr(GraphRunner, "replay", spy)
    return seen


def test_triton_is_captured_and_torch_turns_graphs_off(
        make_llm: Callable, model_dir: Callable[[str], Path], replays: list[int],
        caplog: pytest.LogCaptureFixture) -> None:
    """Emulated CUDA graphs refuse host reads (chapter 18). The triton backend keeps every value
    on the device, so its decode steps replay and give HF's tokens; the torch backend reads
    per-expert counts on the host, so the engine runs it without graphs and says so."""
    path = model_dir(MOE)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 3, 9)]
    llm = make_llm(path, moe_backend="triton", cuda_graph_max_bs=4)
    tokens = [o["token_ids"] for o in llm.generate(PROMPTS, params)]
    llm.shutdown()
    assert set(replays) == {4, 2, 1}  # 3 requests padded to 4, then 2, then 1
    assert tokens == [hf_greedy(path, p, n.max_tokens)[0] for p, n in zip(PROMPTS, params)]
    replays.clear()
    llm = make_llm(path, moe_backend="torch", cuda_graph_max_bs=4)
    assert llm.engine.graph_runner.sizes == []
    assert "graphs off: the TorchMoeBackend cannot be captured" in caplog.text
    assert [o["token_ids"] for o in llm.generate(PROMPTS, params)] == tokens and not replays


# --- tensor parallelism -----------------------------------------------------------------------

def _generate(path: str, tp: DistributedInfo, rendezvous: str, backend: str
              ) -> tuple[list[list[int]], list[torch.Tensor]]:
    llm = LLM(path, dtype=torch.float32, num_page_override=512, tp_info=tp,
              dist_init=rendezvous, moe_backend=backend)
    try:
        tokens, logits = run(llm, PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
        return tokens, [torch.stack(steps) for steps in logits]
    finally:
        llm.shutdown()


def _rank(rank: int, size: int, rendezvous: str, path: str, backend: str,
          out: mp.Queue) -> None:
    tokens, logits = _generate(path, DistributedInfo(rank, size), rendezvous, backend)
    out.put((rank, tokens, [x.tolist() for x in logits]))


def test_tp2_gives_the_tokens_of_one_rank(tmp_path: Path,
                                          model_dir: Callable[[str], Path]) -> None:
    """Each rank holds half of every expert's intermediate columns (16 of 32) and all of the
    router; the layer's partial outputs are all-reduced over gloo. The torch backend: the
    sharding is the layer's and the loader's, the same for both backends (the triton kernel on
    a rank's narrower weights runs in test_ch20_moe.py's shapes; a TP run of it takes ~25 s)."""
    backend = "torch"
    path = model_dir(MOE)
    results, _ = run_ranks(_rank, 2, tmp_path, str(path), backend)
    one_tokens, one_logits = _generate(str(path), DistributedInfo(0, 1), "", backend)
    assert one_tokens == [hf_greedy(path, p, 8)[0] for p in PROMPTS]
    for _, tokens, logits in results:
        assert tokens == one_tokens
        for a, b in zip(logits, one_logits):
            assert (torch.tensor(a) - b).abs().max() <= 1e-4


def test_tp_splits_the_experts_not_the_router(model_dir: Callable[[str], Path]) -> None:
    from minisgl.distributed.shard import local_config, shard_of

    config = ModelConfig.from_hf(load_hf_config(model_dir(MOE)))
    tp = DistributedInfo(1, 2)
    local = local_config(config, tp)
    assert (local.moe_intermediate_size, local.num_experts) == (16, 8)
    layer = "model.layers.0.mlp"
    assert dataclasses.astuple(shard_of(f"{layer}.experts.3.up_proj.weight", config, tp)) == (
        0, 16, 32, 16)
    assert dataclasses.astuple(shard_of(f"{layer}.experts.3.down_proj.weight", config, tp)) == (
        1, 16, 32, 16)
    assert shard_of(f"{layer}.gate.weight", config, tp).dim is None
    # every layer has experts: the dense intermediate_size is never used, so never checked
    odd = dataclasses.replace(config, intermediate_size=130, moe_intermediate_size=30)
    with pytest.raises(ValueError, match="moe_intermediate_size = 30 does not divide by tp = 4"):
        local_config(odd, DistributedInfo(0, 4))
    assert local_config(dataclasses.replace(odd, moe_intermediate_size=32),
                        DistributedInfo(0, 4)).intermediate_size == 130


# --- the server -------------------------------------------------------------------------------

def test_moe_backend_flag(model_dir: Callable[[str], Path]) -> None:
    model = ["--model", str(model_dir(MOE))]
    assert parse_args(model).scheduler.moe_backend == "auto"
    assert parse_args([*model, "--moe-backend", "triton"]).scheduler.moe_backend == "triton"
    with pytest.raises(SystemExit) as e:
        parse_args([*model, "--moe-backend", "cutlass"])
    assert e.value.code == 2


@pytest.fixture(scope="module")
def server(model_dir: Callable[[str], Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(model_dir(MOE), tmp_path_factory.mktemp("moe-server"), "--moe-backend", "triton")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_the_server_answers_with_hf_greedy_text(server: Server,
                                                model_dir: Callable[[str], Path]) -> None:
    path = model_dir(MOE)
    status, raw = server.request("POST", "/generate", {"prompt": PROMPTS[0], "max_tokens": 12,
                                                       "ignore_eos": True})
    assert status == 200, raw
    want = hf_tokenizer(path).decode(hf_greedy(path, PROMPTS[0], 12)[0], skip_special_tokens=True)
    assert json.loads(raw)["text"] == want and want.strip()
    assert "8 experts, top 2, the triton backend" in server.log.read_text()
