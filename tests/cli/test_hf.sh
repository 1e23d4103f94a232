#!/usr/bin/env bash
# Command-line tests of `moe export` and `moe import` (Hugging Face): export then import gives
# bit-identical tensors for both norm placements, sharded exports have a correct index, options the
# transformers classes cannot express are refused by name, and an imported checkpoint trains on.
# (Loading the exports in transformers itself: scripts/check_hf.sh.)
# Prints one line per test and ends with "N passed, N failed".
set -u
cd "$(dirname "$0")/../.."
MOE=./moe
source tests/testlib.sh
make_tmp hf

TINY="model.d_model=32 model.n_layers=2 model.n_heads=2 model.n_kv_heads=1 model.n_experts=4
      model.top_k=2 model.expert_hidden=32 train.seq_len=32 train.micro_batch=4 train.eval_every=0
      train.log_every=100 train.warmup=1"
MF=model-00001-of-00001.safetensors

# header FILE: the JSON header of a safetensors file.
header() { local n; n=$(od -An -tu8 -N8 "$1" | tr -d ' '); head -c $((8 + n)) "$1" | tail -c "$n"; }
# sums FILE...: every tensor's "xxh3_64:NAME":"checksum" of the files, sorted (one per line).
sums() { for f in "$@"; do header "$f" | grep -o '"xxh3_64:[^"]*":"[0-9a-f]*"'; done | sort; }
# names FILE: the tensor names of a safetensors file, sorted.
names() { header "$1" | grep -o '"[^"]*":{"dtype"' | cut -d'"' -f2 | sort; }

train() { $MOE train $TINY train.steps=3 "$@" > "$tmp/train.log" 2>&1 || bad "training for the tests" "$(tail -3 "$tmp/train.log")"; }
train train.out="$tmp/pre"
train train.out="$tmp/reo" model.norm_placement=reordered

# ---------------------------------------------------------------- round trip, both placements
for run in pre reo; do
    out=$($MOE export "$tmp/$run" "$tmp/$run.hf" 2>&1) && out=$($MOE import "$tmp/$run.hf" "$tmp/$run.imp" 2>&1) &&
        [ "$(sums "$tmp/$run/step-3/$MF")" = "$(sums "$tmp/$run.imp/step-0/$MF")" ] && [ -n "$(sums "$tmp/$run/step-3/$MF")" ] &&
        ok "$run: export fp32 + import = bit-identical tensors" || bad "$run: export fp32 + import = bit-identical tensors" "$out"
    a=$($MOE eval --ckpt "$tmp/$run" --max-seqs 8 2>&1); b=$($MOE eval --ckpt "$tmp/$run.imp" --max-seqs 8 2>&1)
    [ "$a" = "$b" ] && grep -q "val loss" <<<"$a" && ok "$run: the import evaluates to the same loss" || bad "$run: the import evaluates to the same loss" "$a" "$b"
done
# The pre-norm export itself holds moe.c's tensors under their own names (the balancing bias aside).
[ "$(sums "$tmp/pre/step-3/$MF" | grep -v expert_bias)" = "$(sums "$tmp/pre.hf/model.safetensors")" ] &&
    ok "pre: exported tensors are the checkpoint's, bit for bit" || bad "pre: exported tensors are the checkpoint's, bit for bit" "$(diff <(sums "$tmp/pre/step-3/$MF") <(sums "$tmp/pre.hf/model.safetensors") | head -5)"
grep -q '"architectures": \[\s*"OlmoeForCausalLM"' <(tr -d '\n' < "$tmp/pre.hf/config.json") && grep -q '"model_type": "olmoe"' "$tmp/pre.hf/config.json" &&
    grep -q '"model_type": "flex_olmo"' "$tmp/reo.hf/config.json" && ok "config.json names the class of each placement" ||
    bad "config.json names the class of each placement" "$(head -5 "$tmp/pre.hf/config.json")"
