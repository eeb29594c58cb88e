"""dlm: diffusion language models from hub weights to a production API.

One import name for the whole distribution: `dlm.engine` (the inference engine), `dlm.kernels`
(compute kernels with torch twins) and `dlm.cli` (the toolkit and the `dlm` command). Nothing is
imported here, so `import dlm.kernels` loads no engine and `dlm --help` stays light.
"""
