#!/usr/bin/env bash
# The GPU measurements (issues 12 and 66) in one call, most important first, each stage logged to OUT/NAME.log
# and stopped at its own time limit so that a slow or failing stage leaves the next ones their time:
#
#   bash benchmarks/gpu_round.sh OUT [WORK]
#
# Issue 66's round, prepared for a 15-minute lease and rehearsed on a CPU (tiny_xl, float32), not yet run on a GPU:
#   BUDGET=535 STAGES="batch8_profile fewstep options train_lora" \
#   TRAIN_LORA="--preset sdxl_base --size 1024 --batch 1 --dtype bfloat16 --lora 16 --remat" bash benchmarks/gpu_round.sh OUT
# and its training half, SDXL's whole UNet and LoRA rank 16 at 1024² against diffusers' with gradient checkpointing:
#   BUDGET=535 STAGES="train train_lora" TRAIN="--preset sdxl_base --size 1024 --batch 1 --dtype bfloat16 --remat" \
#   TRAIN_LORA="--preset sdxl_base --size 1024 --batch 1 --dtype bfloat16 --lora 16 --remat" bash benchmarks/gpu_round.sh OUT
#
# 1. attention: tests/test_attention.py, where the cuDNN backend is checked equal to `xla` (skipped off NVIDIA GPUs);
# 2. batch1: steady state at batch 1 against diffusers, with a cold compilation cache (the first call's extra
#    seconds are the compile) that is kept in WORK/cache;
# 3. end_to_end: a fresh `python -m sdx.sample` reading that cache against a diffusers script;
# 4. batch1_warm: steady state at batch 1 again, sdx alone, reading that cache: its peak memory leaves out what the
#    compile's autotuning took (the device's peak counts from the start of the process);
# 5. batch4: steady state at batch 4 against diffusers;
# 6. memory: benchmarks/memory.py at batch 4: the GPU compiler's own memory analysis of the programs;
# 7. batch4_flags: steady state at batch 4 again, sdx alone, with XLA_FLAGS=$TRY_FLAGS added (default: every matrix
#    product to cuBLAS rather than XLA's Triton kernels), against stage 5's sdx number;
# 8. batch1_other: steady state at batch 1 with the other attention backend, sdx alone;
# 9. blank_rows: steady state at batch 4 again, sdx alone, with SDXL's zero negative branch skipping its
#    cross-attentions behind a conditional per attention (`--blank-rows always`; sdx does it on CPUs only), against
#    stage 5's sdx number;
# 10. train: one training step of SD 1.5's UNet at 512², batch 8, bfloat16 mixed precision, against diffusers'
#    (benchmarks/train.py; TRAIN overrides its arguments);
# 11. tiles: benchmarks/memory.py at twice the size, one image, with the VAE in tiles (`--vae-tiling`) and
#    without: the GPU compiler's memory analysis of the decode both ways.
# 12. profile: steady state at batch 4 against diffusers, one timed generation, then one more under each
#    framework's profiler: the GPU time by kernel and by kind (`benchmarks/sample.py --profile`); sdx's trace
#    stays in WORK.
# 13. train_lora: one LoRA training step (rank 4) of SDXL base's UNet at 1024², batch 1, bfloat16, against
#    diffusers + peft's (benchmarks/train.py --lora; TRAIN_LORA overrides its arguments; needs peft).
# 14. batch8_profile: steady state at batch 8 against diffusers, best of 2, then one more generation under each
#    framework's profiler (issue 66's batch and its kernel-time profile); sdx's programs go to WORK/cache;
# 15. options: benchmarks/options.py at batch 8, reading batch8_profile's programs from WORK/cache: one model call
#    compiled under each of the option sets in OPTION_SETS (';'-separated, each `NAME OPTION=VALUE ...`; default
#    below) in one process, timed against the sampler's own;
# 16. fewstep: steady state at batch 1, 4 steps (the last --steps wins), no classifier-free guidance
#    (SDXL-Lightning's and Turbo's way of running), against diffusers;
# 17. batch8: steady state at batch 8 against diffusers, best of 2, without the profiler.
# 18. serve: issue 78's round, `python -m sdx.serve` under 1 and 8 concurrent clients, --max-batch 8 against
#    --max-batch 1 and against diffusers behind a one-at-a-time FastAPI server (benchmarks/serve.py --diffusers);
#    it needs the `serve` extra carried as wheels (fastapi 0.165.0, starlette 1.10.0, pydantic 2.14.4,
#    pydantic_core 2.50.5, annotated-types 0.8.0, annotated-doc 0.0.7, typing-inspection 0.4.5, uvicorn 0.55.0:
#    the image has none of them), and alone it wants the whole lease: STAGES=serve BUDGET=540.
#
# STAGES (names, space-separated) runs those, in its order: a round split over two calls, say, or the
# stages that matter most first. A stage that needs another's files (end_to_end and batch1_warm read
# batch1's compilation cache) follows it.
# The job is SDXL base's architecture (random weights), 1024², 25 Euler steps, classifier-free guidance,
# bfloat16 (sdx's VAE too, as diffusers'; the first round's sdx VAE was float32). PRESET, SIZE, STEPS,
# DTYPE, ATTENTION (the backend of stages 2-7, 9 and 10), OTHER (stage 8's), TRY_FLAGS (stage 7's) and BUDGET
# (seconds for all stages) override it, PYTHON the interpreter; for example, a rehearsal of the whole
# round on a CPU:
#   PRESET=tiny_xl SIZE=64 STEPS=2 ATTENTION=xla OTHER=chunked bash benchmarks/gpu_round.sh /tmp/round
# It needs jax with CUDA, torch, diffusers and transformers. The H100 rounds (jax 0.11.2) carried as wheels
# diffusers 0.42.1, transformers 5.23.0 and huggingface_hub 2.4.0 with what it and sdx's convert/hub.py
# import (httpx2 and httpcore2 2.16.2, truststore 0.10.5, idna 3.20, anyio 4.16.0, click 8.5.1, hf-xet
# 1.8.0: without httpx2 every sampling stage fails at its import), and kept the machine's flax 0.12.10
# (flax 0.12.8 does not import with jax 0.11.2).
set -u
out=${1:?usage: gpu_round.sh OUT [WORK]}
work=${2:-${TMPDIR:-/tmp}/sdx-gpu}
mkdir -p "$out" "$work"
job=(--preset "${PRESET:-sdxl_base}" --size "${SIZE:-1024}" --steps "${STEPS:-25}" --dtype "${DTYPE:-bfloat16}"
     --work "$work")
