"""Engine-level benchmarks, in one process and without a server: offline decode throughput and
async scheduling next to vLLM-CPU (vLLM in its own venv, driven over a pipe), a per-phase profile
of one step, and the per-token cost of grammar masks."""
