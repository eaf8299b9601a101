"""Versioned msgpack encoding of the control messages between replicas and the ingress.

Every message is a msgspec Struct, sent as `{"v": version, "kind": kind, "body": struct}`. The
envelope is read first, so a message of another kind or version is refused with a clear error
before its body is looked at; the body is then decoded straight into its Struct, which checks
every field's type and refuses unknown fields. No pickle crosses here. Torch-free.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class MessageError(ValueError):
    """A control message that is malformed, of another kind, or of an unknown version."""


class _Envelope(msgspec.Struct):
    v: int
    kind: str
    body: msgspec.Raw


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


class MessageCodec:
    """Encodes and decodes one channel's messages at one version; `error` is what decode raises."""

    def __init__(self, version: int, error: type[MessageError] = MessageError):
        self.version = version
        self.error = error
        self._decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}

    def encode(self, kind: str, msg: msgspec.Struct) -> bytes:
        return _encoder.encode(_Envelope(self.version, kind, msgspec.Raw(_encoder.encode(msg))))

    def decode(self, kind: str, cls: type[T], data: bytes) -> T:
        try:
            envelope = _envelope_decoder.decode(data)
        except msgspec.DecodeError as exc:  # ValidationError included: not an envelope
            raise self.error(f"not a msgpack {kind} message: {exc}") from None
        if envelope.kind != kind:
            raise self.error(f"expected a {kind} message, got {envelope.kind!r}")
        if envelope.v != self.version:
            raise self.error(f"unsupported {kind} version {envelope.v!r} (this build speaks {self.version})")
        decoder = self._decoders.get(cls)
        if decoder is None:
            decoder = self._decoders[cls] = msgspec.msgpack.Decoder(cls)
        try:
            msg: T = decoder.decode(envelope.body)
            return msg
        except msgspec.DecodeError as exc:
            raise self.error(f"malformed {kind} body: {exc}") from None
