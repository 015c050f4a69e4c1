"""`specula debug tokenize` vs the Python oracle tokenizer built from the same GGUF.

Contract: input a JSON list of strings; output a list of {"ids": [...], "decoded": "..."} where ids
is a plain encode (no BOS; special-token text such as <|im_start|> becomes the special id) and
decoded = decode(ids) keeping special tokens.
"""

import json
import os
import unicodedata

import pytest

import tokenizer_oracle as to
from conftest import missing, run_specula, write_json
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


# --- Qwen2.5 (byte-level BPE, pre "qwen2") and Gemma 3 (SentencePiece) GGUF files -------------

EXTRA_MODELS = {
    "qwen05": ("SPECULA_MODEL_QWEN05", "/root/.cache/specula/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "gemma": ("SPECULA_MODEL_GEMMA", "/root/.cache/specula/models/gemma-3-270m-q4_k_m.gguf"),
}


def extra_model_path(name: str) -> str:
    """The model's path from its env var (or the default); skips when missing, fails under CI."""
    var, default = EXTRA_MODELS[name]
    p = os.environ.get(var) or default
    if not os.path.isfile(p):
        missing(f"{var}={p} does not exist")
    return p


EXTRA_CORPUS = CORPUS + [
    "<start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk> and not special: <start_of_turn <end_of_turn>>",
    "literal byte-token text: <0x41> <0xFF>",
    "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nend",
    "\t\t\t\tindented\n\t\t\t\t\tdeeper\n" + " " * 37 + "spaces",
    "a" * 300 + " " + "ab" * 100,
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<|fim_prefix|>def f(<|fim_suffix|>):\n    pass<|fim_middle|>",
    "unicode beyond the BMP: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 🀄 \U0010FFFD",
    "control chars: \x00\x01\x1f\x7f end",
]


def expected_decode(name: str, text: str) -> str:
    # Qwen2's tokenizer normalizes to NFC (its tokenizer.json does; the engine follows).
    return unicodedata.normalize("NFC", text) if name == "qwen05" else text


@pytest.fixture(scope="module", params=sorted(EXTRA_MODELS))
def extra_model(request):
    return request.param, extra_model_path(request.param)


@pytest.fixture(scope="module")
def extra_engine_tokens(extra_model, specula_bin, tmp_path_factory):
    name, path = extra_model
    d = tmp_path_factory.mktemp(f"tok-{name}")
    inp = write_json(d / "in.json", EXTRA_CORPUS)
    out = d / "out.json"
    run_specula(specula_bin, ["debug", "tokenize", "--model", path, "--input", str(inp), "--output", str(out)])
    res = json.loads(out.read_text(encoding="utf-8"))
    assert isinstance(res, list) and len(res) == len(EXTRA_CORPUS)
    return name, path, res


def test_extra_oracle_roundtrips(extra_model):
    name, path = extra_model
    for text in EXTRA_CORPUS:
        assert to.decode(path, to.encode(path, text)) == expected_decode(name, text), text


def test_extra_oracle_special_tokens(extra_model):
    name, path = extra_model
    if name == "gemma":
        spm = to.build_spm(path)
        ids = to.encode(path, "<start_of_turn>user\nhi<end_of_turn>\n")
        assert ids[0] == spm.any_id["<start_of_turn>"] == 105 and ids[-2] == spm.any_id["<end_of_turn>"] == 106
        assert to.encode(path, "\n\n") == [108]  # user-defined newline runs are whole tokens
        assert to.encode(path, "é") == [spm.normal["é"]] and to.encode(path, "\x00") == [spm.byte_id[0]]
    else:
        assert to.encode(path, "<|im_start|>user\nhi<|im_end|>")[0] == 151644
        assert to.encode(path, "12345") == [16, 17, 18, 19, 20]  # single digits


@pytest.mark.parametrize("idx", range(len(EXTRA_CORPUS)), ids=lambda i: repr(EXTRA_CORPUS[i][:30]))
def test_extra_engine_tokenize_matches_oracle(extra_engine_tokens, idx):
    name, path, res = extra_engine_tokens
    text = EXTRA_CORPUS[idx]
    got = res[idx]
    want = to.encode(path, text)
    if got["ids"] != want:
        pytest.fail(f"{name}: ids differ for {text!r}\n engine: {got['ids']}\n oracle: {want}")
    assert got["decoded"] == expected_decode(name, text)
