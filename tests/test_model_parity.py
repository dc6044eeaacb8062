"""Our paged model must reproduce transformers' logits, however a sequence is
split into prefill chunks and decodes and batched with other requests."""

import gguf
import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers import MistralForCausalLM as HFMistralForCausalLM
from transformers import Phi3ForCausalLM as HFPhi3ForCausalLM
from transformers import Qwen2ForCausalLM as HFQwen2ForCausalLM
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.loader import get_model
from pagedllm.platforms.interface import KernelChoice
from tests.model_fixtures import (
    Chunk,
    PagedBatchRunner,
    smollm_model,
    smollm_path,
    smollm_reference,
    write_tiny_gguf,
)

ATOL = 1e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many small decode steps


def _reference_logits(reference, tokens: list[int], prompt_len: int | None = None) -> torch.Tensor:
    """transformers' logits at every position of ``tokens``: from one forward or, given ``prompt_len``, the first
    ``prompt_len`` tokens in one forward, then one token a step on its KV cache, as generate runs (Phi-3's generate
    aside, see layers/rope_scaling.py); dynamic and longrope rope differ there from one forward."""
    with torch.inference_mode():
        if prompt_len is None:
            return reference(torch.tensor([tokens])).logits[0].float()
        out = reference(torch.tensor([tokens[:prompt_len]]), use_cache=True)
        rows = [out.logits[0]]
        for token in tokens[prompt_len:]:
            out = reference(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            rows.append(out.logits[0])
        return torch.cat(rows).float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < atol, f"max abs logit diff {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _run_schedule(model, config, tokens: dict[int, list[int]], schedule: list[list[Chunk]], **kwargs):
    """Run the steps; return each request's logits for all its positions, in order."""
    runner = PagedBatchRunner(model, config, **kwargs)
    rows: dict[int, list[torch.Tensor]] = {req: [] for req in tokens}
    for chunks in schedule:
        for chunk, logits in zip(chunks, runner.step(tokens, chunks)):
            rows[chunk.req].append(logits)
    return {req: torch.cat(parts) for req, parts in rows.items()}


def _prefill_then_decode(req: int, length: int, chunk: int) -> list[list[Chunk]]:
    return [[Chunk(req, 0, chunk)]] + [[Chunk(req, pos, 1)] for pos in range(chunk, length)]


# Two requests interleaved in one flattened batch, covering every attention path:
# first prefill, prefill chunk over cached history, single decode, decodes of
# different lengths batched together, and two history chunks in one step.
MIXED_SCHEDULE = [
    [Chunk(0, 0, 16), Chunk(1, 0, 22)],
    [Chunk(0, 16, 16), Chunk(1, 22, 1)],
    [Chunk(1, 23, 1), Chunk(0, 32, 1)],
    [Chunk(0, 33, 7), Chunk(1, 24, 2)],
]
MIXED_LENGTHS = {0: 40, 1: 26}


def _check_schedules(model, reference, config, vocab_size: int, seed: int, prompt_len: int | None = None,
                     **kwargs) -> None:
    """Every schedule gives transformers' logits (with ``prompt_len``, those one token a step after a prompt of
    that many tokens, see _reference_logits); ``kwargs`` go to PagedBatchRunner."""
    gen = torch.Generator().manual_seed(seed)
    tokens = {req: torch.randint(0, vocab_size, (n,), generator=gen).tolist() for req, n in MIXED_LENGTHS.items()}
    refs = {req: _reference_logits(reference, t, prompt_len) for req, t in tokens.items()}
    n = MIXED_LENGTHS[0]
    for schedule in ([[Chunk(0, 0, n)]], _prefill_then_decode(0, n, 16)):
        _assert_close(_run_schedule(model, config, {0: tokens[0]}, schedule, **kwargs)[0], refs[0])
    mixed = _run_schedule(model, config, tokens, MIXED_SCHEDULE, **kwargs)
    for req in tokens:
        _assert_close(mixed[req], refs[req])


@pytest.fixture(scope="module")
def smollm():
    return smollm_model(), smollm_reference(), load_hf_config(smollm_path())


def test_smollm_one_prefill(smollm):
    model, reference, config = smollm
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = _run_schedule(model, config, {0: tokens}, [[Chunk(0, 0, 40)]])[0]
    _assert_close(ours, _reference_logits(reference, tokens))


def test_smollm_chunked_prefill_and_decode(smollm):
    model, reference, config = smollm
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = _run_schedule(model, config, {0: tokens}, _prefill_then_decode(0, 40, 16))[0]
    _assert_close(ours, _reference_logits(reference, tokens))


def test_smollm_mixed_batch(smollm):
    model, reference, config = smollm
    gen = torch.Generator().manual_seed(3)
    tokens = {r: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for r, n in MIXED_LENGTHS.items()}
    ours = _run_schedule(model, config, tokens, MIXED_SCHEDULE)
    for req, t in tokens.items():
        _assert_close(ours[req], _reference_logits(reference, t))


def _save_tiny(hf_class, config, directory, seed: int = 0):
    torch.manual_seed(seed)
    reference = hf_class(config).eval()
    reference.save_pretrained(directory)
    assert any(p.suffix == ".safetensors" for p in directory.iterdir())
    return reference


TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, initializer_range=0.2,
)


