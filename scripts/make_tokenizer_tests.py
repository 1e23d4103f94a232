#!/usr/bin/env python3
"""Regenerates the tokenizer test data in tests/data/tokenizers/ with Hugging Face `tokenizers`.

Not needed to build or test moe.c: the files it writes are committed, and the C tests
(tests/test_tokenizer.c) only read them. Run it after changing the cases or the tokenizers:

    pip install tokenizers
    python3 scripts/make_tokenizer_tests.py            # the expected ids, from the committed tokenizers
    python3 scripts/make_tokenizer_tests.py --train    # also trains the three tokenizers again

It also writes the seed inputs of the tokenizer fuzz harness (tests/fuzz/corpus/tokenizer: a small
tokenizer.json, a NUL byte, a chunk-size byte, a text).

The tokenizers (trained on data/tinyshakespeare.txt plus the multilingual lines below):
  gpt2-style.json      ByteLevel pre-tokenizer with GPT-2's pattern (as GPT-2's own file), merges
                       as "a b" strings, <|endoftext|>
  cl100k-style.json    Split with cl100k's pattern then ByteLevel without its pattern (as OLMo 2's
                       dolma2 and Llama 3), merges as pairs, ignore_merges, <|endoftext|> <|pad|>
  extras.json          a literal Split with behavior Removed, ByteLevel with add_prefix_space, and
                       added tokens with lstrip, rstrip, single_word, normalized, spaces in them
cases.json holds every case's text (hex) and, per tokenizer, the ids `tokenizers` gives
(encode(text, add_special_tokens=False)). Text that is not UTF-8 cannot be given to `tokenizers`;
its expected ids are those moe.c defines (docs/FORMATS.md): the valid stretches encoded by
`tokenizers`, each maximal run of invalid bytes encoded by the BPE model alone as one piece. They
are made for the two tokenizers whose pre-tokenizer has no prefix space and removes nothing.
"""
import argparse
import json
import os
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "data", "tokenizers")
CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

LINES = [
    "Héllo wörld! Ça va? Où est la gare? Straße, Übermäßig, naïve café.",
    "日本語のテキストです。中文文本测试，包括标点符号！한국어 텍스트입니다.",
    "Привет, мир! Как дела? Ελληνικά γράμματα. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ numbers 1234567890 3.14159 1,000,000 ½ ² Ⅻ ٣",
    "Contractions: don't, I'M, they'll, we've, she'd, it's, YOU'RE, O'Neil's",
    "def f(x):\n\treturn x ** 2  # code\n\n\nif __name__ == '__main__':\r\n    print(f(3))",
    "   leading spaces, trailing spaces   \n\n\t\ttabs\t\tand\u00a0nbsp\u3000ideographic\u2028line",
]


def train(pre, vocab_size, specials, corpus):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def save(tok, name, edit):
    path = os.path.join(OUT, name)
    tok.save(path)
    with open(path) as f:
        j = json.load(f)
    edit(j)
    with open(path, "w") as f:
        json.dump(j, f, ensure_ascii=False, separators=(",", ":"))


def legacy_merges(j):
    j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]


def ignore_merges(j):
    j["model"]["ignore_merges"] = True


def train_all():
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt")) as f:
        corpus = [f.read()] + LINES * 300
    gpt2 = train(pre_tokenizers.ByteLevel(add_prefix_space=False), 2000, ["<|endoftext|>"], corpus)
    save(gpt2, "gpt2-style.json", legacy_merges)
    cl = train(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(CL100K), "isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
               3000, ["<|endoftext|>", "<|pad|>"], corpus)
    save(cl, "cl100k-style.json", ignore_merges)
    extras = train(pre_tokenizers.Sequence([pre_tokenizers.Split("||", "removed"),
                                            pre_tokenizers.ByteLevel(add_prefix_space=True)]),
                   600, ["<|endoftext|>"], corpus)
    extras.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True),
                               AddedToken("<r>", rstrip=True, special=True)])
    extras.add_tokens([AddedToken("[SW]", single_word=True), AddedToken("hello world"),
                       AddedToken("Ġcat"), AddedToken("<mask>x", normalized=False)])
    save(extras, "extras.json", lambda j: None)


