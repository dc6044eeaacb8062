"""Multi-LoRA serving holds the oracle: greedy float32 output token for token that of transformers + peft with the same
adapter, for four random peft adapters (different ranks and targets, one rsLoRA, one on q/k/v only, one with
per-module ranks and alphas) in one batch
with base-model requests, through the engine process; also under chunked prefill and forced preemption, with fewer
adapter slots than adapters (max_loras=2), in the test process, where the CPU graphs of steps with adapters are
seen. The prefix cache keeps adapters apart; adapters that do not fit the base model are a ValueError naming the
problem, and the engine serves on."""
from __future__ import annotations

import copy
import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LoRARequest, SamplingParams
from tests.e2e.conftest import assert_transformers_greedy, hf_greedy, in_process_llm, running_llm
from pagedllm.sampling_params import BeamSearchParams
from tests.e2e.test_beam_search import BEAM_WIDTH, hf_beam_search
from tests.e2e.test_llm_parity import make_prompts

peft = pytest.importorskip("peft")

ADAPTERS = {  # name -> peft LoraConfig settings
    "all-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"]),
    "rslora-r16": dict(r=16, lora_alpha=32, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"]),
    "qkv-r4": dict(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"]),
    # per-module ranks and alphas: o_proj's rank, layer 1's q_proj's rank, down_proj's alpha
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"],
                     rank_pattern={"o_proj": 8, "model.layers.1.self_attn.q_proj": 12},
                     alpha_pattern={"down_proj": 24}),
}
EMBEDDING_ADAPTERS = {  # name -> peft LoraConfig settings, on the token embedding and the LM head
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "embed": dict(r=8, lora_alpha=16, target_modules=["embed_tokens"]),
    "head": dict(r=4, lora_alpha=32, target_modules=["lm_head"]),
    "both-qv": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"]),
}
ENGINE = dict(dtype="float32", max_model_len=1024, enable_lora=True, max_loras=2, max_lora_rank=16)
MAX_TOKENS = 24


def _random_adapter(hf_model, settings: dict, seed: int, path) -> torch.nn.Module:
    """A peft model of the reference with random A and B (init_lora_weights=False), saved to ``path``."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model),
                                peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **settings))
    with torch.no_grad():  # B's default, U(+-1/sqrt(r)), swamps the base model; scaled, it changes its output
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.mul_(0.25)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    """name -> (LoRARequest, its transformers + peft model)."""
    made = {}
    for i, (name, settings) in enumerate(ADAPTERS.items()):
        path = tmp_path_factory.mktemp(name)
        made[name] = (LoRARequest(name, i + 1, str(path)), _random_adapter(hf_model, settings, i, path))
    return made


@pytest.fixture(scope="module")
def batch(tokenizer, adapters, hf_model):
    """8 prompts of 5 to 400 tokens, each for the base model or one of the adapters (each adapter twice)."""
    prompts = make_prompts(tokenizer)
    names = [None, "all-r8", "rslora-r16", "qkv-r4", "patterns", None, "qkv-r4", "rslora-r16"]
    requests = [adapters[n][0] if n else None for n in names]
    oracles = [adapters[n][1] if n else hf_model for n in names]
    return prompts, requests, oracles


def run(llm, prompts, lora_requests) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=lora_requests)
    return [o.outputs[0].token_ids for o in outputs]


def assert_each_is_its_models_greedy(batch, outputs) -> None:
    prompts, _, oracles = batch
    for prompt, oracle, got in zip(prompts, oracles, outputs):
        assert_transformers_greedy(oracle, [prompt], [got], MAX_TOKENS)


@pytest.fixture(scope="module")
def llm_with_lora():
    with running_llm(**ENGINE) as engine:
        yield engine


def test_mixed_batch_equals_transformers_with_peft(llm_with_lora, batch):
    prompts, requests, _ = batch
    outputs = run(llm_with_lora, prompts, requests)
    base = run(llm_with_lora, prompts, None)
    assert_each_is_its_models_greedy(batch, outputs)
    # Every adapter changed its requests' output (the test would not see a dropped adapter otherwise).
    for i, request in enumerate(requests):
        assert (outputs[i] == base[i]) == (request is None), f"prompt {i}"


def test_each_output_names_the_adapter_it_ran_with(llm_with_lora, adapters):
    """vLLM's RequestOutput.lora_request: the request's adapter, None for the base model (n > 1 requests too)."""
    request = adapters["qkv-r4"][0]
    outputs = llm_with_lora.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(max_tokens=2, n=2),
                                     use_tqdm=False, lora_request=[request, None])
    assert [output.lora_request for output in outputs] == [request, None]


def test_chunked_prefill_preemption_and_cpu_graphs(monkeypatch, batch):
    """64-token chunks and 36 blocks of 16 for a batch that needs 77, longest prompts first (the two longest
    alone need 44): requests admitted once their whole prompts fit outgrow the pool with their outputs, and
    preempted adapter requests recompute with their adapter. And decode steps with adapters replay
    graphs captured with the LoRA kernels, each row's slot an input. In the test process, to see the graphs."""
    from pagedllm import native
    from pagedllm.native.graph import CpuGraph

    replays, replay = [], CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: replays.append(self) or replay(self))
    prompts, requests, oracles = (list(reversed(items)) for items in batch)
    llm = in_process_llm(**ENGINE, max_num_batched_tokens=64, num_kv_blocks=36)
    outputs = run(llm, prompts, requests)
    assert llm.get_stats().num_preemptions > 0
    assert_each_is_its_models_greedy((prompts, requests, oracles), outputs)
    if native.gemm() is None or native.lora() is None:
        pytest.skip("no native GEMM or LoRA kernel here: every step ran eagerly (outputs checked)")
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.step_graphs
    assert any(lora for static in graphs._by_shape.values() for _, lora in static.graphs) and not graphs._refused
    assert len(replays) >= MAX_TOKENS // 2


