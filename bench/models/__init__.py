"""The built-in trained checkpoints: what brief training buys (loss, cost, n-gram hit rate, draft
agreement), and routing requests between a small and a large one (always-large, always-small,
rules, the cascade)."""