def cases():
    long_text = "".join(LINES[i % len(LINES)] + ("\n" * (i % 3)) + " " * (i % 5) for i in range(150))
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), "rb") as f:
        long_bytes = f.read(12000) + long_text.encode()
    c = [
        ("empty", b""),
        ("ascii", b"Hello world! This is a test."),
        ("contractions", "don't I'M they'll WE'VE she'd it's O'Neil's 'S 'ſ".encode()),
        ("whitespace runs", b"a  b   c    d\t\te\n\nf\n\n\ng \n \n h   "),
        ("only whitespace", b" \t\n\r\n   \n"),
        ("crlf and tabs", b"line one\r\nline two\r\n\r\n\tindented\r\n"),
        ("digits", b"0 12 345 6789 1234567890 3.14159 -42 1e10 0x1F"),
        ("unicode spaces", "a\u00a0b\u2009c\u3000d\u2028e\u0085f\u200bg\x1ch".encode()),
        ("accents", "café naïve Straße façade élève ÅNGSTRÖM".encode()),
        ("cjk", "日本語のテキストです。中文文本测试，包括标点符号！".encode()),
        ("korean cyrillic greek", "한국어 텍스트 Привет мир Ελληνικά".encode()),
        ("rtl and devanagari", "مرحبا بالعالم שלום नमस्ते".encode()),
        ("emoji", "😀 🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 ❤️‍🔥 a😀b".encode()),
        ("combining marks", "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937".encode()),
        ("other numbers", "½ ² ³ Ⅻ ٣٤ ௰ 𝟙𝟚".encode()),
        ("punctuation", b"Hello, world... (really?) [yes]! {ok}; \"quotes\" 'single' -- em---dash"),
        ("code", b"def f(x):\n    return x**2  # square\n\nprint(f(3))\n"),
        ("special token", b"first document<|endoftext|>second document"),
        ("special tokens adjacent", b"<|endoftext|><|endoftext|> <|endoftext|>\n<|endoftext"),
        ("pad token", b"a<|pad|>b <|pad|>"),
        ("nul and controls", b"a\x00b\x01c\x7f\x1b[0m"),
        ("long word", b"a" * 3000),
        ("long mixed word", b"abcdefghij" * 300),
        ("long whitespace", b" " * 2000 + b"x" + b"\n" * 500 + b"y"),
        ("long document", long_bytes),
        ("invalid lone bytes", b"abc\xffdef\xfe ghi \x80\xbf"),
        ("invalid truncated", b"caf\xc3 \xe6\x97 end\xe6"),
        ("invalid overlong and surrogate", b"x\xc0\xafy\xed\xa0\x80z\xf4\x90\x80\x80w"),
        ("invalid next to spaces", b"a  \xff  b\n\xff\n \xfe\xfe\xfe c"),
        ("invalid mixed with valid", "é\xff日本".encode() + b"\xff" + "語😀".encode() + b"\xf0\x9f\x98"),
        ("mask lstrip", b"a <mask> b   <mask>x<mask>  <mask>"),
        ("rstrip", b"<r>   next <r>\n\tline<r>"),
        ("single word", "[SW] word a[SW]b [SW]. é[SW] ([SW])".encode()),
        ("added with space", b"say hello world and hello  world"),
        ("added spelled", "the Ġcat cat Ġcat".encode()),
        ("removed split", b"||a||b|||c||  ||"),
        ("prefix pieces", b"word||other words||  spaced"),
    ]
    return c


def valid_runs(data):
    """Splits bytes into (is_valid, bytes) runs: the strict UTF-8 characters, and the bytes no
    character takes."""
    text = data.decode("utf-8", errors="surrogateescape")
    runs = []
    for ch in text:
        bad = 0xDC80 <= ord(ch) <= 0xDCFF
        b = bytes([ord(ch) - 0xDC00]) if bad else ch.encode()
        if runs and runs[-1][0] == (not bad):
            runs[-1][1] += b
        else:
            runs.append([not bad, bytearray(b)])
    return runs


