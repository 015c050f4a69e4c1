#!/usr/bin/env python3
"""Tokenizer oracle: a HuggingFace `tokenizers.Tokenizer` built from a GGUF's tokenizer metadata.

How it is built (and why not `transformers`)
--------------------------------------------
The preferred route, `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, needs PyTorch: both
transformers 5.x (`integrations/gguf/reader.py` imports torch) and 4.57 (`load_gguf_checkpoint`
raises "Please install torch") refuse without it.  Worse, its converter would be wrong for
SmolLM2: for a `gpt2`-model GGUF it installs a plain ByteLevel pre-tokenizer (GPT-2 regex) and drops
the Digits(individual_digits=True) step of SmolLM2's real tokenizer.json, so e.g. "a  1" gives
["a", "Ġ", "Ġ", "1"] there but ["a", "ĠĠ", "1"] with the real tokenizer.

So this module assembles the tokenizer itself, from nothing but the GGUF metadata read with the
`gguf` package and the `tokenizers` library's own BPE / pre-tokenizer / decoder implementations
(no code shared with the Rust engine):

* model: BPE(vocab = tokenizer.ggml.tokens, merges = tokenizer.ggml.merges), no unk, no dropout,
  no byte fallback (byte-level BPE covers every byte);
* pre-tokenizer, chosen from tokenizer.ggml.pre the way llama.cpp does
  (llama-vocab.cpp maps "smollm" to LLAMA_VOCAB_PRE_TYPE_SMOLLM = split off every digit, then the
  GPT-2 regex), which is exactly SmolLM2's tokenizer.json:
      Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]
  ("gpt2"/"default"/missing -> plain ByteLevel GPT-2 regex; other values are refused);
* added tokens: every token whose tokenizer.ggml.token_type is CONTROL (3) or USER_DEFINED (4)
  becomes a special AddedToken (normalized=False), so "<|im_start|>" in text is matched whole;
* decoder: ByteLevel; no normalizer; no post-processor (BOS is never added:
  tokenizer.ggml.add_bos_token is false for SmolLM2, and the engine contract is "plain encode").

CLI (for eyeballing):
    python3 python/tokenizer_oracle.py --model M.gguf "The capital of France is"
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def _strings(reader: GGUFReader, key: str) -> list[str]:
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _ints(reader: GGUFReader, key: str) -> list[int]:
    f = reader.fields[key]
    return [int(f.parts[i][0]) for i in f.data]


def _scalar(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    if hasattr(f, "contents"):
        return f.contents()
    part = f.parts[f.data[0]]
    try:
        return bytes(part).decode("utf-8") if part.dtype.kind == "u" and part.itemsize == 1 else part.tolist()[0]
    except Exception:  # pragma: no cover
        return part.tolist()[0]


def pre_tokenizer_for(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm",):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    raise NotImplementedError(f"tokenizer.ggml.pre={pre!r} is not modelled by this oracle")


@functools.lru_cache(maxsize=4)
def build_tokenizer(model_path: str) -> Tokenizer:
    reader = GGUFReader(model_path)
    kind = _scalar(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') is modelled")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    types = _ints(reader, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate token strings in tokenizer.ggml.tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer_for(_scalar(reader, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tokens[i], special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for i, ty in enumerate(types)
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    # add_special_tokens must map onto the existing ids, not append new ones.
    for a in special:
        assert tok.token_to_id(a.content) == vocab[a.content], a.content
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)
    return tok


def encode(model_path: str, text: str) -> list[int]:
    """Plain encode: no BOS, special-token strings in `text` become their special ids."""
    return build_tokenizer(model_path).encode(text, add_special_tokens=False).ids


def decode(model_path: str, ids) -> str:
    """Decode keeping special tokens."""
    return build_tokenizer(model_path).decode(list(ids), skip_special_tokens=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Tokenize text with the GGUF-built oracle tokenizer")
    ap.add_argument("--model", default=os.environ.get("SPECULA_MODEL"))
    ap.add_argument("text", nargs="+")
    a = ap.parse_args(argv)
    if not a.model:
        ap.error("--model (or $SPECULA_MODEL) is required")
    tok = build_tokenizer(a.model)
    for t in a.text:
        e = tok.encode(t, add_special_tokens=False)
        print(json.dumps({"text": t, "ids": e.ids, "tokens": e.tokens, "decoded": tok.decode(e.ids, skip_special_tokens=False)}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