def test_prefix_cache_shares_blocks_within_an_adapter_only(llm_with_lora, adapters):
    prompt = [list(range(1000, 1260))]  # 16 full blocks of tokens no other test of the engine prompts
    first, second = adapters["all-r8"][0], adapters["qkv-r4"][0]
    llm = llm_with_lora
    run(llm, prompt, first)
    hits = llm.get_stats().prefix_cache_hits
    run(llm, prompt, second)
    run(llm, prompt, None)
    assert llm.get_stats().prefix_cache_hits == hits, "another adapter or the base model hit the first's blocks"
    run(llm, prompt, first)
    assert llm.get_stats().prefix_cache_hits > hits


def _write_adapter(path, config: dict, tensors: dict) -> str:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"], **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


@pytest.mark.parametrize("config, tensors, message", [
    ({"r": 32}, {}, r"rank r=32 exceeds max_lora_rank=16"),
    ({"rank_pattern": {"k_proj": 32}}, {}, r"rank_pattern\['k_proj'\]=32 exceeds max_lora_rank=16"),
    ({"alpha_pattern": {"q_proj": "8"}}, {}, r"alpha_pattern must map module names to finite numbers"),
    ({"rank_pattern": {"q_proj": 8}}, {}, r"q_proj has A \(4, 576\) and B \(576, 4\); the base model needs A "
                                         r"\(8, 576\)"),
    ({"use_dora": True}, {}, r"DoRA"),
    ({"modules_to_save": ["lm_head"]}, {}, r"modules_to_save"),
    # PEFT variants whose saved A and B are not all there is to them (vLLM refuses them too)
    ({"init_lora_weights": "pissa"}, {}, r"init_lora_weights='pissa': an init that changes the base weights"),
    ({"alora_invocation_tokens": [1, 2]}, {}, r"alora_invocation_tokens: activated LoRA"),
    ({"layer_replication": [[0, 20], [10, 30]]}, {}, r"layer_replication"),
    ({"target_modules": 5}, {}, r"target_modules must be a module name pattern or a list of module names, got 5"),
    ({}, {Q_PROJ.format("A"): torch.zeros(4, 100), Q_PROJ.format("B"): torch.zeros(576, 4)},
     r"q_proj has A \(4, 100\) and B \(576, 4\); the base model needs A \(4, 576\)"),
    ({}, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 576)}, r"lm_head has lora_A without its pair"),
    ({}, {"base_model.model.model.norm.lora_A.weight": torch.zeros(4, 576)}, r"'base_model.model.model.norm.lora_A"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 100),
          "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(576, 4)},
     r"embed_tokens has A \(4, 100\) and B \(576, 4\); the base model needs A \(4, 49152\)"),
    ({}, {Q_PROJ.format("A").replace("layers.0", "layers.30"): torch.zeros(4, 576)}, r"layer 30; the base model "
                                                                                     r"has 30"),
])
def test_an_adapter_that_does_not_fit_is_a_value_error(llm_with_lora, tmp_path, config, tensors, message):
    good = {Q_PROJ.format("A"): torch.zeros(4, 576), Q_PROJ.format("B"): torch.zeros(576, 4)}
    path = _write_adapter(tmp_path / "bad", config, tensors or good)
    with pytest.raises(ValueError, match=message):
        run(llm_with_lora, [[1, 2, 3]], LoRARequest("bad", 9, path))
    assert len(run(llm_with_lora, [[1, 2, 3]], None)[0]) == MAX_TOKENS  # the engine serves on


