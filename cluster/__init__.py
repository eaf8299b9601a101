"""splitserve cluster layer: Ray pools, router, autoscaling, HTTP/gRPC frontends, CLI."""
