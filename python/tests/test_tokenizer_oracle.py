"""`specula debug tokenize` vs the Python oracle tokenizer built from the same GGUF.

Contract: input a JSON list of strings; output a list of {"ids": [...], "decoded": "..."} where ids
is a plain encode (no BOS; special-token text such as <|im_start|> becomes the special id) and
decoded = decode(ids) keeping special tokens.
"""

import json

import pytest

import tokenizer_oracle as to
from conftest import run_specula, write_json
from prompts import PROMPTS

CORPUS = [
    "",
    " ",
    "a",
    "Hello, world!",
    "The capital of France is",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     spaces    between words",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\nand\r\nCRLF\r\n",
    "\n\n\n",
    " \t \n mixed \u00a0 whitespace \u3000 ideographic space",
    "emoji: 🙂 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "CJK: 北京是中国的首都。東京は日本の首都です。서울은 한국의 수도입니다.",
    "Кириллица: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "العربية: القاهرة هي عاصمة مصر.",
    "עברית, हिन्दी, ไทย, Ελληνικά, Tiếng Việt có dấu",
    "digits: 0 1 12 123 1234567 3.14159 -42 1e-10 1,000,000",
    "a  1234 x",
    "  1  22   333",
    "year2024and99problems",
    "URL: https://example.com/path/to/page?query=1234567&lang=en#section-2",
    "email: someone.else+tag@example.co.uk",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n\tprintln!(\"{:?}\", v);\n}\n",
    "<div class=\"a\">&amp; &lt;tag&gt;</div>",
    "It's, don't, we'll, they're, I'VE, she'D",
    "MiXeD CaSe AND ALLCAPS words",
    "punctuation!!! ??? ... --- ___ *** ~~~ ``` '''",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|><|im_start|>",
    "<repo_name>specula<file_sep>src/main.rs",
    "not special: <|im_start| and <im_start> and |im_end|>",
    "combining: e\u0301 a\u0308 n\u0303 (NFD) vs é ä ñ (NFC)",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∞",
    "ß Æ ø Ł ı İ ﬁ",
] + list(PROMPTS.values())


def test_oracle_roundtrips_and_special_tokens(model_path, oracle_tokenizer):
    """Self-check of the oracle (no binary needed)."""
    for text in CORPUS:
        ids = to.encode(model_path, text)
        assert to.decode(model_path, ids) == text, text
    assert to.encode(model_path, "<|im_start|>user\nhi<|im_end|>")[0] == oracle_tokenizer.token_to_id("<|im_start|>")
    assert to.encode(model_path, "<|im_start|>user\nhi<|im_end|>")[-1] == oracle_tokenizer.token_to_id("<|im_end|>")
    # SmolLM2 pre-tokenization splits every digit off (tokenizer.ggml.pre = "smollm"), so a run of
    # spaces before a number stays one token: "a", "ĠĠ", "1", "2", "3", "4", "Ġx".
    toks = oracle_tokenizer.encode("a  1234 x", add_special_tokens=False).tokens
    assert toks == ["a", "ĠĠ", "1", "2", "3", "4", "Ġx"], toks
    # No BOS is added by a plain encode.
    assert to.encode(model_path, "hi") == [oracle_tokenizer.token_to_id("hi")]


@pytest.fixture(scope="module")
def engine_tokens(model_path, specula_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    inp = write_json(d / "in.json", CORPUS)
    out = d / "out.json"
    run_specula(specula_bin, ["debug", "tokenize", "--model", model_path, "--input", str(inp), "--output", str(out)])
    res = json.loads(out.read_text(encoding="utf-8"))
    assert isinstance(res, list) and len(res) == len(CORPUS)
    return res


@pytest.mark.parametrize("idx", range(len(CORPUS)), ids=lambda i: repr(CORPUS[i][:30]))
def test_engine_tokenize_matches_oracle(model_path, oracle_tokenizer, engine_tokens, idx):
    text = CORPUS[idx]
    got = engine_tokens[idx]
    want = to.encode(model_path, text)
    if got["ids"] != want:
        ours = [oracle_tokenizer.id_to_token(i) for i in got["ids"]]
        theirs = [oracle_tokenizer.id_to_token(i) for i in want]
        pytest.fail(f"ids differ for {text!r}\n engine: {ours}\n oracle: {theirs}")
    assert got["decoded"] == text
