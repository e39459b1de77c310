#!/usr/bin/env bash
# The default models (`--model default`, `--model default-edit`) from scratch, with sdx's own commands
# only: the shapes datasets, the VAE, the untrained SDXL-architecture pipeline, text-to-image training,
# InstructPix2Pix fine-tuning, the VAE decoder's fine-tune, packing into sdx/assets/models, and the evaluation.
#
#     make default-models            # or: bash train/recipe.sh [WORK_DIR]
#
# Every training command checkpoints as it goes; run the recipe again after an interruption and each
# finished stage is skipped, an unfinished one resumes from its last checkpoint. The step counts are
# environment variables (VAE_STEPS, T2I_STEPS, T2I_MORE_STEPS, EDIT_STEPS, EDIT_MORE_STEPS, DECODER_STEPS,
# EDIT_PIXEL_STEPS) for shorter trial runs.
set -euo pipefail

WORK=${1:-work/default-models}
PY=${PYTHON:-python}
VAE_STEPS=${VAE_STEPS:-5000}
T2I_STEPS=${T2I_STEPS:-5000}
T2I_MORE_STEPS=${T2I_MORE_STEPS:-5000}
EDIT_STEPS=${EDIT_STEPS:-5000}
EDIT_MORE_STEPS=${EDIT_MORE_STEPS:-2500}
DECODER_STEPS=${DECODER_STEPS:-1000}
EDIT_PIXEL_STEPS=${EDIT_PIXEL_STEPS:-1500}
mkdir -p "$WORK"
start=$(date +%s)
stage() { echo "== $1 ($(( $(date +%s) - start )) s so far)" >&2; }
resume() { [ -d "$1/checkpoints" ] && echo --resume_from_checkpoint latest || true; }

stage "datasets"
[ -d "$WORK/captions" ] || $PY -m train.shapes captions "$WORK/captions" --count 20000 --seed 1
[ -d "$WORK/edits" ] || $PY -m train.shapes edits "$WORK/edits" --count 20000 --seed 2

stage "VAE"
# From random weights: VAE_STEPS at a constant rate after 50 warm-up steps, then 1,500 more with the rate
# stepped down to 0.3, 0.1 and 0.03 of it every 500 (resumed from the first part's last checkpoint). Held at
# 1e-3 the strict figures level off (docs/default-models.md); the steps down take the triangles' corners.
[ -f "$WORK/vae-1/config.json" ] || $PY -m train.vae --vae_config shapes --dataset_name "$WORK/captions" \
    --resolution 64 --train_batch_size 16 --max_train_steps "$VAE_STEPS" --learning_rate 1e-3 \
    --lr_scheduler constant_with_warmup --lr_warmup_steps 50 --validation_steps 500 --checkpointing_steps 250 \
    --checkpoints_total_limit 2 --seed 0 --output_dir "$WORK/vae-1" $(resume "$WORK/vae-1")
[ -d "$WORK/vae/checkpoints" ] && from=latest || from="$WORK/vae-1/checkpoints/$VAE_STEPS"
[ -f "$WORK/vae/config.json" ] || $PY -m train.vae --vae_config shapes --dataset_name "$WORK/captions" \
    --resolution 64 --train_batch_size 16 --max_train_steps $((VAE_STEPS + 1500)) --learning_rate 1e-3 \
    --lr_scheduler piecewise_constant --validation_steps 500 --checkpointing_steps 250 \
    --lr_step_rules "1:$VAE_STEPS,0.3:$((VAE_STEPS + 500)),0.1:$((VAE_STEPS + 1000)),0.03" \
    --checkpoints_total_limit 2 --seed 0 --output_dir "$WORK/vae" --resume_from_checkpoint "$from"

stage "untrained pipeline"
[ -f "$WORK/init/sdx.json" ] || $PY -m train.init --preset shapes --vae "$WORK/vae" \
    --scaling_data "$WORK/captions" --seed 0 --output_dir "$WORK/init"

# text_to_image FROM OUT STEPS RATE WARMUP SEED: a text-to-image pass on the captions, checkpointed and resumable.
text_to_image() {
    [ -f "$2/sdx.json" ] || $PY -m train.text_to_image --pretrained_model_name_or_path "$1" \
        --dataset_name "$WORK/captions" --resolution 64 --center_crop --cache_latents --train_batch_size 16 \
        --max_train_steps "$3" --learning_rate "$4" --lr_scheduler cosine --lr_warmup_steps "$5" \
        --snr_gamma 5 --proportion_empty_prompts 0.1 --use_ema --ema_use_warmup --ema_power 0.75 \
        --validation_prompt "a red circle on a blue background" --validation_steps 500 \
        --checkpointing_steps 250 --checkpoints_total_limit 2 --seed "$6" --output_dir "$2" $(resume "$2")
}