flex=$(names "$tmp/reo.hf/model.safetensors")
grep -q "model.layers.1.post_feedforward_layernorm.weight" <<<"$flex" && grep -q "model.layers.1.post_attention_layernorm.weight" <<<"$flex" &&
    ! grep -q "input_layernorm" <<<"$flex" && ! grep -q "expert_bias" <<<"$flex" &&
    ok "reordered: FlexOlmo's norm names, no expert_bias" || bad "reordered: FlexOlmo's norm names, no expert_bias" "$flex"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json; do
    [ -s "$tmp/pre.hf/$f" ] || bad "export writes $f" "$(ls "$tmp/pre.hf")"
done
grep -q '"eos_token_id": 256' "$tmp/pre.hf/generation_config.json" && grep -q '"<|endoftext|>"' "$tmp/pre.hf/tokenizer.json" &&
    ok "byte vocabulary: generation config and byte-level tokenizer" || bad "byte vocabulary: generation config and byte-level tokenizer" "$(cat "$tmp/pre.hf/generation_config.json")"

# Tokenizers: a given tokenizer.json is copied as it is; another vocabulary without one gets none.
echo '{"model": {"type": "BPE", "vocab": {}}, "note": "some tokenizer"}' > "$tmp/tok.json"
$MOE export "$tmp/pre" "$tmp/tok" --tokenizer "$tmp/tok.json" > /dev/null 2>&1 && cmp -s "$tmp/tok.json" "$tmp/tok/tokenizer.json" &&
    ok "--tokenizer FILE is copied" || bad "--tokenizer FILE is copied" "$(ls "$tmp/tok")"
expect_error "--tokenizer of a missing file" "nope.json: cannot open tokenizer" $MOE export "$tmp/pre" "$tmp/never" --tokenizer "$tmp/nope.json"
train train.out="$tmp/v300" model.vocab_size=300
out=$($MOE export "$tmp/v300" "$tmp/v300.hf" 2>&1) && grep -q "tokenizer: none" <<<"$out" && [ ! -e "$tmp/v300.hf/tokenizer.json" ] &&
    grep -q '"eos_token_id": null' "$tmp/v300.hf/config.json" && ok "another vocabulary: no tokenizer, EOS null" || bad "another vocabulary: no tokenizer, EOS null" "$out"

# bf16: half the bytes; imported back as the bf16 values, which still evaluate.
$MOE export "$tmp/pre" "$tmp/bf16" --dtype bf16 > /dev/null 2>&1
# data_bytes FILE: the bytes of a safetensors file after its header.
data_bytes() { echo $(( $(stat -c %s "$1") - 8 - $(od -An -tu8 -N8 "$1" | tr -d ' ') )); }
big=$(data_bytes "$tmp/pre.hf/model.safetensors"); small=$(data_bytes "$tmp/bf16/model.safetensors")
header "$tmp/bf16/model.safetensors" | grep -q '"dtype":"BF16"' && ! header "$tmp/bf16/model.safetensors" | grep -q '"F32"' &&
    [ $((small * 2)) = "$big" ] && grep -q '"dtype": "bfloat16"' "$tmp/bf16/config.json" &&
    $MOE import "$tmp/bf16" "$tmp/bf16.imp" > /dev/null 2>&1 && $MOE eval --ckpt "$tmp/bf16.imp" --max-seqs 8 > /dev/null 2>&1 &&
    ok "bf16 export ($small of $big bytes) imports and evaluates" || bad "bf16 export imports and evaluates" "$small of $big bytes"

# ---------------------------------------------------------------- shards
$MOE export "$tmp/reo" "$tmp/shards" --max-shard-size 20KB > /dev/null 2>&1
n=$(ls "$tmp/shards" | grep -c '^model-[0-9]*-of-[0-9]*\.safetensors$')
last=$(ls "$tmp/shards" | grep '^model-' | tail -1)
[ "$n" -gt 2 ] && [ "$last" = "$(printf 'model-%05d-of-%05d.safetensors' "$n" "$n")" ] && [ ! -e "$tmp/shards/model.safetensors" ] &&
    [ -s "$tmp/shards/model.safetensors.index.json" ] && ok "--max-shard-size 20KB: $n shards and an index" || bad "--max-shard-size 20KB: shards and an index" "$(ls "$tmp/shards")"
