"""The reference decoding algorithms written out literally: test oracles and benchmark baselines."""