stage "text-to-image"
text_to_image "$WORK/init" "$WORK/t2i" "$T2I_STEPS" 1e-3 200 0

stage "text-to-image, second pass"
# From the first pass, T2I_MORE_STEPS more at half its rate with another seed (other noise, other order): the
# first pass's loss was still falling, and its circles were ellipses by about a pixel. `default` ships this pass;
# the edit model below is fine-tuned from the first, as the shipped one was.
text_to_image "$WORK/t2i" "$WORK/t2i-2" "$T2I_MORE_STEPS" 5e-4 100 1

# instruct_pix2pix FROM OUT STEPS RATE WARMUP SEED [FLAG...]: an InstructPix2Pix pass on the edits, checkpointed and
# resumable, with any further flags given. No --snr_gamma here: under zero terminal SNR it gives the high-noise steps
# almost no weight, and those are where the model learns to copy the input picture's layout (docs/default-models.md,
# "What is left").
instruct_pix2pix() {
    [ -f "$2/sdx.json" ] || $PY -m train.pix2pix --pretrained_model_name_or_path "$1" \
        --dataset_name "$WORK/edits" --max_train_samples 16000 --resolution 64 --cache_latents \
        --train_batch_size 16 --max_train_steps "$3" --learning_rate "$4" --lr_scheduler cosine \
        --lr_warmup_steps "$5" --conditioning_dropout_prob 0.05 --use_ema --ema_use_warmup --ema_power 0.75 \
        --checkpointing_steps 250 --checkpoints_total_limit 2 --seed "$6" --output_dir "$2" $(resume "$2") "${@:7}"
}

stage "InstructPix2Pix"
instruct_pix2pix "$WORK/t2i" "$WORK/edit" "$EDIT_STEPS" 1e-3 100 0

stage "InstructPix2Pix, second pass"
# From the first, EDIT_MORE_STEPS more at 0.3 of its rate with another seed, as the text-to-image model's second
# pass: its pictures come out closer to the world's shapes.
instruct_pix2pix "$WORK/edit" "$WORK/edit-2" "$EDIT_MORE_STEPS" 3e-4 100 1

stage "VAE decoder"
# The decoder alone, fine-tuned on the second text-to-image pass's VAE: the encoder, and so every latent both UNets
# were trained on, stays as it is. Each pixel's error is weighed by 1 + 100 times its edge strength, so the few
# pixels of an outline and a corner count, and the decoder draws from latents with noise added, as a UNet's latents
# are near the encoder's but not on them. Both models then share this VAE (the edit model's is swapped in).
[ -f "$WORK/t2i-3/sdx.json" ] || $PY -m train.vae --pretrained_model_name_or_path "$WORK/t2i-2" --decoder_only \
    --edge_weight 100 --latent_noise 0.1 --dataset_name "$WORK/captions" --resolution 64 --train_batch_size 16 \
    --max_train_steps "$DECODER_STEPS" --learning_rate 2e-4 --lr_scheduler cosine --lr_warmup_steps 20 \
    --validation_steps 500 --checkpointing_steps 250 --checkpoints_total_limit 2 --seed 0 --output_dir "$WORK/t2i-3" \
    $(resume "$WORK/t2i-3")
[ -f "$WORK/edit-3/sdx.json" ] || $PY -m convert "$WORK/edit-2" "$WORK/edit-3" --vae "$WORK/t2i-3"

stage "InstructPix2Pix, pixel-loss pass"
# From the edit model with the new decoder, EDIT_PIXEL_STEPS more at lr 1.5e-4 with a pixel loss: below timestep
# 400 the picture each prediction implies, decoded by that decoder, is held to the data's, outlines and corners
# weighed up to 31 times a flat pixel. Without it the same pass traded the shape edits for the others; with it
# every kind of edit gains (docs/default-models.md). `default-edit` ships this pass.
instruct_pix2pix "$WORK/edit-3" "$WORK/edit-4" "$EDIT_PIXEL_STEPS" 1.5e-4 50 2 \
    --pixel_loss_weight 0.2 --edge_weight 30 --pixel_loss_max_timestep 400

stage "pack"
# Both models name guidance 2.0 as their own: the text-to-image model's circles are roundest there, and at 2.0
# rather than SDXL's 5.0 far more edits keep their shapes strictly (docs/default-models.md, "How well they work").
$PY -m convert.default_models pack "$WORK/t2i-3" "$WORK/edit-4" --guidance-scale 2.0 --edit-guidance-scale 2.0

stage "evaluate"
$PY -m train.shapes_eval --model default --edit-model default-edit --vae-model default --seeds 2 --json "$WORK/eval.json"
stage "done"
