"""Prefill pool: PrefillWorker computes prompts and hands their KV blocks to decode."""
