"""splitserve benchmarks: an OpenAI-compatible load generator (`splitserve bench`) and router
microbenchmarks. Importing this package imports nothing heavy."""
