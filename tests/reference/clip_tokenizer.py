"""Reference token ids from open_clip's own tokenizer, for tests/unit/text/test_clip_tokenizer.cpp.

Writes a JSON file: {"vocab": path of the vocabulary file open_clip reads, "open_clip": version,
"cases": [{"text": ..., "kind": ..., "open_clip": [77 ids], "mojibake": bool}, ...]} for a corpus of
strings drawn (with a fixed seed) from what captions hold and what breaks tokenizers: captions of
real vocabulary words, punctuation and digits, accented and non-Latin scripts, decomposed forms,
emoji sequences, HTML entities, curly quotes, ligatures, full-width forms, control characters and
terminal escapes, line breaks, captions far past 77 tokens, empty and blank strings, contractions and
the special tokens' own names, and random assigned code points.

"mojibake" marks the strings ftfy.fix_text changes differently with its mojibake repair on than off
(text/clean.h says why ddm does not repair mojibake).

With a directory DIR, also the ids of transformers' CLIPTokenizer (max_length 77, truncated and
padded) loaded from the two directories it writes there (transformers_dirs), as "json" and "legacy".

Usage: python clip_tokenizer.py OUT.json [N_PER_KIND [DIR]]   (run by the reference environment's python)
"""
import html.entities
import json
import os
import random
import sys
import unicodedata

import ftfy
import open_clip
from open_clip.tokenizer import SimpleTokenizer, default_bpe


def assigned(c):
    """An assigned code point of Python's Unicode (14.0 in 3.11), not a surrogate or private use."""
    return unicodedata.category(chr(c)) not in ("Cn", "Cs", "Co")


def corpus(rng, per_kind, tok):
    words = [s[:-4] for s in tok.encoder if s.endswith("</w>") and s[:-4].isalpha() and s[:-4].isascii()]
    entities = sorted(html.entities.html5)
    blocks = {
        "latin": [(0xC0, 0x24F), (0x1E00, 0x1EFF)],
        "greek_cyrillic": [(0x370, 0x3FF), (0x400, 0x4FF)],
        "cjk": [(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3)],
        "scripts": [(0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x5D0, 0x5EA)],
        "emoji": [(0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F900, 0x1F9FF), (0x2600, 0x26FF)],
    }
    specials = ["\u2018", "\u2019", "\u201c", "\u201d", "\u02bc", "\u201a", "\u201e", "\ufb01", "\ufb02",
                "\ufb00", "\u0132", "\u01c4", "\uff21", "\uff41", "\uff10", "\u3000", "\uff01", "\x85", "\x80",
                "\x93", "\x94", "\x9b", "\x00", "\x07", "\x1b[31m", "\x1b[0m", "\x1b[1;2H", "\r\n", "\r",
                "\u2028", "\u2029", "\t", "\x0b", "\x0c", "\xa0", "\u200b", "\ufeff", "\u00ad", "\x7f",
                "\u0301", "\u0308", "\u2066", "\ufffc", "\u180e", "\x1c", "\x1f", "\u200a", "\u205f"]

    def caption(lo, hi):
        out = []
        for _ in range(rng.randint(lo, hi)):
            w = rng.choice(words)
            r = rng.random()
            w = w.capitalize() if r < 0.2 else w.upper() if r < 0.25 else w
            out.append(w + (rng.choice([",", ".", "!", "?", ";", ":", "'s", "'t", "'re", "'ll", "'d", "'m", "'ve"])
                            if rng.random() < 0.15 else ""))
        return " ".join(out)

    def from_blocks(name, lo, hi):
        ranges = blocks[name]
        chars = []
        for _ in range(rng.randint(lo, hi)):
            a, b = rng.choice(ranges)
            c = rng.randint(a, b)
            while not assigned(c):
                c = rng.randint(a, b)
            chars.append(chr(c))
            if rng.random() < 0.2:
                chars.append(" ")
        return "".join(chars)

    def entity():
        r = rng.random()
        if r < 0.5:
            return "&" + rng.choice(entities)
        if r < 0.6:
            return "&#%d;" % rng.choice([0, 13, 65, 128, 150, 0x2019, 0xD800, 0x110000, 0xFFFE, 0x1F600, 7, 99999999999])
        if r < 0.7:
            return "&#x%X%s" % (rng.choice([0x41, 0x80, 0x9F, 0xDFFF, 0x10FFFF, 0x1F600, 0xB]), rng.choice([";", ""]))
        if r < 0.8:
            return "&" + rng.choice(["amp;lt;", "AMP;", "LT;", "QUOT;", "amplt", "notin", "noti", "ampx;", "#;", "#x;",
                                     "", "&", "Eacute", "EACUTE;", "eacute;", "hellip;", "nbsp", "nbsp;", "copy2"])
        return "&" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyzAB0123456789#;") for _ in range(rng.randint(1, 40)))

    kinds = {
        "caption": lambda: caption(3, 30),
        "ascii": lambda: "".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 60))),
        "digits_punct": lambda: "".join(rng.choice("0123456789.,;:!?-_'\"()[]{}<>/\\|@#$%^&*+=~` ")
                                        for _ in range(rng.randint(1, 40))),
        "latin": lambda: from_blocks("latin", 1, 30),
        "decomposed": lambda: unicodedata.normalize("NFD", from_blocks("latin", 1, 20) + caption(1, 5)),
        "greek_cyrillic": lambda: from_blocks("greek_cyrillic", 1, 30),
        "cjk": lambda: from_blocks("cjk", 1, 30),
        "scripts": lambda: from_blocks("scripts", 1, 30),
        "emoji": lambda: "".join(rng.choice([
            from_blocks("emoji", 1, 3), "\U0001F468\u200D\U0001F469\u200D\U0001F467", "\U0001F44D\U0001F3FD",
            "\U0001F1EB\U0001F1F7", "\u2764\uFE0F", "\u0031\uFE0F\u20E3", " ", caption(1, 3)])
            for _ in range(rng.randint(1, 8))),
        "html": lambda: " ".join(rng.choice([entity(), caption(1, 3), "<b>" if rng.random() < 0.1 else ""])
                                 for _ in range(rng.randint(1, 6))),
        "fixes": lambda: "".join(rng.choice([rng.choice(specials), caption(1, 2), " "]) for _ in range(rng.randint(1, 10))),
        "lines": lambda: rng.choice(["\n", "\r\n", "\n\n"]).join(
            rng.choice([caption(1, 5), entity(), "a<b", rng.choice(specials)]) for _ in range(rng.randint(2, 5))),
        "long": lambda: caption(60, 400),
        "edge": lambda: rng.choice(["", " ", "   ", "\t\n", "\u3000", "<start_of_text>", "<end_of_text>",
                                    "a <end_of_text> b", "<START_OF_TEXT>hi", "it's", "IT'S", "'s", "''s", "we'LL",
                                    "'", "''", "a'b", "<|endoftext|>", "x" * 500, "\u0130stanbul", "\u03a3\u0391\u03a3",
                                    "stra\u00dfe", "\u017fs", "\u212a", "\u1e9e", "[CLS] a [SEP]", "[MASK]ed",
                                    "##ing", "un##able", "[UNK]", "[pad]", "\U0002B830\U0002B925",
                                    "pneumonoultramicroscopicsilicovolcanoconiosis" * 3]) + rng.choice(["", " ", caption(0, 3)]),
        "random": lambda: "".join(chr(c) for c in (rng.choice([rng.randint(0x20, 0x2FFF), rng.randint(0x3000, 0xFFFF),
                                                                rng.randint(0x10000, 0x1FFFF)]) for _ in range(rng.randint(1, 30)))
                                  if assigned(c)),
    }
    for kind, make in kinds.items():
        for _ in range(per_kind):
            yield kind, make()


