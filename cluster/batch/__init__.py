"""The OpenAI Batch API: /v1/files and /v1/batches routes, and the runner that feeds batch lines
through the ingress's own request path. State lives in the state store (cluster/state/)."""
