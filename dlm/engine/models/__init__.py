"""One module per model family (a family's registry record names it); each defines
`Model(config)` from `ModelConfig` alone, with parameters named as in the family's
checkpoints, `forward(batch) -> hidden` and `lm_head_weight` (base.py: what the layer-stack
families share). Families with the same network and other options share a module."""