attention=${ATTENTION:-cudnn}
python=${PYTHON:-python3}
deadline=$((SECONDS + ${BUDGET:-560}))

stage() {  # stage NAME LIMIT_S COMMAND...: runs COMMAND for at most LIMIT_S (less if the budget is short)
  local name=$1 limit=$2 left=$((deadline - SECONDS)) t0=$SECONDS rc
  shift 2
  ((left < limit)) && limit=$left
  if ((limit < 20)); then echo "== $name: skipped, ${left}s of the budget left"; return; fi
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s (limit ${limit}s)"
  tail -n "${TAIL:-14}" "$out/$name.log"
}

# Each one tried against the sampler's program by the options stage: XLA's merging of to_q/to_k/to_v products
# (the twenty-ninth round's trace: three separate products would take 102 µs against the merged 146), cuDNN's
# layer norm, cuDNN's runtime fusion of convolutions with their elementwise work, cuDNN GEMM fusions, cuBLAS for
# every product, NCHW convolutions, Triton for any product; then the first two together.
option_sets=${OPTION_SETS:-"no_dot_merger xla_gpu_dot_merger_threshold_mb=0; cudnn_layer_norm xla_gpu_enable_cudnn_layer_norm=true;
conv_runtime_fusion xla_gpu_use_runtime_fusion=true; cudnn_gemm_fusion xla_gpu_cudnn_gemm_fusion_level=2;
cublas xla_gpu_enable_triton_gemm=false; conv_nchw xla_gpu_force_conv_nchw=true; triton_gemm_any xla_gpu_triton_gemm_any=true;
merger_and_layer_norm xla_gpu_dot_merger_threshold_mb=0 xla_gpu_enable_cudnn_layer_norm=true"}
variants=()
IFS=';' read -ra sets <<<"${option_sets//$'\n'/ }"
for set in "${sets[@]}"; do read -ra words <<<"$set"; ((${#words[@]})) && variants+=(--variant "${words[@]}"); done

read -ra train <<<"${TRAIN:---preset sd15 --size 512 --batch 8 --dtype bfloat16}"
read -ra train_lora <<<"${TRAIN_LORA:---preset sdxl_base --size 1024 --batch 1 --dtype bfloat16 --lora 4}"
for name in ${STAGES:-attention batch1 end_to_end batch1_warm batch4 memory batch4_flags batch1_other blank_rows train tiles profile train_lora}; do
  case $name in
  attention) stage "$name" 120 "$python" -m pytest -q -p no:cacheprovider tests/test_attention.py ;;
  batch1) stage "$name" 300 "$python" benchmarks/sample.py "${job[@]}" --batch 1 --attention "$attention" --repeats 3 \
            --cache "$work/cache" ;;
  end_to_end) stage "$name" 160 "$python" benchmarks/sample.py "${job[@]}" --attention "$attention" \
                --cache "$work/cache" --end-to-end 1 ;;
  batch1_warm) stage "$name" 90 "$python" benchmarks/sample.py "${job[@]}" --batch 1 --attention "$attention" \
                 --repeats 2 --cache "$work/cache" --no-reference ;;
  batch4) stage "$name" 240 "$python" benchmarks/sample.py "${job[@]}" --batch 4 --attention "$attention" --repeats 2 ;;
  memory) stage "$name" 150 "$python" benchmarks/memory.py "${PRESET:-sdxl_base}" "${SIZE:-1024}" 4 \
            --dtype "${DTYPE:-bfloat16}" --vae-dtype "${DTYPE:-bfloat16}" --attention "$attention" ;;
  batch4_flags) XLA_FLAGS="${XLA_FLAGS:-} ${TRY_FLAGS:---xla_gpu_enable_triton_gemm=false}" stage "$name" 150 \
                  "$python" benchmarks/sample.py "${job[@]}" --batch 4 --attention "$attention" --repeats 2 --no-reference ;;
  batch1_other) stage "$name" 150 "$python" benchmarks/sample.py "${job[@]}" --batch 1 --attention "${OTHER:-xla}" \
                  --repeats 2 --no-reference ;;
  blank_rows) stage "$name" 150 "$python" benchmarks/sample.py "${job[@]}" --batch 4 --attention "$attention" \
                --repeats 2 --no-reference --blank-rows always ;;
  tiles) stage "$name" 150 "$python" benchmarks/memory.py "${PRESET:-sdxl_base}" $((2 * ${SIZE:-1024})) 1 \
           --dtype "${DTYPE:-bfloat16}" --vae-dtype "${DTYPE:-bfloat16}" --attention "$attention" --vae-tiling ;;
  profile) stage "$name" 300 "$python" benchmarks/sample.py "${job[@]}" --batch 4 --attention "$attention" --repeats 1 \
             --profile ;;
  train) stage "$name" 200 "$python" benchmarks/train.py --channels "" "${train[@]}" --attention "$attention" --repeats 5 ;;
  train_lora) stage "$name" 200 "$python" benchmarks/train.py --channels "" "${train_lora[@]}" --attention "$attention" \
                --repeats 5 ;;
  batch8_profile) stage "$name" 300 "$python" benchmarks/sample.py "${job[@]}" --batch 8 --attention "$attention" \
                    --repeats 2 --profile --cache "$work/cache" ;;
  options) stage "$name" 220 "$python" benchmarks/options.py --preset "${PRESET:-sdxl_base}" --size "${SIZE:-1024}" \
             --steps "${STEPS:-25}" --dtype "${DTYPE:-bfloat16}" --work "$work" --batch 8 --attention "$attention" \
             --cache "$work/cache" --calls $((${STEPS:-25} < 6 ? ${STEPS:-25} : 6)) "${variants[@]}" ;;
  fewstep) stage "$name" 150 "$python" benchmarks/sample.py "${job[@]}" --steps 4 --batch 1 --guidance 0 \
             --attention "$attention" --repeats 3 ;;
  serve) stage "$name" 540 "$python" benchmarks/serve.py --preset "${PRESET:-sdxl_base}" --dtype "${DTYPE:-bfloat16}" \
           --size "${SIZE:-1024}" --steps "${STEPS:-25}" --clients 1 8 --requests 2 --diffusers ;;
  batch8) stage "$name" 240 "$python" benchmarks/sample.py "${job[@]}" --batch 8 --attention "$attention" --repeats 2 ;;
  *) echo "gpu_round.sh: no stage named $name" >&2; exit 2 ;;
  esac
done