BYTE_CHARS = pre_tokenizers.ByteLevel.alphabet()


def byte_level(data):
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return "".join(chr(table[b]) for b in data)


def expected(tok, data):
    runs = valid_runs(data)
    if all(ok for ok, _ in runs):
        return tok.encode(data.decode(), add_special_tokens=False).ids
    ids = []
    for ok, run in runs:
        if ok:
            ids += tok.encode(run.decode(), add_special_tokens=False).ids
        else:
            ids += [t.id for t in tok.model.tokenize(byte_level(run))]
    return ids


def fuzz_seeds():
    """Small tokenizer.json files (the 256 bytes and a few merges) with texts, for the fuzz harness."""
    alphabet = byte_level(bytes(range(256)))
    merges = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["i", "n"], ["Ġ", "a"], ["e", "r"], ["Ġ", "Ġ"], ["ĠĠ", "ĠĠ"]]
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    split = {"type": "Split", "pattern": {"Regex": CL100K}, "behavior": "Isolated", "invert": False}
    byte_level_step = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    special = {"id": len(vocab), "content": "<|endoftext|>", "single_word": False, "lstrip": False,
               "rstrip": False, "normalized": False, "special": True}
    stripping = dict(special, id=len(vocab) + 1, content="<m>", lstrip=True, rstrip=True, single_word=True)
    seeds = {
        "gpt2_pairs": ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, merges, [special],
                       b"Hello the world, don't stop!\n\n  2024 <|endoftext|> again"),
        "cl100k_strings": ({"type": "Sequence", "pretokenizers": [split, byte_level_step]},
                           [" ".join(m) for m in merges], [special], "The  there\r\n\tin 12345 日本語 😀".encode()),
        "removed_prefix": ({"type": "Sequence", "pretokenizers": [
                               {"type": "Split", "pattern": {"String": "||"}, "behavior": "Removed", "invert": True},
                               {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}]},
                           merges, [special, stripping], b"a || b <m> c||<m>d\xff\xfe end"),
        "empty_matches": ({"type": "Sequence", "pretokenizers": [
                              {"type": "Split", "pattern": {"Regex": "x*|(?<=a)\\b"}, "behavior": "Isolated",
                               "invert": False}, byte_level_step]}, merges, [], "axxb ab\u0085 xa".encode()),
    }
    out = os.path.join(ROOT, "tests", "fuzz", "corpus", "tokenizer")
    os.makedirs(out, exist_ok=True)
    for name, (pre, m, added, text) in seeds.items():
        j = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": pre,
             "model": {"type": "BPE", "dropout": None, "unk_token": None, "vocab": vocab, "merges": m}}
        with open(os.path.join(out, name), "wb") as f:
            f.write(json.dumps(j, ensure_ascii=False).encode() + b"\0" + bytes([5]) + text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", action="store_true", help="train the three tokenizers again")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if args.train:
        train_all()
    names = ["gpt2-style.json", "cl100k-style.json", "extras.json"]
    toks = {n: Tokenizer.from_file(os.path.join(OUT, n)) for n in names}
    out = {"note": "generated by scripts/make_tokenizer_tests.py; texts in hex, ids from tokenizers",
           "cases": []}
    for name, data in cases():
        case = {"name": name, "hex": data.hex(), "ids": {}}
        valid = all(ok for ok, _ in valid_runs(data))
        for n, tok in toks.items():
            if valid or n != "extras.json":
                case["ids"][n] = expected(tok, data)
        out["cases"].append(case)
    fuzz_seeds()
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    sizes = {n: os.path.getsize(os.path.join(OUT, n)) for n in names + ["cases.json"]}
    print("wrote", ", ".join(f"{n} ({s // 1024} KiB)" for n, s in sizes.items()))


if __name__ == "__main__":
    sys.exit(main())
