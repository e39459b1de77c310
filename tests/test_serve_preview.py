"""The server's live preview (serve/preview.py): A1111's fixed linear map from latents to RGB, no VAE."""

from __future__ import annotations

import numpy as np
import pytest

from serve.preview import SD_RGB, SDXL_RGB, approx_rgb


@pytest.mark.parametrize("xl, table", [(False, SD_RGB), (True, SDXL_RGB)])
def test_four_channels_use_the_published_map(xl, table):
    latents = np.zeros((2, 3, 5, 4), np.float32)
    for c in range(4):
        latents[0, c % 3, c] = np.eye(4)[c]  # one pixel per channel, that channel alone at 1
    latents[1] = 0.7
    out = approx_rgb(latents, xl)
    assert out.shape == (2, 3, 5, 3) and out.dtype == np.uint8
    for c in range(4):  # a unit latent shows its row of the table, [-1, 1] -> [0, 255]
        np.testing.assert_array_equal(out[0, c % 3, c], np.round((table[c] + 1) / 2 * 255))
    np.testing.assert_array_equal(out[0, 2, 4], [128, 128, 128])  # zero latents: mid grey
    np.testing.assert_array_equal(out[1, 0, 0], np.round(np.clip((0.7 * table.sum(0) + 1) / 2, 0, 1) * 255))


def test_sd_and_sdxl_maps_differ():
    latents = np.random.default_rng(0).normal(size=(1, 4, 4, 4)).astype(np.float32)
    assert not np.array_equal(approx_rgb(latents, False), approx_rgb(latents, True))


def test_other_channel_counts_show_each_channel_in_one_colour_stretched_to_the_range():
    latents = np.zeros((1, 2, 2, 16), np.float32)
    latents[0, 0, 0, 3] = 2.0  # channel 3 -> red (3 % 3 == 0)
    latents[0, 0, 1, 7] = -1.0  # channel 7 -> green, below the rest
    out = approx_rgb(latents, xl=False)
    assert out.shape == (1, 2, 2, 3)
    # red averages 6 channels (2/6 here), green 5 (-1/5); the range -0.2..1/3 stretched to 0..255, zero at 96
    np.testing.assert_array_equal(out[0, 0, 0], [255, 96, 96])  # the picture's maximum, in red
    np.testing.assert_array_equal(out[0, 0, 1], [96, 0, 96])  # its minimum, in green
    np.testing.assert_array_equal(out[0, 1, 1], [96, 96, 96])
    flat = approx_rgb(np.full((1, 2, 2, 8), 3.0, np.float32), xl=True)
    np.testing.assert_array_equal(flat, 128)  # no range: grey, not a division by zero
