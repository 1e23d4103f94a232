#!/usr/bin/env python3
"""Throughput of `moe data prepare --tokenizer` against Hugging Face `tokenizers` (encode_batch) on
the same text, tokenizer and thread count; checks that both give the same ids. Not needed to build
or test moe.c (docs/PERF.md records what it printed).

    pip install tokenizers
    python3 scripts/bench_tokenizer.py --threads 2

The text: data/tinyshakespeare.txt and the Python standard library's .py files (sorted by name, up to
--mb MB in all), cut at line starts into documents of at most --doc-kb KB (tokenizers slows down on
long documents), each written to a file of its own for moe.c (one document per file). The tokenizers: GPT-2's layout (ByteLevel with its pattern)
and cl100k's (Split with its pattern, then ByteLevel), trained here on that text with --vocab ids.
Each side's time is its encoding alone (tokenizers: encode_batch on the documents already in
memory; moe.c: the time it prints, between reading and writing), best of --repeat runs; the
wall time of the whole `moe data prepare` command (loading the tokenizer, reading, encoding,
writing) is printed too, and the CPU time of both (all threads: tokenizers' encode_batch, the whole
moe.c command), which a machine busy with other work disturbs less than wall time.
"""
import argparse
import glob
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_documents(text, limit):
    docs, start = [], 0
    while start < len(text):
        end = min(start + limit, len(text))
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        docs.append(text[start:end])
        start = end
    return docs


def corpus_files(mb):
    files = [os.path.join(ROOT, "data", "tinyshakespeare.txt")]
    total = os.path.getsize(files[0])
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        if total >= mb * 1e6:
            break
        try:
            with open(f, "rb") as fh:
                data = fh.read()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if data:
            files.append(f)
            total += len(data)
    return files, total


def train(kind, docs, vocab, path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(CL100K), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(path)
    return tok


def bench_hf(tok, docs, repeat):
    best = best_cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = tok.encode_batch(docs, add_special_tokens=False)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu, out


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def bench_moe(files, tok_path, threads, repeat, out_path):
    best_encode = best_wall = best_cpu = float("inf")
    cmd = [os.path.join(ROOT, "moe"), "data", "prepare", *files, out_path, "--tokenizer", tok_path,
           "--threads", str(threads)]
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), children_cpu()
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        best_wall = min(best_wall, time.perf_counter() - t0)
        best_cpu = min(best_cpu, children_cpu() - c0)
        line = next(l for l in r.stdout.splitlines() if l.startswith("encoded"))
        best_encode = min(best_encode, float(line.split(" in ")[1].split(" s")[0]))
    return best_encode, best_wall, best_cpu, " ".join(cmd[:3]) + f" <{len(files)} files> OUT --tokenizer T --threads {threads}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=float, default=5)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--doc-kb", type=float, default=16)
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before tokenizers starts its thread pool
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    sources, total = corpus_files(args.mb)
    docs = [d for f in sources for d in split_documents(open(f, encoding="utf-8").read(), int(args.doc_kb * 1000))]
    print(f"text: {len(sources)} files, {total / 1e6:.2f} MB, {len(docs)} documents; {args.threads} threads; "
          f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, d in enumerate(docs):
            files.append(os.path.join(tmp, f"doc{i:05d}.txt"))
            with open(files[-1], "w", encoding="utf-8") as f:
                f.write(d)
        for kind in ("gpt2", "cl100k"):
            tok_path = os.path.join(tmp, f"{kind}.json")
            tok = train(kind, docs, args.vocab, tok_path)
            hf_sec, hf_cpu, encodings = bench_hf(tok, docs, args.repeat)
            out = os.path.join(tmp, "out.npy")
            moe_sec, wall, moe_cpu, cmd = bench_moe(files, tok_path, args.threads, args.repeat, out)
            eos = tok.token_to_id("<|endoftext|>")
            want = [i for e in encodings for i in e.ids + [eos]]
            width = 2 if tok.get_vocab_size() <= 65536 else 4
            with open(out, "rb") as f:
                data = f.read()
            got = [int.from_bytes(data[i:i + width], "little") for i in range(0, len(data), width)]
            same = "same ids" if got == want else f"IDS DIFFER ({len(got)} vs {len(want)} tokens)"
            mb = total / 1e6
            print(f"{kind}-style, vocab {tok.get_vocab_size()}, {len(want)} tokens, {same}:\n"
                  f"  tokenizers encode_batch {mb / hf_sec:.1f} MB/s ({hf_sec:.3f} s), {mb / hf_cpu:.1f} MB per CPU "
                  f"second\n  moe.c encoding {mb / moe_sec:.1f} MB/s ({moe_sec:.3f} s); whole command {mb / wall:.1f} "
                  f"MB/s ({wall:.3f} s), {mb / moe_cpu:.1f} MB per CPU second")
    print("command:", cmd, f"(load average after: {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