def test_an_adapter_saved_as_a_torch_pickle_serves_as_its_safetensors_does(llm_with_lora, adapters, tmp_path):
    """peft's save_pretrained(safe_serialization=False) writes adapter_model.bin: vLLM loads it (torch.load with
    weights_only=True), so pagedllm does, to the same tokens as the same adapter's safetensors."""
    request, peft_model = adapters["all-r8"]
    peft_model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    assert (tmp_path / "pickled" / "adapter_model.bin").is_file()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    pickled = LoRARequest("pickled", 90, str(tmp_path / "pickled"))
    assert run(llm_with_lora, prompts, pickled) == run(llm_with_lora, prompts, request)
    for content in (b"", b"\x80\x04not a pickle"):
        (tmp_path / "pickled" / "adapter_model.bin").write_bytes(content)
        with pytest.raises(ValueError, match="adapter_model.bin cannot be read"):
            run(llm_with_lora, [[1, 2, 3]], LoRARequest("broken", 91, str(tmp_path / "pickled")))
    for lora_int_id, content in enumerate(([torch.zeros(2)], {0: torch.zeros(2)}), start=92):
        torch.save(content, tmp_path / "pickled" / "adapter_model.bin")
        with pytest.raises(ValueError, match=f"adapter_model.bin holds {type(content).__name__}, not a dict of "
                                             "tensors by name"):
            run(llm_with_lora, [[1, 2, 3]], LoRARequest(f"listed{lora_int_id}", lora_int_id,
                                                        str(tmp_path / "pickled")))


def test_tensor_names_without_pefts_prefix_serve_as_peft_names_them(llm_with_lora, adapters, tmp_path):
    """vLLM takes an adapter whose tensors lack peft's "base_model.model." (parse_fine_tuned_lora_name), as some
    trainers and converters save them: the same adapter either way gives the same tokens."""
    from safetensors.torch import load_file

    request, _ = adapters["patterns"]
    shutil.copytree(request.lora_path, tmp_path / "bare")
    weights = tmp_path / "bare" / "adapter_model.safetensors"
    save_file({name.removeprefix("base_model.model."): t for name, t in load_file(weights).items()}, str(weights))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    assert run(llm_with_lora, prompts, LoRARequest("bare", 95, str(tmp_path / "bare"))) == \
        run(llm_with_lora, prompts, request)