def test_tiny_qwen2_parity(tmp_path):
    config = Qwen2Config(**TINY, tie_word_embeddings=True)
    reference = _save_tiny(HFQwen2ForCausalLM, config, tmp_path)
    assert reference.model.layers[0].self_attn.q_proj.bias is not None
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
    assert "lm_head.weight" not in dict(model.named_parameters())
    _check_schedules(model, reference, load_hf_config(str(tmp_path)), config.vocab_size, seed=4, block_size=4)


def test_tiny_qwen3_parity(tmp_path):
    """Per-head q/k norms before the rotary embedding, and a head size other than hidden / heads."""
    config = Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    reference = _save_tiny(HFQwen3ForCausalLM, config, tmp_path)
    for norm in (reference.model.layers[0].self_attn.q_norm, reference.model.layers[1].self_attn.k_norm):
        norm.weight.data.uniform_(0.5, 1.5)  # not all ones: the norms' weights must load and apply
    reference.save_pretrained(tmp_path, safe_serialization=True)
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
    assert model.model.layers[1].self_attn.k_norm.weight.shape == (32,)
    _check_schedules(model, reference, load_hf_config(str(tmp_path)), config.vocab_size, seed=6, block_size=4)


@pytest.mark.parametrize("head_dim", [16, 64])  # 64: prefill chunks on the native tiles where they build
def test_tiny_mistral_sliding_window_parity(tmp_path, head_dim):
    """A window of 8 under sequences of 26 and 40 tokens: every prefill, chunk and decode row sees only its last 8
    positions, as transformers' sliding-window mask has it."""
    config = MistralConfig(**TINY, head_dim=head_dim, sliding_window=8)
    reference = _save_tiny(HFMistralForCausalLM, config, tmp_path)
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, 8]
    _check_schedules(model, reference, load_hf_config(str(tmp_path)), config.vocab_size, seed=9, block_size=4)


def test_tiny_qwen2_sliding_window_parity(tmp_path):
    """use_sliding_window with max_window_layers=1: the first layer attends to everything, the second to a window."""
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    reference = _save_tiny(HFQwen2ForCausalLM, config, tmp_path)
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 6]
    _check_schedules(model, reference, load_hf_config(str(tmp_path)), config.vocab_size, seed=10, block_size=4)


def test_tiny_llama_untied_llama3_rope_parity(tmp_path):
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=16)
    config = LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=rope)
    reference = _save_tiny(HFLlamaForCausalLM, config, tmp_path)
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    _check_schedules(model, reference, load_hf_config(str(tmp_path)), config.vocab_size, seed=5, block_size=8)


# Original context 16 (dynamic's is max_position_embeddings): the schedules' sequences, 40 and 26 tokens, cross it.
ORIGINAL = 16
LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL,
                short_factor=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
                long_factor=[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0])
ROPE_SCALING = {
    "linear": (dict(rope_type="linear", factor=2.0), {}),
    "dynamic": (dict(rope_type="dynamic", factor=4.0), dict(max_position_embeddings=ORIGINAL)),
    "yarn": (dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIGINAL), {}),
    "longrope": (LONGROPE, {}),
}


@pytest.mark.parametrize("rope_type", ROPE_SCALING)
def test_tiny_llama_rope_scaling_parity(tmp_path, rope_type):
    """Against transformers one token a step (Llama's generate) after an 8-token prompt, within the original
    length: the per-position table reproduces it for dynamic and longrope too, whose frequencies change when the
    sequence outgrows that length."""
    rope, overrides = ROPE_SCALING[rope_type]
    config = LlamaConfig(**{**TINY, **overrides}, rope_parameters=dict(rope, rope_theta=10000.0))
    reference = _save_tiny(HFLlamaForCausalLM, config, tmp_path)
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
    _check_schedules(model, reference, load_hf_config(str(tmp_path)), config.vocab_size, seed=9, prompt_len=8,
                     block_size=4)