too_big=0
for f in "$tmp"/shards/model-*.safetensors; do
    [ "$(data_bytes "$f")" -gt 20000 ] && [ "$(names "$f" | wc -l)" -gt 1 ] && too_big=1
done
[ $too_big = 0 ] && ok "no shard past the limit (but for a lone larger tensor)" || bad "no shard past the limit" "$(ls -l "$tmp/shards")"
# The index against its shards, with moe ckpt verify (a train_state.json beside it makes it a checkpoint).
cp -r "$tmp/shards" "$tmp/shards.ckpt" && cp "$tmp/reo/step-3/train_state.json" "$tmp/shards.ckpt/"
out=$($MOE ckpt verify "$tmp/shards.ckpt" 2>&1) && grep -qE "model: $n files, 45 tensors" <<<"$out" &&
    ok "sharded index: every tensor mapped to its shard, total_size right" || bad "sharded index: every tensor mapped to its shard, total_size right" "$out"
$MOE import "$tmp/shards" "$tmp/shards.imp" --max-shard-size 30KB > /dev/null 2>&1
k=$(ls "$tmp/shards.imp/step-0" | grep -c '^model-')
[ "$(sums "$tmp/reo/step-3/$MF")" = "$(sums "$tmp"/shards.imp/step-0/model-*.safetensors)" ] && [ "$k" -gt 1 ] &&
    $MOE ckpt verify "$tmp/shards.imp" > /dev/null 2>&1 &&
    ok "sharded export, sharded import ($k files): bit-identical, verified" || bad "sharded export, sharded import: bit-identical" "$(ls "$tmp/shards.imp/step-0")"

# ---------------------------------------------------------------- training on from an import
out=$($MOE train train.out="$tmp/pre.imp" train.steps=3 2>&1)
grep -q "resumed from .*step-0 (step 0) without optimizer state: the AdamW moments start from zero" <<<"$out" &&
    [ -d "$tmp/pre.imp/step-3" ] && ok "moe train resumes an import, fresh AdamW moments" || bad "moe train resumes an import, fresh AdamW moments" "$out"
out=$($MOE sample --ckpt "$tmp/pre.imp" --tokens 10 --prompt "A" 2>&1) && ok "moe sample runs an import" || bad "moe sample runs an import" "$out"

# ---------------------------------------------------------------- refusals
# refuse NAME PATTERN KEY VALUE: a checkpoint whose config has model.KEY = VALUE is not exported.
refuse() {
    rm -rf "$tmp/opt" && cp -r "$tmp/pre/step-3" "$tmp/opt"
    sed -i "s/\"$3\": [^,]*,/\"$3\": $4,/" "$tmp/opt/train_state.json"
    expect_error "refused: $1" "$2" $MOE export "$tmp/opt" "$tmp/never"
}
refuse "sigmoid router" "OlmoeForCausalLM cannot express model.router = sigmoid" router '"sigmoid"'
refuse "shared expert" "cannot express model.shared_hidden = 32 \(it has no shared expert" shared_hidden 32
refuse "dense first layers" "cannot express model.n_dense_layers = 1" n_dense_layers 1
refuse "per-head QK-norm" "cannot express model.qk_norm = head" qk_norm '"head"'
refuse "no QK-norm" "cannot express model.qk_norm = none" qk_norm '"none"'
refuse "head_dim other than d_model / n_heads" "cannot express model.head_dim = 8 with model.d_model / model.n_heads = 16" head_dim 8
refuse "capacity factor" "cannot express model.capacity_factor = 1.25" capacity_factor 1.25
refuse "random routing" "cannot express model.random_routing = true" random_routing true
train train.out="$tmp/bias" model.bias_gamma=0.01
expect_error "refused: a balancing bias that steers routing" "cannot express the loss-free balancing bias \(model.bias_gamma = 0.01\): tensor 'model.layers.0.mlp.expert_bias' differs between experts" \
    $MOE export "$tmp/bias" "$tmp/never"
