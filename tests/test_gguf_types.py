"""GGUF files of the common tensor types load: a tiny Llama written with K-quant (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), Q8_0,
Q4_0, F16 and BF16 tensors gives the logits of transformers' own GGUF load of the same file (which dequantizes with
gguf-py and undoes llama.cpp's q/k row permutation), under the parity suite's schedules."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.loader import get_model
from pagedllm.platforms.interface import KernelChoice
from tests.test_model_parity import _check_schedules

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 256, 512, 2, 256  # K-quant rows hold whole 256-element super-blocks
# Where each K-quant super-block keeps its float16 scale(s): byte offsets. Random bytes elsewhere are valid codes.
_K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
TYPES = {"token_embd": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
         "ffn_gate": T.Q2_K, "ffn_up": T.Q3_K, "ffn_down": T.BF16, "output": T.Q4_0, "attn_norm": T.F16}


def _k_quant_rows(rng: np.random.Generator, rows: int, cols: int, tensor_type: T) -> np.ndarray:
    """Random super-blocks whose scales are small finite float16s (random bytes there could be inf or NaN)."""
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in _K_SCALES[tensor_type]:
        scale = rng.uniform(0.002, 0.02, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _write(path: str, config: LlamaConfig) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    kv = config.num_key_value_heads * HIDDEN // config.num_attention_heads
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
              "ffn_down": (HIDDEN, INTERMEDIATE), "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,)}
    names = {"token_embd": (VOCAB, HIDDEN), "output": (VOCAB, HIDDEN), "output_norm": (HIDDEN,)}
    for layer in range(LAYERS):
        names.update({f"blk.{layer}.{base}": shape for base, shape in shapes.items()})
    for name, shape in names.items():
        tensor_type = TYPES.get(name.rsplit(".", 1)[-1], T.F32)
        if tensor_type in _K_SCALES:
            writer.add_tensor(f"{name}.weight", _k_quant_rows(rng, *shape, tensor_type), raw_dtype=tensor_type)
            continue
        values = (rng.standard_normal(shape) * (0.05 if len(shape) == 2 else 0.1) + (len(shape) == 1))
        values = values.astype(np.float32)
        if tensor_type == T.F32:
            writer.add_tensor(f"{name}.weight", values)
        elif tensor_type == T.F16:
            writer.add_tensor(f"{name}.weight", values.astype(np.float16))
        else:
            writer.add_tensor(f"{name}.weight", quantize(values, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_tensor_types_load_as_transformers_does(tmp_path):
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                         tie_word_embeddings=False)
    path = str(tmp_path / "tiny-types.gguf")
    _write(path, config)
    ours = load_hf_config(path)
    model = get_model(path, ours, KernelChoice(torch.float32))
    with no_init_weights():
        reference = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=reference)["tensors"]
    result = reference.load_state_dict(tensors, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    _check_schedules(model, reference.eval(), ours, VOCAB, seed=10, block_size=4)


def test_a_type_gguf_py_does_not_dequantize_fails_with_the_config(tmp_path, monkeypatch):
    """A weight in Q8_K (llama.cpp's activation type, which gguf-py does not dequantize) is refused, naming the tensor
    and the types that load, as the config loads: before any process starts or weight is read."""
    monkeypatch.setitem(TYPES, "ffn_down", T.Q8_K)
    monkeypatch.setitem(_K_SCALES, T.Q8_K, (0,))  # random bytes: the file is refused unread
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
    path = str(tmp_path / "tiny-q8k.gguf")
    _write(path, config)
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.ffn_down.weight' has type Q8_K, which is not supported; "
                                         "supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K"):
        EngineArgs(path).create_engine_config()
