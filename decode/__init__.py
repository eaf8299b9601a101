"""Decode pool: DecodeWorker receives KV blocks, runs the continuous batch, streams tokens."""