def transformers_dirs(tok, root):
    """Two tokenizer directories of CLIP's vocabulary as transformers reads them: `json/` written by
    transformers' own save_pretrained (tokenizer.json + tokenizer_config.json, padding with
    <|endoftext|> as SD 1.x's), and `legacy/` in the older layout hub repositories keep (vocab.json +
    merges.txt + tokenizer_config.json, padding with "!" as SD 2.x's), loaded back by transformers."""
    from transformers import CLIPTokenizer
    vocab = dict(tok.encoder)
    vocab["<|startoftext|>"] = vocab.pop("<start_of_text>")
    vocab["<|endoftext|>"] = vocab.pop("<end_of_text>")
    merges = [m for m, _ in sorted(tok.bpe_ranks.items(), key=lambda kv: kv[1])]
    CLIPTokenizer(vocab=vocab, merges=merges).save_pretrained(os.path.join(root, "json"))
    legacy = os.path.join(root, "legacy")
    os.makedirs(legacy)
    with open(os.path.join(legacy, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(legacy, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(a + " " + b + "\n" for a, b in merges))
    with open(os.path.join(legacy, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "pad_token": "!",
                   "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, f)
    return {name: CLIPTokenizer.from_pretrained(os.path.join(root, name)) for name in ("json", "legacy")}


def main():
    out_path = sys.argv[1]
    per_kind = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    hf_root = sys.argv[3] if len(sys.argv) > 3 else None
    tok = SimpleTokenizer()
    rng = random.Random(20261128)
    texts, kinds = [], []
    for kind, text in corpus(rng, per_kind, tok):
        texts.append(text)
        kinds.append(kind)
    ids = {"open_clip": tok(texts).tolist()}
    if hf_root:
        for name, hf in transformers_dirs(tok, hf_root).items():
            ids[name] = hf(texts, padding="max_length", max_length=77, truncation=True)["input_ids"]
    cases = []
    for i, (text, kind) in enumerate(zip(texts, kinds)):
        mojibake = ftfy.fix_text(text) != ftfy.fix_text(text, fix_encoding=False)
        cases.append({"text": text, "kind": kind, "mojibake": mojibake, **{k: v[i] for k, v in ids.items()}})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"vocab": default_bpe(), "open_clip": open_clip.__version__, "cases": cases}, f)


if __name__ == "__main__":
    main()