def test_missing_files_are_value_errors(llm_with_lora, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        run(llm_with_lora, [[1, 2, 3]], LoRARequest("gone", 9, str(tmp_path / "gone")))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    with pytest.raises(ValueError, match="has no weights"):
        run(llm_with_lora, [[1, 2, 3]], LoRARequest("empty", 9, str(tmp_path / "empty")))
    (tmp_path / "list").mkdir()  # JSON, but no object of settings
    (tmp_path / "list" / "adapter_config.json").write_text("[4, 8]")
    (tmp_path / "list" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="holds list, not an object"):
        run(llm_with_lora, [[1, 2, 3]], LoRARequest("list", 9, str(tmp_path / "list")))
    (tmp_path / "list" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (tmp_path / "list" / "adapter_model.safetensors").write_bytes(b"\xff" * 64)  # no safetensors header
    with pytest.raises(ValueError, match="adapter_model.safetensors cannot be read"):
        run(llm_with_lora, [[1, 2, 3]], LoRARequest("list", 9, str(tmp_path / "list")))


def test_an_adapter_on_the_mlp_of_a_mixture_of_experts_layer_is_a_value_error(tmp_path):
    """A dense model's adapter fits a mixture of experts of its shapes (Mistral 7B's fits Mixtral 8x7B) but for the
    MLP projections, which such a layer has none of: the check refuses it (the worker would skip those tensors, and
    serve the attention part alone), as vLLM refuses modules the model lacks. A Qwen MoE model's dense layers
    (mlp_only_layers) take one."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    from pagedllm.lora.lora_model import check_local_checkpoint

    shapes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2)
    gate = "base_model.model.model.layers.{}.mlp.gate_proj.lora_{}.weight"
    for layer in (0, 2):
        tensors = {gate.format(layer, "A"): torch.zeros(4, 64), gate.format(layer, "B"): torch.zeros(128, 4),
                   Q_PROJ.format("A"): torch.zeros(4, 64), Q_PROJ.format("B"): torch.zeros(64, 4)}
        path = _write_adapter(tmp_path / f"layer{layer}", {"target_modules": ["q_proj", "gate_proj"]}, tensors)
        with pytest.raises(ValueError, match=rf"layer {layer}'s MLP; the base model's is a mixture of experts"):
            check_local_checkpoint(path, MixtralConfig(num_local_experts=4, **shapes), 16)
        qwen2_moe = Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32, mlp_only_layers=[2], **shapes)
        if layer == 2:
            assert len(check_local_checkpoint(path, qwen2_moe, 16)[1]) == 2
        else:
            with pytest.raises(ValueError, match=r"layer 0's MLP; the base model's is a mixture of experts"):
                check_local_checkpoint(path, qwen2_moe, 16)


def test_a_lora_path_may_start_with_a_tilde(tmp_path, monkeypatch):
    """As vLLM's (get_adapter_absolute_path), a leading ~ is the home directory, for the frontend's check and the
    worker's load alike (a path in --lora-modules' JSON form, or in a load request, is no shell's to expand)."""
    from transformers import LlamaConfig

    from pagedllm.lora.lora_model import LoRAModel, check_local_checkpoint

    monkeypatch.setenv("HOME", str(tmp_path))
    _write_adapter(tmp_path / "sql", {}, {Q_PROJ.format("A"): torch.ones(4, 64), Q_PROJ.format("B"): torch.ones(64, 4)})
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    assert list(check_local_checkpoint("~/sql", config, 16)[1]) == [(0, "self_attn.q_proj")]
    model = LoRAModel.from_local_checkpoint("~/sql", 1, config, 16)
    [(a, b), *_] = model.layers["model.layers.0.self_attn.qkv_proj"].slices
    assert torch.equal(a, torch.ones(4, 64)) and torch.equal(b, torch.full((64, 4), 2.0))  # scaled by alpha / r


def test_an_adapter_id_may_be_any_positive_integer(llm_with_lora, adapters):
    """Ids are names, not indices (a step maps each token's id to its slot without a table indexed by them)."""
    first = adapters["all-r8"][0]
    prompt = [list(range(2000, 2040))]
    assert run(llm_with_lora, prompt, LoRARequest("all-r8, again", 10 ** 13, first.lora_path)) == \
        run(llm_with_lora, prompt, first)


def test_load_inplace_reloads_an_adapter_under_its_id(llm_with_lora, adapters):
    """vLLM's LoRARequest.load_inplace: the id's adapter is read again from the request's path and replaces the one
    loaded, whose id would otherwise keep it (another path under a loaded id, without it, is a ValueError). A
    request naming the path the id had before (made before the reload: the server's, running) runs with the new
    weights, as vLLM's keyed by id. A prompt shorter than a block, so that no cached KV plays a part."""
    prompt = [list(range(3000, 3010))]
    (first, _), (second, second_model) = adapters["all-r8"], adapters["qkv-r4"]
    run(llm_with_lora, prompt, LoRARequest("swapped", 60, first.lora_path))
    with pytest.raises(ValueError, match="lora_int_id 60 already names adapter 'swapped'"):
        run(llm_with_lora, prompt, LoRARequest("swapped", 60, second.lora_path))
    swapped = run(llm_with_lora, prompt, LoRARequest("swapped", 60, second.lora_path, load_inplace=True))
    assert_transformers_greedy(second_model, prompt, swapped, MAX_TOKENS)
    assert run(llm_with_lora, prompt, LoRARequest("swapped", 60, second.lora_path)) == swapped
    assert run(llm_with_lora, prompt, LoRARequest("swapped", 60, first.lora_path)) == swapped
    with pytest.raises(ValueError, match="load_inplace must be a bool, got 1"):
        LoRARequest("swapped", 60, second.lora_path, load_inplace=1)


def test_prefix_cache_keys_an_adapter_by_its_name_and_path(llm_with_lora, adapters):
    """vLLM's block hashes name an adapter by its name and path, not its id: an id reloaded from another path serves
    none of the KV its old adapter computed (which made its output the old adapter's, not transformers + peft's
    with the new one), and the same adapter under a new id (an unloaded adapter loaded again) shares its blocks."""
    prompt = [list(range(4000, 4040))]  # 2 full blocks of tokens no other test of the engine prompts
    (first, _), (second, second_model) = adapters["all-r8"], adapters["qkv-r4"]
    run(llm_with_lora, prompt, LoRARequest("reloaded", 70, first.lora_path))
    hits = llm_with_lora.get_stats().prefix_cache_hits
    reloaded = run(llm_with_lora, prompt, LoRARequest("reloaded", 70, second.lora_path, load_inplace=True))
    assert llm_with_lora.get_stats().prefix_cache_hits == hits
    assert_transformers_greedy(second_model, prompt, reloaded, MAX_TOKENS)
    assert run(llm_with_lora, prompt, LoRARequest("reloaded", 71, second.lora_path)) == reloaded
    assert llm_with_lora.get_stats().prefix_cache_hits > hits


@pytest.mark.parametrize("args, message", [
    (("a", 2**63, "/a"), r"lora_int_id must be an integer from 1 to 2\*\*63 - 1, got 9223372036854775808"),
    (("a", 0, "/a"), r"lora_int_id must be an integer from 1 to 2\*\*63 - 1, got 0"),
    ((7, 1, "/a"), r"lora_name must be a non-empty string, got 7"),
    (("a", 1, pathlib.Path("/a")), r"lora_path must be a string naming the adapter's directory \(adapter 'a'\), got "
                                   r"PosixPath"),
    (("a", 1, "/a", 3), r"base_model_name must be a string or None, got 3"),
])
def test_a_lora_request_the_engine_process_could_not_read_is_a_value_error(args, message):
    """Its fields are checked as the engine process decodes them (a str, an int64 id): an int name, say, got as far
    as the engine, which could not decode it and ended; an id past int64 ended it at its first step."""
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


def test_lora_requests_are_one_adapter_by_name_and_their_fields_may_be_set():
    """As vLLM's LoRARequest: equal to (and hashed as) any of the same lora_name, whatever its id or path, with
    vLLM's name and path properties; its fields may be set after it is made (vLLM's server sets base_model_name)."""
    first, again = LoRARequest("sql", 1, "/a"), LoRARequest("sql", 2, "/b", "base")
    assert first == again and hash(first) == hash(again) and len({first, again}) == 1
    assert first != LoRARequest("chat", 1, "/a") and first != "sql"
    first.base_model_name = "served-base"
    assert (first.name, first.path, first.base_model_name) == ("sql", "/a", "served-base")
    # vLLM's flag for MoE adapters' fused layouts, read only under its enable_mixed_moe_lora_format: taken
    assert LoRARequest("moe", 3, "/m", is_3d_lora_weight=True).is_3d_lora_weight
    with pytest.raises(ValueError, match="is_3d_lora_weight must be a bool, got 'yes'"):
        LoRARequest("moe", 3, "/m", is_3d_lora_weight="yes")


def test_a_lora_request_changed_since_it_was_made_is_checked_again(llm_with_lora, adapters, tmp_path):
    """Its fields are checked again each time it is passed: an id the engine process could not decode (which would
    end it) is a ValueError, as is another path under an id already served (whose weights the engine keeps); the
    engine serves on."""
    lora = copy.copy(adapters["all-r8"][0])
    lora.lora_name, lora.lora_int_id = "changed", 80
    prompts = [[1, 2, 3]]
    served = run(llm_with_lora, prompts, lora)
    lora.lora_path = str(tmp_path)
    with pytest.raises(ValueError, match="lora_int_id 80 already names adapter 'changed' at"):
        run(llm_with_lora, prompts, lora)
    lora.lora_int_id = "80"
    with pytest.raises(ValueError, match=r"lora_int_id must be an integer from 1 to 2\*\*63 - 1, got '80'"):
        run(llm_with_lora, prompts, lora)
    lora.lora_int_id, lora.lora_path = 80, adapters["all-r8"][0].lora_path
    assert run(llm_with_lora, prompts, lora) == served


@pytest.mark.parametrize("settings, message", [
    (dict(max_cpu_loras="4"), r"max_cpu_loras must be a positive integer, got '4'"),
    (dict(max_cpu_loras=0), r"max_cpu_loras must be a positive integer, got 0"),
    (dict(max_loras=2, max_cpu_loras=1), r"max_cpu_loras \(1\) must be at least max_loras \(2\)"),
    (dict(max_loras=0), r"max_loras must be a positive integer, got 0"),
    (dict(max_lora_rank=4), r"max_lora_rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512, got 4"),
])
def test_lora_limits_that_are_not_positive_integers_are_value_errors(settings, message):
    """max_cpu_loras is checked as max_loras is (a str was a TypeError from its comparison with max_loras);
    max_lora_rank takes vLLM's values only (its MaxLoRARanks), as does --max-lora-rank."""
    from pagedllm.config import LoRAConfig

    with pytest.raises(ValueError, match=message):
        LoRAConfig(**settings)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3
    assert LoRAConfig(max_lora_rank=320).max_lora_rank == 320


def test_adapter_files_gone_before_the_engine_loads_them_fail_its_request_only(monkeypatch, tmp_path):
    """The engine loads an adapter when a request first names it (as vLLM loads one when it is added), not in a
    step: files the frontend checked but that are gone (or unreadable) by then fail that request, and the engine
    serves on (a step that raised would end the engine)."""
    from pagedllm.engine.processor import Processor

    path = _write_adapter(tmp_path / "vanishing", {}, {Q_PROJ.format("A"): torch.zeros(4, 576),
                                                         Q_PROJ.format("B"): torch.zeros(576, 4)})
    check = Processor.validate_lora_request

    def check_then_delete(self, lora_request):
        check(self, lora_request)
        if lora_request is not None:
            shutil.rmtree(lora_request.lora_path)

    monkeypatch.setattr(Processor, "validate_lora_request", check_then_delete)
    llm = in_process_llm(**ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4)
    gone = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, lora_request=LoRARequest("v", 7, path),
                        use_tqdm=False)[0]
    assert "does not exist" in gone.error and not gone.outputs[0].token_ids
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_a_running_adapter_dropped_from_the_kept_ones_is_not_read_again(tmp_path):
    """max_cpu_loras=1: another adapter's request, loaded when it comes, drops the running one from the kept adapters.
    Its slot still holds its weights, so its next step reads no files: its directory gone meanwhile (unloaded and
    deleted, say) ended the engine at that step."""
    tensors = {Q_PROJ.format("A"): torch.ones(4, 576) / 100, Q_PROJ.format("B"): torch.ones(576, 4) / 100}
    first, second = (LoRARequest(name, i, _write_adapter(tmp_path / name, {}, tensors))
                     for i, name in enumerate(("first", "second"), start=1))
    engine = in_process_llm(**{**ENGINE, "max_loras": 1}).llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("first", {"prompt_token_ids": [1, 2, 3]}, params, lora_request=first)
    engine.step()
    engine.add_request("second", {"prompt_token_ids": [1, 2, 3]}, params, lora_request=second)
    shutil.rmtree(first.lora_path)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    assert {request_id: len(out.outputs[0].token_ids) for request_id, out in finished.items()} == \
        {"first": 6, "second": 6}


def test_lora_request_without_enable_lora_is_a_value_error(llm, adapters):
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        run(llm, [[1, 2, 3]], adapters["qkv-r4"][0])


def test_tensor_parallel_2_on_a_tiny_model(tmp_path, tokenizer):
    """tp=2 (multi-process) on a tiny random Llama (4 heads, 2 KV heads): column-parallel layers hold their shard of
    B, row-parallel ones their shard of A before the all-reduce; every rank adds the whole embedding LoRA to the
    all-reduced rows, rank 0 the LM head's to the gathered logits. Output is transformers + peft's."""
    from tests.e2e.test_parallel_tiny_models import PROMPTS, save_tiny_model

    base = save_tiny_model(tmp_path / "model", tokenizer, "llama")
    adapter = (LoRARequest("tiny", 1, str(tmp_path / "adapter")),
               _random_adapter(base, ADAPTERS["all-r8"], 0, tmp_path / "adapter"))
    embedding = (LoRARequest("embedding", 2, str(tmp_path / "embedding")),
                 _random_adapter(base, EMBEDDING_ADAPTERS["both-qv"], 3, tmp_path / "embedding"))
    prompts = [*PROMPTS, PROMPTS[1]]
    served = [adapter if i % 2 else (None, base) for i in range(len(PROMPTS))] + [embedding]
    requests = [request for request, _ in served]
    with running_llm(str(tmp_path / "model"), dtype="float32", max_model_len=512, num_kv_blocks=64,
                     tensor_parallel_size=2, distributed_executor_backend="mp", enable_lora=True,
                     max_lora_rank=8) as llm:
        outputs = run(llm, prompts, requests)
    for prompt, (request, oracle), got in zip(prompts, served, outputs):
        assert_transformers_greedy(oracle, [prompt], [got], MAX_TOKENS)
        if request:  # the adapter changed the output: the base model would not have chosen it
            assert hf_greedy(base, prompt, got) != got


def test_phi3_adapter_on_its_fused_modules(tmp_path, tokenizer):
    """Phi-3's checkpoint fuses q/k/v into qkv_proj and gate/up into gate_up_proj, so peft adapts those whole: their
    B splits into the model's slices, which share A. Output is transformers + peft's, and the adapter changed it."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from tests.e2e.test_tiny_models import _save_tiny

    base = _save_tiny(tmp_path / "model", tokenizer, Phi3Config, Phi3ForCausalLM, tie_word_embeddings=False)
    adapter = _random_adapter(base, dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj",
                                                                              "down_proj"]), 0, tmp_path / "adapter")
    prompts = [[1, 50, 60, 70], list(range(200, 237)), list(range(1000, 1100, 3))]
    lora = LoRARequest("phi3", 1, str(tmp_path / "adapter"))
    requests = [lora, None, lora]
    with running_llm(str(tmp_path / "model"), dtype="float32", max_model_len=512, enable_lora=True,
                     max_lora_rank=8) as llm:
        outputs = run(llm, prompts, requests)
    for prompt, request, got in zip(prompts, requests, outputs):
        assert_transformers_greedy(adapter if request else base, [prompt], [got], MAX_TOKENS)
        if request:
            assert hf_greedy(base, prompt, got) != got


def test_a_gemma3_multimodal_checkpoints_adapter_on_its_language_model(tmp_path, tokenizer):
    """peft names a Gemma 3 multimodal checkpoint's language-model tensors under model.language_model: such an
    adapter serves as one of a plain model does (transformers + peft's output, and the adapter changed it)."""
    from tests.e2e.test_tiny_models import save_tiny_gemma3_multimodal

    base = save_tiny_gemma3_multimodal(tmp_path / "model", tokenizer)
    adapter = _random_adapter(base, dict(r=8, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|v_proj|"
                                                                            r"down_proj)"), 0, tmp_path / "adapter")
    prompts = [[1, 50, 60, 70], list(range(200, 237))]
    lora = LoRARequest("gemma3", 1, str(tmp_path / "adapter"))
    with running_llm(str(tmp_path / "model"), dtype="float32", max_model_len=512, enable_lora=True,
                     max_lora_rank=8) as llm:
        outputs = run(llm, prompts, [lora, None])
    assert_transformers_greedy(adapter, [prompts[0]], [outputs[0]], MAX_TOKENS)
    assert_transformers_greedy(base, [prompts[1]], [outputs[1]], MAX_TOKENS)
    assert hf_greedy(base, prompts[0], outputs[0]) != outputs[0]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_adapters_on_the_embedding_and_lm_head_equal_transformers_with_peft(tmp_path, tokenizer, name):
    """vLLM serves LoRA on embed_tokens (VocabParallelEmbeddingWithLoRA: PEFT's lora_embedding_A looked up by token,
    times lora_embedding_B) and on lm_head (LogitsProcessorWithLoRA), beside the base weights PEFT saves with them:
    each alone, and both with q/v, in one batch with the base model and a q/v adapter, on a tiny random Llama (untied
    LM head) and Qwen2 (tied), give transformers + peft's output, which each adapter changed; so do prompt logprobs
    under the LM head's. In the test process, where CPU graphs are seen: a q/v adapter's steps capture graphs first,
    and the embedding adapter's steps of the same shapes must not replay them (they have no embedding LoRA)."""
    from safetensors import safe_open

    from tests.e2e.test_parallel_tiny_models import PROMPTS, save_tiny_model

    base = save_tiny_model(tmp_path / "model", tokenizer, name)
    adapters = {}
    for i, (adapter, settings) in enumerate(EMBEDDING_ADAPTERS.items()):
        path = tmp_path / adapter
        adapters[adapter] = (LoRARequest(adapter, i + 1, str(path)), _random_adapter(base, settings, i, path))
    with safe_open(str(tmp_path / "both-qv" / "adapter_model.safetensors"), "pt") as f:
        assert any(key.endswith("base_layer.weight") for key in f.keys())  # PEFT's copy of the base weights
    llm = in_process_llm(str(tmp_path / "model"), dtype="float32", max_model_len=512, enable_lora=True, max_loras=2,
                         max_lora_rank=8)
    for adapter in ("qv", "embed"):  # the same shapes of step, a graph's then the embedding's
        request, oracle = adapters[adapter]
        assert_transformers_greedy(oracle, PROMPTS[:1], run(llm, PROMPTS[:1], request), MAX_TOKENS)
    names = [None, "embed", "head", "both-qv", "qv", "head"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outputs = run(llm, prompts, [adapters[n][0] if n else None for n in names])
    for prompt, adapter, got in zip(prompts, names, outputs):
        assert_transformers_greedy(adapters[adapter][1] if adapter else base, [prompt], [got], MAX_TOKENS)
        if adapter:
            assert hf_greedy(base, prompt, got) != got, adapter
    prompt = PROMPTS[1]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 2, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False, lora_request=[adapters["head"][0], None])
    for output, oracle in zip(outputs, (adapters["head"][1], base)):
        with torch.inference_mode():
            expected = torch.log_softmax(oracle(torch.tensor([prompt])).logits[0].float(), -1)
        got = [output.prompt_logprobs[pos][prompt[pos]].logprob for pos in range(1, len(prompt))]
        assert got == pytest.approx([expected[pos - 1, prompt[pos]].item() for pos in range(1, len(prompt))],
                                    abs=1e-3)


def test_beam_search_with_an_adapter_per_prompt_equals_transformers_with_peft(llm_with_lora, adapters, hf_model,
                                                                               tokenizer):
    """LLM.beam_search's lora_request, one per prompt (vLLM's offline beam search): each prompt's beams are its
    model's, transformers' beam search on the peft model or the base; searched one prompt at a time
    (concurrency_limit=1), the same beams."""
    prompts = [tokenizer.encode(text) for text in ("The weather today is", "My favourite colour is",
                                                   "The weather today is")]
    names = ["all-r8", None, "qkv-r4"]
    params = BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=10)
    outs = llm_with_lora.beam_search([{"prompt_token_ids": p} for p in prompts], params,
                                     lora_request=[adapters[n][0] if n else None for n in names])
    base = hf_beam_search(hf_model, prompts[0], 10, tokenizer.eos_token_id)
    assert all(hf_beam_search(adapters[n][1], prompts[0], 10, tokenizer.eos_token_id) != base
               for n in ("all-r8", "qkv-r4"))  # the adapters change the beams: a search ignoring them fails
    for prompt, name, out in zip(prompts, names, outs):
        oracle = adapters[name][1] if name else hf_model
        assert [seq.tokens[len(prompt):] for seq in out.sequences] == hf_beam_search(oracle, prompt, 10,
                                                                                     tokenizer.eos_token_id), name
    one_at_a_time = llm_with_lora.beam_search([{"prompt_token_ids": p} for p in prompts], params,
                                              lora_request=[adapters[n][0] if n else None for n in names],
                                              concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_at_a_time] == [[s.tokens for s in o.sequences] for o in outs]
    with pytest.raises(ValueError, match="^lora_request"):
        llm_with_lora.beam_search("Hi", params, lora_request=[None, None])


def test_add_pin_list_and_remove_loras_as_vllms_engine(llm_with_lora, adapters, tmp_path):
    """vLLM's LLMEngine.add_lora / pin_lora / list_loras / remove_lora, through the engine process (max_cpu_loras=2
    here): a pinned adapter is never the one dropped to make room, however long unused; a removed one is gone from
    the list, and a request naming it loads it again, to its model's tokens; bad calls are ValueErrors."""
    engine = llm_with_lora.llm_engine
    for lora_id in engine.list_loras():
        engine.remove_lora(lora_id)
    first, second, third = (adapters[name][0] for name in ("all-r8", "rslora-r16", "qkv-r4"))
    assert engine.add_lora(first) and engine.add_lora(first)  # True for one loaded already, as vLLM's
    assert engine.list_loras() == {1} and engine.pin_lora(1)
    assert engine.add_lora(second) and engine.add_lora(third)
    assert engine.list_loras() == {1, 3}  # unpinned, the least recently used (first) would have gone: {2, 3}
    with pytest.raises(ValueError, match="Pinning failed. LoRA 2 is not registered"):
        engine.pin_lora(2)
    assert engine.pin_lora(3)
    assert engine.add_lora(second)
    assert engine.list_loras() == {1, 2, 3}  # pinned ones fill the cache: the one added stays beside them
    with pytest.raises(RuntimeError, match="max_cpu_loras=2 adapters are pinned already"):
        engine.pin_lora(2)
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    assert engine.list_loras() == {2, 3}
    assert_transformers_greedy(adapters["all-r8"][1], [[1, 2, 3, 4, 5]], run(llm_with_lora, [[1, 2, 3, 4, 5]], first),
                               MAX_TOKENS)
    with pytest.raises(ValueError, match="does not exist"):
        engine.add_lora(LoRARequest("gone", 9, str(tmp_path / "gone")))
    with pytest.raises(ValueError, match="lora_id must be an integer"):
        engine.remove_lora(0)
    for lora_id in engine.list_loras():
        engine.remove_lora(lora_id)


def test_add_lora_refuses_what_is_not_a_lora_request(llm_with_lora):
    """LLMEngine.add_lora's argument must be a LoRARequest: None or its fields as a dict are a ValueError naming it,
    raised before the engine is called (which failed them with a RuntimeError), and the engine serves on."""
    engine = llm_with_lora.llm_engine
    for bad in (None, {"lora_name": "a", "lora_int_id": 1, "lora_path": "/a"}):
        with pytest.raises(ValueError, match="^lora_request must be a LoRARequest, got "):
            engine.add_lora(bad)
    assert len(run(llm_with_lora, [[1, 2, 3]], None)[0]) == MAX_TOKENS


def test_async_llm_adds_pins_lists_and_removes_loras_as_vllms(llm_with_lora, adapters):
    """AsyncLLM's add_lora / pin_lora / list_loras / remove_lora, awaited, through the running engine process."""
    import asyncio

    from pagedllm.engine.async_llm import AsyncLLM

    class EngineCore:  # the running engine process's utility calls, awaited; no outputs
        dead = False

        async def call_utility_async(self, method, *args):
            return await asyncio.wrap_future(llm_with_lora.llm_engine.engine_core._mp.call_utility(method, *args))

        async def get_output_async(self):
            await asyncio.Event().wait()

        def shutdown(self, timeout=None) -> None:
            pass

    async def run() -> list:
        engine = AsyncLLM(llm_with_lora.llm_engine.config, llm_with_lora.get_tokenizer(), EngineCore())
        try:
            for lora_id in await engine.list_loras():
                await engine.remove_lora(lora_id)
            results = [await engine.add_lora(adapters["qkv-r4"][0]), await engine.list_loras(),
                       await engine.pin_lora(3), await engine.remove_lora(3), await engine.remove_lora(3),
                       await engine.list_loras()]
            with pytest.raises(ValueError, match="Pinning failed. LoRA 3 is not registered"):
                await engine.pin_lora(3)
            return results
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == [True, {3}, True, True, False, set()]


def test_lora_management_without_enable_lora_is_a_value_error(llm, adapters):
    for call in (lambda e: e.add_lora(adapters["qkv-r4"][0]), lambda e: e.remove_lora(1), lambda e: e.list_loras(),
                 lambda e: e.pin_lora(1)):
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            call(llm.llm_engine)
