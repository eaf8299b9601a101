"""splitserve engine: the model engine, colocated (the offline API and the baseline) or hosted
by a replica -- Llama-family model, paged KV cache and its host tier, block pool, scheduler,
sampler (engine/sample/), structured output (engine/structured_output/), speculative decoding
(engine/speculative/), weight quantization, the simulated engine, and the loop thread that runs
an engine beside an asyncio actor (engine/engine_loop.py). The actor around it is runtime/.

Of the rest of splitserve it imports only the messages between processes
(splitserve.proto.messages: KV events, engine stats). Importing `engine` itself does not import
torch, so torch-free callers (the router) can use `splitserve.engine.core.block_hash`.
"""
