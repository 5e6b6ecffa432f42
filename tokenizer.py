"""Tokenizers of HF-format checkpoints: `tokenizer.json` (HF `tokenizers`) or
`tokenizer.model` (sentencepiece), with the special-token ids that FastGen's
Special policy keeps, and the chat template for instruct models."""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path


def not_utf8_at(text: str) -> int | None:
    """The byte offset in `text` of its first byte that is not UTF-8 (read in as a
    surrogate escape, which no tokenizer takes), or None when it is all text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return len(text[:e.start].encode())
    return None


class TokenizerError(Exception):
    """A tokenizer that cannot be loaded; the message says why and what to do."""


class Tokenizer:
    """One interface over both tokenizer kinds.

    `special_ids` are the control tokens (BOS, EOS, `<|im_start|>`, ...);
    `eos_ids` end generation; `chat_template` is the Jinja template from
    `tokenizer_config.json`, if any.
    """

    def __init__(self, ckpt: str | Path):
        ckpt = Path(ckpt)
        config = _read_json(ckpt / "tokenizer_config.json")
        model_config = _read_json(ckpt / "config.json")
        gen_config = _read_json(ckpt / "generation_config.json")
        if (ckpt / "tokenizer.json").is_file():
            self._load_hf(ckpt / "tokenizer.json")
        elif (ckpt / "tokenizer.model").is_file():
            self._load_sentencepiece(ckpt / "tokenizer.model", config)
        else:
            raise TokenizerError(f"no tokenizer.json or tokenizer.model in {ckpt}; copy the "
                                 "tokenizer files of the checkpoint into that folder")
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default
            self.chat_template = {t["name"]: t["template"] for t in self.chat_template}.get("default")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos = gen_config.get("eos_token_id", model_config.get("eos_token_id"))
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            eos.append(self.token_to_id(self.eos_token))
        if not eos and self._sp is not None and self._sp.eos_id() >= 0:
            eos = [self._sp.eos_id()]  # a bare tokenizer.model: its own EOS
        self.eos_ids = sorted(set(eos))
        self.special_ids = sorted(set(self.special_ids) | set(self.eos_ids))

    # -- the two backends --

    def _load_hf(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self._hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise TokenizerError(f"{path} cannot be loaded ({e}); re-download it")
        self._sp = None
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        self.special_ids = [i for i, t in self._hf.get_added_tokens_decoder().items() if t.special]

    def _load_sentencepiece(self, path: Path, config: dict):
        import sentencepiece as spm
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path} cannot be loaded ({e}); re-download it")
        self._hf = None
        self.vocab_size = self._sp.GetPieceSize()
        self.special_ids = [i for i in range(self.vocab_size)
                            if self._sp.IsControl(i) or self._sp.IsUnknown(i)]
        self._add_bos = config.get("add_bos_token", True)

    # -- the interface --

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; with `special`, BOS is added if the tokenizer adds one."""
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=special).ids
        ids = self._sp.EncodeAsIds(text)
        bos = self._sp.bos_id()
        return ([bos] if special and self._add_bos and bos >= 0 else []) + ids

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._sp.DecodeIds(ids)

    def token_to_id(self, token: str) -> int | None:
        if self._hf is not None:
            return self._hf.token_to_id(token)
        i = self._sp.PieceToId(token)
        return None if i == self._sp.unk_id() and token != self._sp.IdToPiece(i) else i

    def token_texts(self) -> list[str]:
        """Each token decoded on its own, for policies that look at token text."""
        if self._hf is not None:
            return self._hf.decode_batch([[i] for i in range(self.vocab_size)],
                                         skip_special_tokens=False)
        return [self._sp.IdToPiece(i).replace("\u2581", " ") for i in range(self.vocab_size)]

    def punctuation_ids(self) -> list[int]:
        """Ids of tokens whose text, without whitespace, is only punctuation.

        Newline-only tokens do not count: after stripping whitespace they are
        empty. Byte-fallback pieces such as `<0x2E>` are not decoded and so
        do not count either.
        """
        special = set(self.special_ids)
        return [i for i, text in enumerate(self.token_texts())
                if i not in special and _is_punctuation(text)]

    def apply_chat(self, prompt: str | list[dict]) -> str:
        """The prompt as one user turn (or a conversation: a list of {"role", "content"}
        messages), rendered by the checkpoint's chat template, ready for the assistant."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template (tokenizer_config.json "
                                 "has no chat_template); run without --chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise TokenizerError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=[{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
            add_generation_prompt=True,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _is_punctuation(text: str) -> bool:
    text = "".join(text.split())
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} cannot be read as JSON ({e}); re-download it")
