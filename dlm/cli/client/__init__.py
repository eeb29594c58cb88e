"""The client side of dlm's HTTP contract (design.md section 4 plus OpenAI's).

`dlm validate` and `dlm loadtest` talk to a server only through this package, so both
read SSE, errors and `/metrics` the same way. It never imports the engine core or the
server: it must work against any deployment, including servers that are not dlm.
"""
