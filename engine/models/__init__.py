"""One module per model family; each defines `Model(config)` with parameters named as in
the family's checkpoints, `forward(batch) -> hidden` and `lm_head_weight`."""
