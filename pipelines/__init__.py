"""Text-to-image, img2img, refiner and InstructPix2Pix pipelines over the sdx models."""
