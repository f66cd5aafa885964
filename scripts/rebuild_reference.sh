#!/usr/bin/env bash
# Rebuild everything shipped for a reference MoE from one training run:
# the int4 pack and its card, the prerouter heads, the recovery LoRA, the learned cache
# policy's weights, the speculative draft. RUN is the folder of `scripts/train_reference_moe.py --out RUN --steps N`
# (hf/ is the unquantized model the pack converts). Each step keeps its output under RUN/
# and copies what ships into the repository.
#
#   scripts/rebuild_reference.sh RUN [pack|card|agent|heads|lora|traces|draft]...   (default: all but agent)
#
# agent: the card's section on the agent stage, for a RUN of scripts/train_agent_stage.py
# (a last stage from the pack: `RUN pack agent heads lora traces`, no card: its first stage
# is the card's), from RUN/eval_{before,after}.json (scripts/eval_agent_model.py).
#
# MODEL names the model: fine (default; the bundled one, 128 experts, top-8:
# train_reference_moe.py --shape fine) or reference (32 experts, top-2, the default --shape;
# no longer bundled, rebuilt from its run).
set -euo pipefail
RUN=${1:?usage: scripts/rebuild_reference.sh RUN [step ...]}
shift
STEPS=${*:-pack card heads lora traces draft}
PY=${PYTHON:-python}
MODEL=${MODEL:-fine}
# the fine model's expert deltas at rank 4 (7.9 MB; rank 16 would be 31 MB) keep both
# models within ~90 MB; 600 steps fit a session on 2 cores (the card has its report)
case $MODEL in reference) SHAPE=reference; RANK=16; LORA_STEPS=1200 ;; fine) SHAPE=fine; RANK=4; LORA_STEPS=600 ;; *) echo "MODEL=$MODEL: expected reference or fine" >&2; exit 2 ;; esac
PACK=edgemoe/models/$MODEL
HEADS=$PACK/prerouter
LORA=$PACK/adapter
DRAFT=edgemoe/models/$MODEL-draft

for step in $STEPS; do
  echo "== $step"
  case $step in
    pack)  # replaces the whole folder, its heads, adapter and cache policy too: run all steps
      # the fine model trains on the bundled tokenizer: convert writes the pack's own
      # tokenizer.json and chat template (byte for byte the draft's); its tokenizer_config is
      # RUN/hf's with mlx-lm's tool_parser_type, all checksummed in the manifest (files copied
      # in after convert would fail the pack's checks)
      if [ "$MODEL" != reference ] && [ -f "$PACK/tokenizer.json" ]; then
        cp "$PACK"/{chat_template.jinja,tokenizer.json} "$RUN/hf/"
      fi
      $PY -m edgemoe.convert --hf-path "$RUN/hf" --mlx-path "$PACK" --overwrite ;;
    card)
      $PY scripts/model_card.py --run "$RUN" --pack "$PACK" ;;
    agent)
      $PY scripts/model_card.py --agent "$RUN" --pack "$PACK" ;;
    heads)  # next-token heads (the pack's, for the prerouted modes) and same-token heads
      # (PACK/prerouter-same-token, the near-exact option), distilled from the pack's routers
      for variant in prerouter prerouter-same-token; do
        $PY -m edgemoe.train_prerouter --model "$PACK" --data "$RUN/train.txt" \
            --eval-data "$RUN/heldout.txt" --out "$RUN/$variant" \
            --max-train-tokens 64000 --max-eval-tokens 16384 \
            $([ $variant = prerouter-same-token ] && echo --same-token)
        rm -rf "${PACK:?}/$variant" && mkdir -p "$PACK/$variant"
        cp "$RUN/$variant"/prerouter/* "$RUN/$variant/report.json" "$PACK/$variant/"
      done
      # the default of --routing prerouted: the layers whose heads recall least keep their
      # router, the others route cache-conditionally (docs/routing.md, the frontier)
      $PY -m edgemoe.routing.between --heads "$PACK/prerouter" --min-recall 0.45 --conditional 8
      $PY scripts/model_card.py --assets --pack "$PACK" ;;
    lora)  # distilled from the pack's int4 native routing into its plain prerouted routing
      # (the heads on every layer but the first: what PyTorch runs), the routed experts too
      # (their deltas stream with them), in PyTorch (the cuda extra)
      $PY -m edgemoe.routing.between --heads "$HEADS" --plain-copy "$RUN/heads_plain"
      $PY -m edgemoe.train_lora --model "$PACK" --teacher "$PACK" --data "$RUN/train.txt" \
          --eval-data "$RUN/heldout.txt" --prerouter "$RUN/heads_plain" --out "$RUN/lora" \
          --backend torch --experts --rank $RANK --lr 2e-4 --steps $LORA_STEPS
      rm -rf "$LORA" && mkdir -p "$LORA"
      cp "$RUN"/lora/adapters.safetensors "$RUN"/lora/adapter_config.json \
         "$RUN"/lora/report.json "$RUN"/lora/expert_deltas.bin "$RUN"/lora/expert_deltas.json \
         "$LORA/"
      # the default of --routing prerouted loads the adapter's attention on every layer, no
      # expert deltas: on the frontier of the agent stage's weights, closer to native on
      # both unseen texts than the deltas on the predicted layers, and faster (docs/routing.md)
      $PY -m edgemoe.routing.between --heads "$HEADS" --adapter "$LORA" --adapter-layers all \
          --attention-only
      $PY scripts/model_card.py --assets --pack "$PACK" ;;
    traces)  # teacher-forced decode traces of held-out passages (4 per domain; greedy decode
      # of a small model loops and flatters every cache), their routing statistics, and the
      # learned cache policy: fitted on passages 0-1 of each text, replayed on 2-3, shipped fitted on all
      texts=$(ls "$RUN"/heldout_*.txt 2>/dev/null | paste -sd, -); texts=${texts:-$RUN/heldout.txt}
      rm -rf "$RUN/traces"
      $PY scripts/routing_stats.py record --model "$PACK" --text "$texts" --out "$RUN/traces" \
          --passages 4 --prompt 128 --decode 256
      $PY scripts/routing_stats.py report "$RUN"/traces/*.npz --json "$PACK/routing_stats.json"
      $PY -m edgemoe.cache_sim train-learned "$RUN"/traces/*_[01].npz --out "$RUN/traces/learned_01.npz"
      $PY -m edgemoe.cache_sim "$RUN"/traces/*_[23].npz --learned "$RUN/traces/learned_01.npz" \
          --budget 0.1,0.25,0.5 --json "$RUN/traces/heldout_replay.json"
      $PY -m edgemoe.cache_sim train-learned "$RUN"/traces/heldout*.npz --out "$PACK/cache_policy.npz" ;;
    draft)  # a small dense model of the same corpus and tokenizer, int4 as mlx_lm.convert -q
      $PY scripts/train_reference_moe.py --draft --shape "$SHAPE" --tokenizer "$PACK" --out "$RUN/draft" --steps 2000
      rm -rf "$DRAFT"
      $PY -m mlx_lm convert --hf-path "$RUN/draft/hf" --mlx-path "$DRAFT" -q
      $PY scripts/model_card.py --draft --run "$RUN/draft" --pack "$DRAFT" ;;
    *)
      echo "unknown step $step" >&2; exit 2 ;;
  esac
done
