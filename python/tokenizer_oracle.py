#!/usr/bin/env python3
r"""Tokenizer oracle: a HuggingFace `tokenizers.Tokenizer` built from a GGUF's tokenizer metadata.

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

Pre-tokenizers (tokenizer.ggml.pre) beyond SmolLM2's, from the models' own tokenizer.json files:
* "qwen2": NFC normalizer, then Split(Qwen2 regex: like Llama 3's but single digits, Isolated)
  and ByteLevel(use_regex=False);
* "llama-bpe"/"llama3"/"llama-v3" (Llama 3): Split(regex with \p{N}{1,3}) and ByteLevel(use_regex=False),
  and a BPE with ignore_merges=True.

SentencePiece models (tokenizer.ggml.model = "llama", e.g. Gemma 3) are NOT built with
`tokenizers` here (the engine builds them as a byte-fallback BPE with merges derived from the
scores, the way transformers converts them); the oracle is instead an independent
re-implementation of llama.cpp's SPM tokenizer (`SpmOracle`), straight from the GGUF's pieces,
scores and token types:
  1. the raw text is cut at control / user-defined tokens (longest match first), which become
     their ids;
  2. in each remaining fragment ' ' becomes '▁' (and a '▁' is prepended when
     tokenizer.ggml.add_space_prefix is true);
  3. starting from single characters, the adjacent pair whose concatenation is a NORMAL piece
     with the highest score is merged (ties: leftmost), until no pair merges;
  4. a symbol that is not a piece is written as its UTF-8 bytes with the <0xXX> byte tokens.
Decoding concatenates the pieces, '▁' -> ' ', byte tokens -> raw bytes, then UTF-8.

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
import heapq

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def byte_chars() -> list[str]:
    """GPT-2's printable spelling of each byte value (`bytes_to_unicode`), indexed by the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


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


QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _split_then_bytes(regex: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def pre_tokenizer_for(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm",):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "qwen2":
        return _split_then_bytes(QWEN2_REGEX)
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return _split_then_bytes(LLAMA3_REGEX)
    raise NotImplementedError(f"tokenizer.ggml.pre={pre!r} is not modelled by this oracle")


def normalizer_for(pre: str | None):
    # Qwen2's tokenizer.json normalizes to NFC.
    return normalizers.NFC() if pre == "qwen2" else None


@functools.lru_cache(maxsize=4)
def _reader(model_path: str) -> GGUFReader:
    return GGUFReader(model_path)


@functools.lru_cache(maxsize=4)
def build_tokenizer(model_path: str) -> Tokenizer:
    reader = _reader(model_path)
    kind = _scalar(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') is modelled")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    types = _ints(reader, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate token strings in tokenizer.ggml.tokens")

    pre = _scalar(reader, "tokenizer.ggml.pre")
    # Meta-Llama-3's tokenizer.json: "ignore_merges": true (a pre-token that is a vocabulary entry is taken whole).
    ignore_merges = pre in ("llama-bpe", "llama3", "llama-v3")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer_for(pre)
    if normalizer_for(pre) is not None:
        tok.normalizer = normalizer_for(pre)
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


TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_BYTE = 6


class SpmOracle:
    """llama.cpp-style SentencePiece tokenizer from GGUF pieces and scores (see the module doc)."""

    def __init__(self, reader: GGUFReader):
        self.tokens = _strings(reader, "tokenizer.ggml.tokens")
        self.types = _ints(reader, "tokenizer.ggml.token_type")
        f = reader.fields["tokenizer.ggml.scores"]
        self.scores = [float(f.parts[i][0]) for i in f.data]
        self.add_space_prefix = bool(_scalar(reader, "tokenizer.ggml.add_space_prefix", True))
        self.normal = {}
        for i, t in enumerate(self.tokens):
            if self.types[i] == TOKEN_TYPE_NORMAL:
                self.normal.setdefault(t, i)
        self.any_id = {}
        for i, t in enumerate(self.tokens):
            self.any_id.setdefault(t, i)
        self.byte_id = {int(t[3:5], 16): i for i, t in enumerate(self.tokens) if self.types[i] == TOKEN_TYPE_BYTE}
        self.specials = sorted(
            {t for i, t in enumerate(self.tokens) if self.types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED) and t},
            key=len,
            reverse=True,
        )
        self.special_by_first = {}
        for t in self.specials:
            self.special_by_first.setdefault(t[0], []).append(t)

    def _partition(self, text: str):
        """[(is_special, str)]: special tokens matched longest-first at each position."""
        out, buf, i = [], [], 0
        while i < len(text):
            hit = next((t for t in self.special_by_first.get(text[i], ()) if text.startswith(t, i)), None)
            if hit is None:
                buf.append(text[i])
                i += 1
                continue
            if buf:
                out.append((False, "".join(buf)))
                buf = []
            out.append((True, hit))
            i += len(hit)
        if buf:
            out.append((False, "".join(buf)))
        return out

    def _merge(self, text: str) -> list[int]:
        sym = list(text)
        n = len(sym)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []

        def push(left):
            right = nxt[left]
            if right >= n:
                return
            cat = sym[left] + sym[right]
            tid = self.normal.get(cat)
            if tid is not None:
                heapq.heappush(heap, (-self.scores[tid], left, cat))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, cat = heapq.heappop(heap)
            right = nxt[left] if left < n else n
            if not alive[left] or right >= n or sym[left] + sym[right] != cat:
                continue  # stale
            sym[left] = cat
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left])
            push(left)
        ids = []
        i = 0
        while i < n:
            s = sym[i]
            tid = self.any_id.get(s)
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(self.byte_id[b] for b in s.encode("utf-8"))
            i = nxt[i]
        return ids

    def encode(self, text: str) -> list[int]:
        ids = []
        for special, frag in self._partition(text):
            if special:
                ids.append(self.any_id[frag])
                continue
            frag = frag.replace(" ", "\u2581")
            if self.add_space_prefix:
                frag = "\u2581" + frag
            ids.extend(self._merge(frag))
        return ids

    def decode(self, ids) -> str:
        out = bytearray()
        for i in ids:
            t = self.tokens[i]
            if self.types[i] == TOKEN_TYPE_BYTE:
                out.append(int(t[3:5], 16))
            else:
                out.extend(t.replace("\u2581", " ").encode("utf-8"))
        s = out.decode("utf-8", errors="replace")
        if self.add_space_prefix and s.startswith(" "):
            s = s[1:]
        return s


@functools.lru_cache(maxsize=4)
def build_spm(model_path: str) -> SpmOracle:
    return SpmOracle(_reader(model_path))


@functools.lru_cache(maxsize=8)
def tokenizer_kind(model_path: str) -> str:
    """tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)."""
    return _scalar(_reader(model_path), "tokenizer.ggml.model")


def encode(model_path: str, text: str) -> list[int]:
    """Plain encode: no BOS, special-token strings in `text` become their special ids."""
    if tokenizer_kind(model_path) == "llama":
        return build_spm(model_path).encode(text)
    return build_tokenizer(model_path).encode(text, add_special_tokens=False).ids


def decode(model_path: str, ids) -> str:
    """Decode keeping special tokens."""
    if tokenizer_kind(model_path) == "llama":
        return build_spm(model_path).decode(ids)
    return build_tokenizer(model_path).decode(list(ids), skip_special_tokens=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Tokenize text with the GGUF-built oracle tokenizer")
    ap.add_argument("--model", default=os.environ.get("SPECULA_MODEL"))
    ap.add_argument("text", nargs="+")
    a = ap.parse_args(argv)
    if not a.model:
        ap.error("--model (or $SPECULA_MODEL) is required")
    for t in a.text:
        ids = encode(a.model, t)
        print(json.dumps({"text": t, "ids": ids, "decoded": decode(a.model, ids)}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