[ -e "$tmp/never" ] && bad "refused exports write nothing" "$(ls -a "$tmp/never")"
expect_error "refused: --dtype other than bf16, fp32" "--dtype 'fp16' is not one of fp32, bf16" $MOE export "$tmp/pre" "$tmp/never" --dtype fp16
expect_error "refused: a shard size that is no size" "--max-shard-size: '5 apples' is not a size" $MOE export "$tmp/pre" "$tmp/never" --max-shard-size "5 apples"

# Output directories: never over something without --force, never over the input, nothing but an
# earlier export or import even with it; what was there is kept when a refused write ends.
expect_error "a non-empty OUT_DIR needs --force" "pre.hf is not empty; pass --force" $MOE export "$tmp/reo" "$tmp/pre.hf"
before=$(sums "$tmp/pre.hf/model.safetensors")
$MOE export "$tmp/reo" "$tmp/pre.hf" --force > /dev/null 2>&1 && grep -q flex_olmo "$tmp/pre.hf/config.json" &&
    [ -z "$(ls -a "$tmp" | grep moe-)" ] && ok "--force replaces an earlier export, no temporary left" || bad "--force replaces an earlier export" "$(ls -a "$tmp")"
mkdir -p "$tmp/mine" && echo notes > "$tmp/mine/notes.txt"
expect_error "--force never replaces other files" "mine is not empty and holds no config.json" $MOE export "$tmp/pre" "$tmp/mine" --force
expect_error "the output cannot hold the input" "holds the input" $MOE export "$tmp/pre" "$tmp/pre" --force
[ "$(cat "$tmp/mine/notes.txt")" = notes ] && [ -d "$tmp/pre/step-3" ] && ok "refused outputs are untouched" || bad "refused outputs are untouched" "$(ls "$tmp/mine" "$tmp/pre")"

# Import: only the two classes, and only what moe.c runs.
# hf_edit NAME: a copy of the pre-norm export in $tmp/NAME whose config.json the caller edits.
hf_edit() { rm -rf "$tmp/$1" && cp -r "$tmp/bf16" "$tmp/$1"; }
hf_edit llama && sed -i 's/"model_type": "olmoe"/"model_type": "llama"/' "$tmp/llama/config.json"
expect_error "import refuses another model_type" "model_type \"llama\" is not one moe.c imports" $MOE import "$tmp/llama" "$tmp/never"
hf_edit gelu && sed -i 's/"hidden_act": "silu"/"hidden_act": "gelu"/' "$tmp/gelu/config.json"
expect_error "import refuses another activation" "key 'hidden_act' = \"gelu\" is not supported" $MOE import "$tmp/gelu" "$tmp/never"
hf_edit bias && sed -i 's/"attention_bias": false/"attention_bias": true/' "$tmp/bias/config.json"
expect_error "import refuses attention biases" "key 'attention_bias' = true is not supported" $MOE import "$tmp/bias" "$tmp/never"
hf_edit fewer && sed -i 's/"num_hidden_layers": 2/"num_hidden_layers": 1/' "$tmp/fewer/config.json"
expect_error "import refuses tensors the config has no place for" "tensor 'model.layers.1.[a-z_.]*' is not part of the model config.json describes" $MOE import "$tmp/fewer" "$tmp/never"
hf_edit wider && sed -i 's/"intermediate_size": 32/"intermediate_size": 64/' "$tmp/wider/config.json"
expect_error "import checks every shape" "tensor '.*' has shape \[32, 32\] but the config makes it \[64, 32\]" $MOE import "$tmp/wider" "$tmp/never"
hf_edit noconfig && rm "$tmp/noconfig/config.json"
expect_error "import needs config.json" "noconfig/config.json: cannot open Hugging Face config" $MOE import "$tmp/noconfig" "$tmp/never"
[ -e "$tmp/never" ] && bad "refused imports write nothing" "$(ls -a "$tmp/never")"

summary
