#!/usr/bin/env bash
# Rebuild everything shipped for the bundled reference MoE from one training run:
# the int4 pack and its card, the prerouter heads, the recovery LoRA, the learned cache
# policy's weights, the speculative draft. RUN is the folder of `scripts/train_reference_moe.py --out RUN --steps N`
# (hf/ is the unquantized model the pack converts). Each step keeps its output under RUN/
# and copies what ships into the repository.
#
#   scripts/rebuild_reference.sh RUN [pack|card|heads|lora|traces|draft]...   (default: all)
set -euo pipefail
RUN=${1:?usage: scripts/rebuild_reference.sh RUN [step ...]}
shift
STEPS=${*:-pack card heads lora traces draft}
PY=${PYTHON:-python}
PACK=edgemoe/models/reference
HEADS=edgemoe/models/reference/prerouter
LORA=edgemoe/models/reference/adapter
DRAFT=edgemoe/models/reference-draft

for step in $STEPS; do
  echo "== $step"
  case $step in
    pack)  # replaces the whole folder, its heads, adapter and cache policy too: run all steps
      $PY -m edgemoe.convert --hf-path "$RUN/hf" --mlx-path "$PACK" --overwrite ;;
    card)
      $PY scripts/model_card.py --run "$RUN" --pack "$PACK" ;;
    heads)  # next-token heads, distilled from the pack's own routers
      $PY -m edgemoe.train_prerouter --model "$PACK" --data "$RUN/train.txt" \
          --eval-data "$RUN/heldout.txt" --out "$RUN/prerouter" \
          --max-train-tokens 64000 --max-eval-tokens 16384
      rm -rf "$HEADS" && mkdir -p "$HEADS"
      cp "$RUN"/prerouter/prerouter/* "$RUN/prerouter/report.json" "$HEADS/"
      $PY scripts/model_card.py --assets --pack "$PACK" ;;
    lora)  # distilled from the pack's int4 native routing into its prerouted routing, the
      # routed experts too (their deltas stream with them), in PyTorch (the cuda extra)
      $PY -m edgemoe.train_lora --model "$PACK" --teacher "$PACK" --data "$RUN/train.txt" \
          --eval-data "$RUN/heldout.txt" --prerouter "$HEADS" --out "$RUN/lora" \
          --backend torch --experts --rank 16 --lr 2e-4 --steps 1200
      rm -rf "$LORA" && mkdir -p "$LORA"
      cp "$RUN"/lora/adapters.safetensors "$RUN"/lora/adapter_config.json \
         "$RUN"/lora/report.json "$RUN"/lora/expert_deltas.bin "$RUN"/lora/expert_deltas.json \
         "$LORA/"
      $PY scripts/model_card.py --assets --pack "$PACK" ;;
    traces)  # 8 decode traces of held-out passages at 25%; the learned policy fits them
      mkdir -p "$RUN/traces"
      for i in 0 1 2 3 4 5 6 7; do
        $PY -c "import sys; t = open(sys.argv[1]).read(); n = len(t) // 8 * $i; print(t[n:n + 600])" \
            "$RUN/heldout.txt" > "$RUN/traces/passage_$i.txt"
        $PY -m edgemoe.generate --prompt - --ignore-chat-template --max-tokens 300 \
            --expert-budget 25% --trace "$RUN/traces/r$i.npz" < "$RUN/traces/passage_$i.txt" > /dev/null
      done
      $PY -m edgemoe.cache_sim train-learned "$RUN"/traces/r{0,1,2,3}.npz --out "$RUN/traces/learned_r0-3.npz"
      $PY -m edgemoe.cache_sim "$RUN"/traces/r{4,5,6,7}.npz --learned "$RUN/traces/learned_r0-3.npz" \
          --budget 0.1,0.25,0.5 --json "$RUN/traces/heldout_replay.json"
      $PY -m edgemoe.cache_sim train-learned "$RUN"/traces/r?.npz --out edgemoe/models/reference/cache_policy.npz ;;
    draft)  # a small dense model of the same corpus and tokenizer, int4 as mlx_lm.convert -q
      $PY scripts/train_reference_moe.py --draft --tokenizer "$PACK" --out "$RUN/draft" --steps 2000
      rm -rf "$DRAFT"
      $PY -m mlx_lm convert --hf-path "$RUN/draft/hf" --mlx-path "$DRAFT" -q
      $PY scripts/model_card.py --draft --run "$RUN/draft" --pack "$DRAFT" ;;
    *)
      echo "unknown step $step" >&2; exit 2 ;;
  esac
done
