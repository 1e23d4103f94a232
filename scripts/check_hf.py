"""Held-out check of `moe export` and `moe import` against Hugging Face transformers itself.

For each norm placement (pre-norm -> OlmoeForCausalLM, reordered -> FlexOlmoForCausalLM) it trains
a tiny model with moe.c, exports it, loads it with AutoModelForCausalLM.from_pretrained (no missing,
unexpected or mismatched keys allowed), and compares transformers' cross-entropy on the validation
tokens with `moe eval`'s (fp32 within 1e-5 relative; bf16 reported), checks the byte-level tokenizer
against `moe data prepare`'s tokens, and imports what transformers' save_pretrained writes back
(bit-identical tensors). Then it imports models made by transformers: tied embeddings, fp16 and
bf16 weights, and sharded files. Run through scripts/check_hf.sh; exits 1 on any failure.
"""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, OlmoeConfig, OlmoeForCausalLM

transformers.logging.set_verbosity_error()  # its progress bars and notes would bury the results
transformers.logging.disable_progress_bar()
MOE = "./moe"
VAL = "data/tinyshakespeare_val.npy"
SEQ, N_SEQS, FP32_TOL, BF16_TOL = 64, 32, 1e-5, 2e-2
TINY = ("model.d_model=64 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.n_experts=8 model.top_k=2 "
        f"model.expert_hidden=64 train.seq_len={SEQ} train.micro_batch=8 train.steps=20 train.warmup=5 "
        "train.eval_every=0 train.log_every=100").split()
CASES = [  # placement, the class transformers must build, keys beyond TINY
    ("pre", "OlmoeForCausalLM", []),
    ("reordered", "FlexOlmoForCausalLM", ["model.head_dim=24", "model.norm_topk_prob=true",
                                          "model.rope_theta=500000", "model.norm_eps=1e-6"]),
]
failures = []


def check(ok, what):
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


def moe(*args):
    r = subprocess.run([MOE, *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"moe {' '.join(args)} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


def moe_loss(ckpt):
    out = moe("eval", "--ckpt", ckpt, "--data", VAL, "--max-seqs", str(N_SEQS))
    return float(re.search(r"val loss ([0-9.]+)", out).group(1))


def val_tokens():
    return np.fromfile(VAL, dtype="<u2").astype(np.int64)


def hf_loss(model, seq=SEQ):
    """Mean cross-entropy of the first N_SEQS sequences of seq tokens, read as moe eval reads them."""
    tok = val_tokens()
    seqs = torch.tensor(np.stack([tok[j * seq:j * seq + seq + 1] for j in range(N_SEQS)]))
    with torch.no_grad():
        logits = model(seqs[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1)).item()


def load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    clean = not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    return model.eval(), clean, info


def checksums(files):
    """{tensor: xxh3_64} of moe.c safetensors files, from their headers."""
    sums = {}
    for f in files:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            meta = json.loads(fh.read(n))["__metadata__"]
        sums.update({k[8:]: v for k, v in meta.items() if k.startswith("xxh3_64:")})
    return sums


def ckpt_sums(run_dir):
    step = sorted(os.listdir(run_dir), key=lambda s: int(s[5:]) if s.startswith("step-") else -1)[-1]
    d = os.path.join(run_dir, step)
    return checksums([os.path.join(d, f) for f in os.listdir(d) if f.startswith("model-")])


def rel(a, b):
    return abs(a - b) / abs(b)


def check_tokenizer(path):
    tok = AutoTokenizer.from_pretrained(path)
    ids = val_tokens()
    text = bytes(ids[:-1].astype(np.uint8)).decode("utf-8")
    got = tok(text)["input_ids"]
    check(got == ids[:-1].tolist() and tok.eos_token_id == ids[-1] and tok.decode(got) == text,
          f"byte-level tokenizer: {len(got)} ids of the validation text = moe data prepare's, EOS {tok.eos_token_id}, "
          "decode gives the text back")


def check_case(tmp, placement, cls, keys, results):
    print(f"{placement} norm -> {cls}")
    run, fp32, bf16, saved, back = (os.path.join(tmp, placement + s) for s in ("", ".fp32", ".bf16", ".saved", ".back"))
    moe("train", *TINY, *keys, f"model.norm_placement={placement}", f"train.out={run}")
    ref = moe_loss(run)
    moe("export", run, fp32)
    moe("export", run, bf16, "--dtype", "bf16")
    model, clean, info = load(fp32)
    check(type(model).__name__ == cls and clean, f"fp32 export loads as {type(model).__name__}, loading info {info}")
    loss = hf_loss(model)
    check(rel(loss, ref) < FP32_TOL, f"fp32: transformers loss {loss:.7f}, moe eval {ref:.6f}: "
          f"relative difference {rel(loss, ref):.2e} (limit {FP32_TOL:g})")
    model_bf16, clean16, info16 = load(bf16)
    loss16 = hf_loss(model_bf16)
    check(clean16 and model_bf16.dtype == torch.bfloat16 and rel(loss16, ref) < BF16_TOL,
          f"bf16: loads as {model_bf16.dtype}, loss {loss16:.5f}: relative difference {rel(loss16, ref):.2e} "
          f"(limit {BF16_TOL:g})")
    check_tokenizer(fp32)
    model.save_pretrained(saved)  # transformers' own files: its header order, no checksums
    moe("import", saved, back)
    check(ckpt_sums(back) == ckpt_sums(run) and moe_loss(back) == ref, "save_pretrained of the export, imported: bit-identical tensors, same moe eval loss")
    results.append((cls, ref, loss, rel(loss, ref), loss16))


def check_imports(tmp):
    print("models made by transformers -> moe import")
    cfg = OlmoeConfig(vocab_size=257, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=True, eos_token_id=256, pad_token_id=None)
    torch.manual_seed(0)
    model = OlmoeForCausalLM(cfg).eval()
    for name, dtype, shard in (("fp32, tied embeddings", torch.float32, "5GB"), ("fp16", torch.float16, "5GB"),
                               ("bf16, shards of 40KB", torch.bfloat16, "40KB")):
        d = os.path.join(tmp, "made-" + name.split(",")[0] + shard)
        model.to(dtype).save_pretrained(d, max_shard_size=shard)
        moe("import", d, d + ".moe")
        # The rounded weights, in fp32 like moe.c, on the sequences of the import's train.seq_len (no
        # moe_c_config here: moe.c's default).
        seq = json.load(open(os.path.join(d + ".moe", "step-0", "train_state.json")))["config"]["train"]["seq_len"]
        ref = hf_loss(model.float(), seq)
        loss = moe_loss(d + ".moe")
        files = len([f for f in os.listdir(d) if f.endswith(".safetensors")])
        check(rel(loss, ref) < FP32_TOL, f"{name} ({files} file{'s' * (files > 1)}): moe eval {loss:.6f}, transformers "
              f"{ref:.7f}: relative difference {rel(loss, ref):.2e}")


def main():
    start = time.time()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    results = []
    with tempfile.TemporaryDirectory(prefix="moe-check-hf-") as tmp:
        for placement, cls, keys in CASES:
            check_case(tmp, placement, cls, keys, results)
        check_imports(tmp)
    print("\n| class | moe eval (fp32) | transformers fp32 | relative difference | transformers bf16 |")
    print("|---|---|---|---|---|")
    for cls, ref, loss, r, loss16 in results:
        print(f"| {cls} | {ref:.6f} | {loss:.7f} | {r:.2e} | {loss16:.5f} |")
    print(f"\n{len(failures)} failure(s) in {time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
