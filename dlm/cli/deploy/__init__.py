"""Deployments beyond one process: Kubernetes manifests and a proxy in front of replicas.

Both renderers read the settings `dlm serve` takes (dlm/cli/server/config.py), so what runs
in a pod or behind the proxy is what `dlm serve --config FILE` runs on a laptop.
"""
