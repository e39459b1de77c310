"""benchmarks/kernels.py: GPU kernels sorted into kinds by name (names as an H200's traces of sdx and diffusers
gave them), and the summary's sums."""

import pytest

from benchmarks import kernels


@pytest.mark.parametrize("name, kind", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0",
     "attention"),  # also says "fprop", as cuDNN's convolutions do
    ("fmha_cutlassF_bf16_aligned_32x128_gmem_sm80", "attention"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "convolution"),
    ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_bias_NNT", "matrix product"),
    ("loop_convert_fusion_3", "elementwise/other"),  # "convert" is not a convolution
    ("loop_multiply_fusion_119", "elementwise/other"),
    ("input_reduce_fusion_84", "normalization/reduction"),
    ("loop_slice_fusion_189", "copy/transpose"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>", "copy/transpose"),
])
def test_a_kernel_s_kind_is_read_from_its_name(name, kind):
    assert kernels.kind(name) == kind


def test_the_summary_sums_each_kind_and_lists_the_longest_kernels_first():
    text = kernels.summarize({"loop_add_fusion": (0.001, 9), "nvjet_a": (0.030, 2), "nvjet_b": (0.010, 1),
                              "input_reduce_fusion": (0.004, 1)}, wall_s=0.1)
    assert text.splitlines()[0] == "wall 100.0 ms; kernels 45.0 ms (45% of the wall), 13 launches, 4 distinct kernels"
    assert "| matrix product | 40.0 | 88.9% |" in text
    rows = [line for line in text.splitlines() if line.startswith("| nvjet") or line.startswith("| loop")]
    assert rows == ["| nvjet_a | matrix product | 30.00 | 2 |", "| nvjet_b | matrix product | 10.00 | 1 |",
                    "| loop_add_fusion | elementwise/other | 1.00 | 9 |"]
