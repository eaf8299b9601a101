"""splitserve engine: Llama-family model, paged KV cache, block pool, scheduler, sampler.

This package imports no other splitserve package. Importing `engine` itself does not import
torch, so torch-free callers (the router) can use `splitserve.engine.core.block_hash`.
"""
