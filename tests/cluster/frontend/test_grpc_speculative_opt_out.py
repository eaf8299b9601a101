"""gRPC GenerateRequest.speculative_decoding -> SamplingParams (the opt-out itself is tested
end to end over HTTP in tests/workers/test_spec_disagg.py)."""

from __future__ import annotations


def test_grpc_requests_can_opt_out_of_speculation():
    from splitserve.cluster.frontend.grpc.server import sampling_params_from
    from splitserve.proto import load_stubs

    pb2, _ = load_stubs()
    assert sampling_params_from(pb2.GenerateRequest(text="hi")).speculative_decoding is True
    assert (
        sampling_params_from(pb2.GenerateRequest(text="hi", speculative_decoding=False)).speculative_decoding is False
    )
