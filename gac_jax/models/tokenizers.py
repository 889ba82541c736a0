"""Tokenizers behind one small interface (`Tokenizer`): `CharTokenizer`, one id per
character, for the embedded tasks and the tiny models (its vocabulary fits the "tiny"
preset's 128 ids), and `HFTokenizer`, a `tokenizer.json` for real checkpoints.
"""

from __future__ import annotations

import itertools
import json
import os
import string
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

DEFAULT_CHARACTERS = (
    string.digits
    + "+-*/=()"
    + " "
    + string.ascii_lowercase
    + string.ascii_uppercase
    + ",.:;?!<>_%^'\"\n"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of gac_jax needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of ids (the model's vocabulary must be at least this large)."""
        ...

    @property
    def pad_id(self) -> int:
        """Padding id."""
        ...

    @property
    def eos_id(self) -> int:
        """End-of-sequence id."""
        ...

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None."""
        ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally wrapped in BOS / EOS."""
        ...

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless `skip_special_tokens=False`."""
        ...


class CharTokenizer:
    """Character-level tokenizer: ids 0, 1, 2 are `<pad>`, `<bos>`, `<eos>`, then one id per
    character of `characters`."""

    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, characters: str = DEFAULT_CHARACTERS):
        """`characters`: the alphabet, each character once (ValueError otherwise)."""
        if not characters:
            raise ValueError("characters is empty; give the alphabet to encode.")
        repeated = sorted({c for c in characters if characters.count(c) > 1})
        if repeated:
            raise ValueError(f"characters repeats {repeated}; each must appear once.")
        self._special = (PAD, BOS, EOS)
        self._id_of = {c: i + len(self._special) for i, c in enumerate(characters)}
        self._char_of = {i: c for c, i in self._id_of.items()}
        self.characters = characters

    @property
    def vocab_size(self) -> int:
        """3 special ids plus one per character."""
        return len(self._special) + len(self.characters)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """One id per character of `text`; ValueError naming the first character outside
        the alphabet."""
        ids = []
        for position, char in enumerate(text):
            if char not in self._id_of:
                raise ValueError(
                    f"Character {char!r} at position {position} of {text!r} is not in the "
                    f"tokenizer's alphabet {self.characters!r}."
                )
            ids.append(self._id_of[char])
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """The characters of `ids`; special ids become `<pad>` etc. or are skipped;
        ValueError for an id outside [0, vocab_size)."""
        pieces = []
        for token in ids:
            token = int(token)
            if token < len(self._special):
                if not skip_special_tokens:
                    pieces.append(self._special[token])
            elif token in self._char_of:
                pieces.append(self._char_of[token])
            else:
                raise ValueError(f"Token id {token} is outside [0, {self.vocab_size}).")
        return "".join(pieces)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (fast tokenizer) behind the `Tokenizer` interface."""

    def __init__(
        self,
        tokenizer,
        *,
        eos_token: str,
        pad_token: str | None = None,
        bos_token: str | None = None,
    ):
        """Wraps a `tokenizers.Tokenizer`. The special tokens are given by their text
        (e.g. `eos_token="<|im_end|>"`); `pad_token` None means the EOS token (Llama 3 has
        none). ValueError if a named special token is not in the vocabulary.
        """
        self._tokenizer = tokenizer
        self.eos_id = self._token_id(eos_token, "eos_token")
        self.pad_id = self.eos_id if pad_token is None else self._token_id(pad_token, "pad_token")
        self.bos_id = None if bos_token is None else self._token_id(bos_token, "bos_token")

    def _token_id(self, token: str, role: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role}={token!r} is not in the tokenizer's vocabulary.")
        return token_id

    @classmethod
    def from_file(cls, tokenizer_json: str | os.PathLike, **special_tokens) -> HFTokenizer:
        """Loads a `tokenizer.json`; `special_tokens` as in `__init__`."""
        try:
            import tokenizers  # Optional dependency, loaded on use.
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise ImportError(
                "HFTokenizer needs the `tokenizers` package (pip install tokenizers)."
            ) from error
        path = Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"No tokenizer file at {str(path)!r}.")
        return cls(tokenizers.Tokenizer.from_file(str(path)), **special_tokens)

    @classmethod
    def from_directory(
        cls,
        path: str | os.PathLike,
        *,
        eos_token: str | None = None,
        pad_token: str | None = None,
        bos_token: str | None = None,
    ) -> HFTokenizer:
        """Loads `tokenizer.json` from a checkpoint directory.

        Special tokens not given are read from `tokenizer_config.json` (`eos_token`,
        `pad_token`, `bos_token`) when the directory has one. FileNotFoundError without
        `tokenizer.json`; ValueError if no EOS token is given or found.
        """
        path = Path(path)
        given = {"eos_token": eos_token, "pad_token": pad_token, "bos_token": bos_token}
        found: dict[str, str | None] = {}
        config_path = path / "tokenizer_config.json"
        if config_path.is_file():
            tokenizer_config = json.loads(config_path.read_text())
            for key in given:
                value = tokenizer_config.get(key)
                if isinstance(value, dict):  # Older files store AddedToken dicts.
                    value = value.get("content")
                found[key] = value
        special = {key: value or found.get(key) for key, value in given.items()}
        if special["eos_token"] is None:
            raise ValueError(
                f"No eos_token given and none in {str(config_path)!r}; pass eos_token=..."
            )
        return cls.from_file(path / "tokenizer.json", **special)

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary including added tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, without the tokenizer's own post-processing templates."""
        if add_bos and self.bos_id is None:
            raise ValueError("add_bos=True but this tokenizer has no bos_token.")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * add_bos + list(ids) + [self.eos_id] * add_eos

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=skip_special_tokens
        )


# What an id outside the tokenizer's vocabulary decodes to in model output. A model's
# embedding table is often larger than its tokenizer (the tiny presets: 128 rows, 87
# characters), and an untrained model samples those rows.
UNKNOWN_TOKEN_TEXT = "\ufffd"


def decode_completion(tokenizer: Tokenizer, ids: Iterable[int]) -> str:
    """Decodes sampled ids for scoring: never raises, ids outside the vocabulary become
    U+FFFD (which no verifier accepts), special tokens are skipped."""
    vocab = tokenizer.vocab_size
    pieces = []
    for known, run in itertools.groupby(map(int, ids), lambda token: 0 <= token < vocab):
        run = list(run)
        pieces.append(tokenizer.decode(run) if known else UNKNOWN_TOKEN_TEXT * len(run))
    return "".join(pieces)
