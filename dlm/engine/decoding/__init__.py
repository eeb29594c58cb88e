"""What one denoising step decides: the block schedule and the commit rules."""
