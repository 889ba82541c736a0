"""Character tokenizer and the Hugging Face tokenizer.json wrapper."""

import json

import pytest

from gac_jax.models import CharTokenizer, HFTokenizer, Tokenizer, get_config


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    text = "Using 3, 7, 25: (25 - 7) * 3 = 54"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id == 1 and ids[-1] == tok.eos_id == 2 and tok.pad_id == 0
    assert len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode([0, 0] + ids, skip_special_tokens=False).startswith("<pad><pad><bos>U")
    tiny = get_config("tiny")
    assert max(ids) < tok.vocab_size <= tiny.vocab_size
    assert (tok.pad_id, tok.bos_id, (tok.eos_id,)) == (
        tiny.pad_token_id,
        tiny.bos_token_id,
        tiny.eos_token_ids,
    )
    assert len(set(tok.encode("0123456789+-*/=() "))) == 18  # One id per character.


def test_char_tokenizer_errors():
    tok = CharTokenizer("ab")
    assert tok.vocab_size == 5
    with pytest.raises(ValueError, match=r"Character 'c' at position 1 of 'acb'"):
        tok.encode("acb")
    with pytest.raises(ValueError, match="Token id 9"):
        tok.decode([3, 9])
    with pytest.raises(ValueError, match=r"repeats \['a'\]"):
        CharTokenizer("aba")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["what is 12 plus 30? the answer is 42.", "count down from 10 to 1"] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None})
    )
    return path


def test_hf_tokenizer_from_directory(hf_dir):
    tok = HFTokenizer.from_directory(hf_dir)
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 2, None)
    text = "what is 12 plus 30?"
    ids = tok.encode(text, add_eos=True)
    assert ids[-1] == tok.eos_id and len(ids) < len(text)  # BPE merges characters.
    assert tok.decode(ids) == text
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)
    stored = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok.vocab_size == len(stored) == 1 + max(stored.values())
    with pytest.raises(ValueError, match="no bos_token"):
        tok.encode(text, add_bos=True)


def test_hf_tokenizer_special_token_errors(hf_dir, tmp_path):
    with pytest.raises(ValueError, match="eos_token='<eos>' is not in"):
        HFTokenizer.from_directory(hf_dir, eos_token="<eos>")
    llama_style = HFTokenizer.from_file(hf_dir / "tokenizer.json", eos_token="<|endoftext|>")
    assert llama_style.pad_id == llama_style.eos_id  # No pad token: pad with EOS.
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_directory(tmp_path, eos_token="x")


def test_decode_completion_never_raises_on_out_of_vocabulary_ids():
    from gac_jax.models.tokenizers import UNKNOWN_TOKEN_TEXT, decode_completion

    tok = CharTokenizer()
    ids = tok.encode("12+3") + [tok.vocab_size, 127] + tok.encode("4") + [tok.eos_id]
    assert decode_completion(tok, ids) == "12+3" + 2 * UNKNOWN_TOKEN_TEXT + "4"
    assert decode_completion(tok, []) == ""