@pytest.mark.parametrize("rope_type", ["default", "longrope"])
def test_tiny_phi3_parity(tmp_path, rope_type):
    """Fused qkv_proj and gate_up_proj checkpoint tensors; with longrope (LONGROPE's factors; Phi-3 configs keep
    the original length beside the rope parameters), past the original length against transformers' Phi-3 one
    token a step on its cache (not its generate, which re-encodes the sequence there: see layers/rope_scaling.py)."""
    rope = {"rope_type": "default"}
    if rope_type == "longrope":
        rope = {k: v for k, v in LONGROPE.items() if k != "original_max_position_embeddings"}
    config = Phi3Config(**TINY, original_max_position_embeddings=ORIGINAL, rope_parameters=rope, pad_token_id=None)
    reference = _save_tiny(HFPhi3ForCausalLM, config, tmp_path)
    assert reference.model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 2 * 2 * 16, 64)
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.float32))
    _check_schedules(model, reference, load_hf_config(str(tmp_path)), config.vocab_size, seed=10,
                     prompt_len=8 if rope_type == "longrope" else None, block_size=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_tiny_gguf_parity(tmp_path, arch):
    """Unquantized GGUF written like llama.cpp (llama q/k rows permuted, qwen2
    biases, qwen3 q/k norms, phi3 q/k/v and gate/up fused) loads back to the
    original HF model's logits."""
    classes = {"llama": (LlamaConfig, HFLlamaForCausalLM), "qwen2": (Qwen2Config, HFQwen2ForCausalLM),
               "qwen3": (Qwen3Config, HFQwen3ForCausalLM), "phi3": (Phi3Config, HFPhi3ForCausalLM)}
    config_class, hf_class = classes[arch]
    torch.manual_seed(7)
    reference = hf_class(config_class(**TINY, tie_word_embeddings=False, pad_token_id=None)).eval()
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_tiny_gguf(reference, path, arch)
    config = load_hf_config(path)
    assert config.model_type == arch and not config.tie_word_embeddings
    model = get_model(path, config, KernelChoice(torch.float32))
    _check_schedules(model, reference, config, config.vocab_size, seed=8, block_size=4)


GGUF_ROPES = {"linear": dict(rope_type="linear", factor=4.0),
              "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
              "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32)}


@pytest.mark.parametrize("rope", GGUF_ROPES)
def test_tiny_gguf_rope_scaling_parity(tmp_path, rope):
    """A GGUF of a rope-scaled Llama as llama.cpp's converter writes it (linear and yarn as rope.scaling metadata,
    llama3 as the rope_freqs tensor of per-frequency divisors) is the scaled model, not the plain rope one."""
    from pagedllm.layers.rope_scaling import _default_inv_freq, inv_freq_and_scale
    params = dict(GGUF_ROPES[rope], rope_theta=10000.0)
    torch.manual_seed(7)
    reference = HFLlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=dict(params)))
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]

    def scaling(writer) -> None:
        if rope == "llama3":
            scaled, _ = inv_freq_and_scale(params, head_dim, TINY["max_position_embeddings"], None)
            writer.add_tensor("rope_freqs.weight", (_default_inv_freq(10000.0, head_dim) / scaled).numpy())
            return
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope))
        writer.add_rope_scaling_factor(params["factor"])
        if rope == "yarn":
            writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])

    path = str(tmp_path / f"tiny-{rope}.gguf")
    write_tiny_gguf(reference.eval(), path, "llama", extra=scaling)
    config = load_hf_config(path)
    assert config.rope_parameters["rope_type"] == ("default" if rope == "llama3" else rope)
    model = get_model(path, config, KernelChoice(torch.float32))
    _check_schedules(model, reference, config, config.vocab_size, seed=8, block_size=4)


