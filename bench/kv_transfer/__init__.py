"""Moving KV against the alternatives: the prefill -> decode KV path against raw gloo send/recv,
the host KV tier's copies against recomputing a block, and a draft's local prompt pass against
shipping its KV."""
