"""The model store: fetch, manifest, verify, versions, releases and rollback.

Nothing here imports torch; the tokenizer check in `verify` is the only part that pulls in
transformers, and only when it runs.
"""
