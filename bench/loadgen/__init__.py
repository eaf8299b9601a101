"""`splitserve bench`'s load generator, for any OpenAI-compatible server: the workloads it sends,
the arrivals and the streaming client that send them, side-by-side configurations (each server
started and stopped by its process group), the metrics of a run, and its reports and figures."""