def test_tiny_gguf_llama_with_biases_parity(tmp_path):
    """A Llama-architecture GGUF with q/k/v/o and MLP biases (its config cannot say so) loads them."""
    torch.manual_seed(7)
    reference = HFLlamaForCausalLM(LlamaConfig(**TINY, attention_bias=True, mlp_bias=True, tie_word_embeddings=False))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)  # not zeros: they must load and apply
    path = str(tmp_path / "tiny-llama-biases.gguf")
    write_tiny_gguf(reference.eval(), path, "llama")
    config = load_hf_config(path)
    assert config.attention_bias and config.mlp_bias
    model = get_model(path, config, KernelChoice(torch.float32))
    _check_schedules(model, reference, config, config.vocab_size, seed=8, block_size=4)


def test_tiny_qwen2_bfloat16(tmp_path):
    """bfloat16 runs end to end and stays near transformers' bfloat16 logits."""
    config = Qwen2Config(**TINY)
    _save_tiny(HFQwen2ForCausalLM, config, tmp_path)
    reference = HFQwen2ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    model = get_model(str(tmp_path), load_hf_config(str(tmp_path)), KernelChoice(torch.bfloat16))
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    tokens = {req: torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(6)).tolist()
              for req, n in MIXED_LENGTHS.items()}
    ours = _run_schedule(model, load_hf_config(str(tmp_path)), tokens, MIXED_SCHEDULE, dtype=torch.bfloat16)
    for req, t in tokens.items():
        ref = _reference_logits(reference, t)
        assert (ours[req] - ref).abs().max().item() < 0.1 * ref.abs().max().item()


GEMMA = {
    # Gemma 2: its config's default layer types (local, global, local); soft caps that bite: the scaled attention
    # scores reach ~17 here, the logits ~11; heads of 64 (prefill chunks on the native tiles where they build)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=64, attn_logit_softcapping=8.0,
                                                          final_logit_softcapping=3.0)),
    # Gemma 3: q/k norms, and each kind of layer its own rope base
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=32, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"])),
}


def _tiny_gemma(arch: str, directory, **overrides):
    """transformers' tiny GEMMA[arch] (three layers, a window of 8, ``overrides`` on top), saved in ``directory``."""
    import transformers

    config_name, model_name, extra = GEMMA[arch]
    values = {**TINY, "num_hidden_layers": 3, "query_pre_attn_scalar": 24, "sliding_window": 8, **extra, **overrides}
    reference = _save_tiny(getattr(transformers, model_name), getattr(transformers, config_name)(**values), directory)
    for name, param in reference.named_parameters():
        if name.endswith("norm.weight"):  # Gemma's norms start at zero (a scale of one): make them matter
            param.data.uniform_(-0.5, 0.5)
    reference.save_pretrained(directory)
    return reference


@pytest.mark.parametrize("arch", GEMMA)
def test_tiny_gemma_parity(tmp_path, arch):
    """Gemma 2 and 3: (1 + weight) norms, four a layer, embeddings times sqrt(hidden), GeGLU, scores scaled by
    query_pre_attn_scalar, local layers (window 8) beside a global one (the test's sequences outgrow the window),
    and each its own (GEMMA)."""
    reference = _tiny_gemma(arch, tmp_path)
    config = reference.config
    ours = load_hf_config(str(tmp_path))
    model = get_model(str(tmp_path), ours, KernelChoice(torch.float32))
    attention = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attention] == [8, None, 8]
    assert [a.logits_soft_cap for a in attention] == [config.attn_logit_softcapping] * 3
    assert model.logits_processor.soft_cap == config.final_logit_softcapping
    _check_schedules(model, reference, ours, config.vocab_size, seed=13, block_size=4)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_gguf_parity(tmp_path, arch):
    """Gemma through a GGUF file written like llama.cpp's: its norms stored as the scale (1 + weight), its four
    norms' names, the soft caps read from the file, the scores scaled by head_dim ** -0.5 (llama.cpp's rule for
    all but the 27B models; the file has no query_pre_attn_scalar)."""
    # llama.cpp's layer types are the config classes' defaults: six layers, Gemma 3's local five and a global one
    reference = _tiny_gemma(arch, tmp_path, query_pre_attn_scalar=GEMMA[arch][2]["head_dim"], layer_types=None,
                            num_hidden_layers=6)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_tiny_gguf(reference, path, arch)
    config = load_hf_config(path)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "sliding_window",
                "head_dim", "layer_types", "rope_parameters"):
        assert getattr(config, key) == getattr(reference.config, key), key
    model = get_model(path, config, KernelChoice(torch.float32))
    _check_schedules(model, reference, config, config.vocab_size, seed=14, block_size=4)
